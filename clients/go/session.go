package kvsvc

// The client's end of a Session stream (kvsvc/session.py is the Python one):
// Lookup, Store, Retrieve and Fence requests multiplexed on one bidirectional
// stream, each with its own id and deadline, answered in any order with the
// same response messages (and RemoteError envelopes) as the unary calls.
//
// Every request ends: with its answer, at its context's deadline or
// cancellation (answered here, as gRPC answers a unary call), or at once when
// the stream breaks. A request that was written to the stream may have
// started on the server, so a transfer's break, deadline or cancellation is
// TransferUnprovable exactly as on a unary call whose stream was opened; one
// that was never written (the stream had not opened yet) provably did not
// start. A server without the Session RPC answers UNIMPLEMENTED: nothing ran
// there (grpc may send empty headers first, so a request can have been
// written), and the client sends the same requests again as unary calls.

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

// answer is what a waiting caller gets: the response, or the stream's failure.
type answer struct {
	resp *pb.SessionResponse
	err  error // a status error, as a unary call would have failed
}

type pending struct {
	req  *pb.SessionRequest
	dl   time.Time
	sent bool        // written to the stream: it may have reached the server
	done chan answer // buffered (1): whoever removes the entry delivers into it, once
}

type session struct {
	cancel context.CancelFunc

	mu      sync.Mutex
	stream  pb.KVCacheService_SessionClient // set once open
	next    uint64
	pending map[uint64]*pending
	queue   []uint64      // ids to write, in order
	wake    chan struct{} // (1) the writer has something to do
	failure error         // set once: every later request fails with it
	broken  chan struct{} // closed with failure
	sentN   uint64        // requests written (tests read it)
}

// openSession starts a session; it opens in the background, and requests
// sent before it opened are written once the server's headers arrived.
func openSession(kv pb.KVCacheServiceClient) *session {
	ctx, cancel := context.WithCancel(context.Background())
	s := &session{
		cancel:  cancel,
		pending: map[uint64]*pending{},
		wake:    make(chan struct{}, 1),
		broken:  make(chan struct{}),
	}
	go s.run(ctx, kv)
	return s
}

func (s *session) run(ctx context.Context, kv pb.KVCacheServiceClient) {
	stream, err := kv.Session(ctx)
	if err != nil {
		s.fail(broke(err))
		return
	}
	// Nothing is written before the server's initial metadata (a kvsvc server
	// sends it first), so a refused stream usually carries none; one written
	// before an UNIMPLEMENTED did not run and goes again as a unary call.
	md, err := stream.Header()
	if err == nil && md != nil {
		s.mu.Lock()
		s.stream = stream
		s.mu.Unlock()
		go s.write(stream)
	}
	// (an error, or no headers at all: Recv returns the stream's status)
	for {
		resp, err := stream.Recv()
		if err != nil {
			if err == io.EOF {
				err = status.Error(codes.Unavailable, "the session stream ended")
			} else {
				err = broke(err)
			}
			s.fail(err)
			return
		}
		s.mu.Lock()
		if p, ok := s.pending[resp.GetId()]; ok {
			delete(s.pending, resp.GetId())
			p.done <- answer{resp: resp}
		} // else answered after its caller stopped waiting
		s.mu.Unlock()
	}
}

// broke is what pending requests get when the stream ends under them.
func broke(err error) error {
	st, _ := status.FromError(err)
	switch st.Code() {
	case codes.Unimplemented:
		return status.Error(codes.Unimplemented, "the server has no Session RPC")
	case codes.Unauthenticated: // refused before any request ran, as unary
		return err
	}
	return status.Errorf(codes.Unavailable, "the session stream broke (%s: %s)", codeName(st.Code()), st.Message())
}

// write sends queued requests in order, one goroutine per stream (grpc's rule).
func (s *session) write(stream pb.KVCacheService_SessionClient) {
	for {
		select {
		case <-s.wake:
		case <-s.broken:
			return
		}
		for {
			s.mu.Lock()
			if s.failure != nil || len(s.queue) == 0 {
				s.mu.Unlock()
				break
			}
			id := s.queue[0]
			s.queue = s.queue[1:]
			p, ok := s.pending[id]
			var left time.Duration
			if ok {
				left = time.Until(p.dl)
				ok = left > 0 // else its caller is about to give up: not sent
			}
			if ok {
				p.sent = true
				s.sentN++
			}
			s.mu.Unlock()
			if !ok {
				continue
			}
			p.req.Timeout = durationpb.New(left)
			if err := stream.Send(p.req); err != nil {
				// The stream is finished; the reader gets its status and fails everyone.
				return
			}
		}
	}
}

