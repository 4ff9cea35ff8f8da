package kvsvc

// The client's end of WatchEvents: an iterator over the server's event batches
// (stored / removed / cleared), with the cursor to keep and resume from.

import (
	"context"
	"errors"
	"io"
	"sync"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// EventCursor is where a watcher stands: the last event it applied, in one
// server incarnation (the server's ServerStartId).
type EventCursor struct {
	Incarnation string
	Sequence    uint64
}

// WatchOptions say what a WatchEvents stream follows and where it starts.
type WatchOptions struct {
	// Namespaces to follow; empty means every namespace the caller may see.
	Namespaces []string
	// Cursor to resume after; nil (or one the server can no longer serve:
	// another incarnation, older than its ring) starts with a lost batch and a
	// snapshot of what is present.
	Cursor *EventCursor
	// SnapshotPageKeys is the most keys in one snapshot batch (0: the server's default).
	SnapshotPageKeys uint32
}

// EventStream is one open WatchEvents stream: one goroutine reads it with
// Next; Cursor and Close may be called from any.
type EventStream struct {
	stream    pb.KVCacheService_WatchEventsClient
	cancel    context.CancelFunc
	requestID string

	mu     sync.Mutex
	cursor *EventCursor
	err    error // the stream's end, once known
	closed bool
}

// WatchEvents opens a stream of the server's event batches. Read it with Next
// and keep Cursor() to resume from after a break; Close it when done. The
// stream lives as long as ctx (or WithTimeout, for its whole life): no default
// timeout applies to it.
func (c *Client) WatchEvents(ctx context.Context, w WatchOptions, opts ...CallOption) (*EventStream, error) {
	req := &pb.WatchEventsRequest{Namespaces: w.Namespaces, SnapshotPageKeys: w.SnapshotPageKeys}
	if w.Cursor != nil {
		req.Cursor = &pb.EventCursor{Incarnation: w.Cursor.Incarnation, Sequence: w.Cursor.Sequence}
	}
	p, err := prepare("WatchEvents", false, false, &req.Header, opts)
	if err != nil {
		return nil, err
	}
	var cancel context.CancelFunc
	if p.opts.timeoutSet {
		ctx, cancel = context.WithTimeout(ctx, p.opts.timeout)
	} else {
		ctx, cancel = context.WithCancel(ctx)
	}
	stream, err := c.kv.WatchEvents(ctx, req)
	if err != nil {
		cancel()
		return nil, FromGRPCError(err, p.header.RequestId, p.method, false, false)
	}
	s := &EventStream{stream: stream, cancel: cancel, requestID: p.header.RequestId}
	if w.Cursor != nil {
		cur := *w.Cursor
		s.cursor = &cur
	}
	return s, nil
}

// Next waits for the next batch. It returns io.EOF once Close was called, and
// otherwise a typed error when the stream ends (it never ends in silence): the
// server's RemoteError batch (e.g. *ServiceNotServing), or a transport failure
// (*ServiceUnavailable, *Unauthenticated, *Cancelled or *DeadlineExceeded by
// the context). After an error, every call returns the same error.
func (s *EventStream) Next() (*pb.EventBatch, error) {
	s.mu.Lock()
	if err := s.err; err != nil {
		s.mu.Unlock()
		return nil, err
	}
	s.mu.Unlock()
	resp, err := s.stream.Recv()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, s.end(io.EOF)
	}
	switch {
	case errors.Is(err, io.EOF):
		err = status.Error(codes.Unavailable, "the events stream ended without an error batch")
		return nil, s.end(FromGRPCError(err, s.requestID, "WatchEvents", false, false))
	case err != nil:
		return nil, s.end(FromGRPCError(err, s.requestID, "WatchEvents", false, false))
	}
	if env := resp.GetError(); env != nil {
		return nil, s.end(FromRemoteError(env, "WatchEvents"))
	}
	batch := resp.GetBatch()
	if batch == nil {
		return nil, s.end(build("", &KVServiceError{
			Message:   "WatchEvents response carries neither batch nor error (newer server?)",
			Reason:    "EMPTY_RESPONSE",
			RequestID: s.requestID,
			Method:    "WatchEvents",
		}))
	}
	s.cursor = cursorAfter(batch)
	return batch, nil
}

// cursorAfter is where a caller stands once it applied batch: the batch's
// point, except inside a resync (a lost batch and the snapshot pages before the
// one with SnapshotDone), where a cursor would skip the rest of the snapshot.
func cursorAfter(b *pb.EventBatch) *EventCursor {
	if b.GetSnapshotDone() || (!b.GetLost() && !b.GetSnapshot()) {
		return &EventCursor{Incarnation: b.GetIncarnation(), Sequence: b.GetSequence()}
	}
	return nil
}

// end records the stream's end (s.mu held) and releases it.
func (s *EventStream) end(err error) error {
	if s.err == nil {
		s.err = err
	}
	s.cancel()
	return s.err
}

// Cursor is where the caller stands after the last batch Next returned (the
// cursor it was opened with before any): pass it as WatchOptions.Cursor to
// resume. Nil inside a resync: resuming from there starts a new snapshot.
func (s *EventStream) Cursor() *EventCursor {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cursor == nil {
		return nil
	}
	cur := *s.cursor
	return &cur
}

// RequestID is the id the server logs this stream under.
func (s *EventStream) RequestID() string { return s.requestID }

// Close ends the stream; a Next waiting on it returns io.EOF.
func (s *EventStream) Close() {
	s.mu.Lock()
	s.closed = true
	if s.err == nil {
		s.err = io.EOF
	}
	s.mu.Unlock()
	s.cancel()
}