// fail ends every pending request with err (once; later calls change nothing).
func (s *session) fail(err error) {
	s.mu.Lock()
	if s.failure != nil {
		s.mu.Unlock()
		return
	}
	s.failure = err
	for id, p := range s.pending {
		delete(s.pending, id)
		p.done <- answer{err: err}
	}
	s.queue = nil
	close(s.broken)
	s.mu.Unlock()
	s.cancel()
}

// failureErr is what ended the session (nil while it is open).
func (s *session) failureErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failure
}

func (s *session) failed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failure != nil
}

// close ends pending requests as CANCELLED (as closing cuts unary calls), then the stream.
func (s *session) close() {
	s.fail(status.Error(codes.Canceled, "the client was closed"))
}

// do sends req (its oneof set) and waits for its answer until ctx ends (ctx
// carries the call's deadline). It returns the response, or a status error
// and whether the request may have reached the server.
func (s *session) do(ctx context.Context, req *pb.SessionRequest) (*pb.SessionResponse, bool, error) {
	dl, _ := ctx.Deadline()
	if size := proto.Size(req); size > maxMessageBytes {
		// Refused here, as grpc refuses it for a unary call: sent, it would end the stream.
		return nil, false, status.Errorf(codes.ResourceExhausted,
			"trying to send message larger than max (%d vs. %d)", size, maxMessageBytes)
	}
	p := &pending{req: req, dl: dl, done: make(chan answer, 1)}
	s.mu.Lock()
	if s.failure != nil {
		err := s.failure
		s.mu.Unlock()
		return nil, false, err
	}
	s.next++
	req.Id = s.next
	s.pending[req.Id] = p
	s.queue = append(s.queue, req.Id)
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
	select {
	case a := <-p.done:
		return a.resp, p.sent || a.resp != nil, a.err
	case <-ctx.Done():
	}
	s.mu.Lock()
	if _, mine := s.pending[req.Id]; !mine {
		s.mu.Unlock()
		a := <-p.done // delivered under the lock: already there
		return a.resp, p.sent || a.resp != nil, a.err
	}
	delete(s.pending, req.Id)
	sent := p.sent
	s.mu.Unlock()
	return nil, sent, status.FromContextError(ctx.Err()).Err()
}

// sessionFor is the open session (opened again after a break), or nil: unary.
func (c *Client) sessionFor() *session {
	c.sessMu.Lock()
	defer c.sessMu.Unlock()
	if c.unaryOnly || c.closed {
		return nil
	}
	if c.sess == nil || c.sess.failed() {
		c.sess = openSession(c.kv)
	}
	return c.sess
}

// noSession makes every later call unary: the server has no Session RPC.
func (c *Client) noSession() {
	c.sessMu.Lock()
	c.unaryOnly = true
	c.sessMu.Unlock()
}

// UsesSession tells whether Lookup/Store/Retrieve/Fence go over a Session
// stream: false with Options.DisableSession, or once the server answered that
// it has no Session RPC.
func (c *Client) UsesSession() bool {
	c.sessMu.Lock()
	defer c.sessMu.Unlock()
	return !c.unaryOnly
}

// carried is how one unary RPC travels on a session: its request in the
// SessionRequest's oneof, and the getter of its response arm.
type carried[Resp any] struct {
	req    *pb.SessionRequest
	unwrap func(*pb.SessionResponse) Resp
}

// overSession runs a call on the session; used is false when it must go unary
// instead (no session, or the server has no Session RPC).
func overSession[R comparable, Resp response[R]](c *Client, ctx context.Context, p *plan, k *carried[Resp]) (r R, used bool, err error) {
	s := c.sessionFor()
	if s == nil {
		return r, false, nil
	}
	resp, sent, err := s.do(ctx, k.req)
	if err != nil {
		if status.Code(err) == codes.Unimplemented {
			c.noSession()
			return r, false, nil
		}
		return r, true, FromGRPCError(err, p.header.RequestId, p.method, p.transfer, sent)
	}
	if env := resp.GetError(); env != nil { // a request the server could not take as its kind
		return r, true, FromRemoteError(env, p.method)
	}
	r, err = settle[R, Resp](p, k.unwrap(resp)) // a nil arm: EMPTY_RESPONSE
	return r, true, err
}

func (s *session) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprintf("session(pending=%d sent=%d failure=%v)", len(s.pending), s.sentN, s.failure)
}
