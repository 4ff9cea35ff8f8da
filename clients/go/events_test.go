package kvsvc

// WatchEvents against real `kvsvc serve` processes: stored and evicted keys
// arrive and the index they feed equals Lookup; a cursor resumes from the ring;
// a cursor of another incarnation, or one the ring dropped, gets lost, a paged
// snapshot of what is present, then live events with no gap and no duplicate;
// the stream ends with typed errors; after a kill -9 the next incarnation
// answers the kept cursor with lost + snapshot.

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"sync"
	"syscall"
	"testing"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
)

// waitFor bounds every wait here (a loaded 2-core CI gets room).
const waitFor = 20 * time.Second

// feed reads an EventStream in the background: it keeps every batch, applies it
// to an index (namespace -> hex keys) and records how the stream ended.
type feed struct {
	s       *EventStream
	mu      sync.Mutex
	batches []*pb.EventBatch
	index   map[string]map[string]bool
	err     error
	ended   bool
	changed chan struct{} // closed and replaced at every change
	done    chan struct{}
}

func follow(t *testing.T, s *EventStream) *feed {
	f := &feed{s: s, index: map[string]map[string]bool{}, changed: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(func() {
		s.Close()
		<-f.done
	})
	go func() {
		defer close(f.done)
		for {
			b, err := s.Next()
			f.mu.Lock()
			if err != nil {
				f.err, f.ended = err, true
			} else {
				f.batches = append(f.batches, b)
				f.apply(b)
			}
			close(f.changed)
			f.changed = make(chan struct{})
			f.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return f
}

func (f *feed) apply(b *pb.EventBatch) {
	if b.GetLost() {
		f.index = map[string]map[string]bool{}
	}
	for _, ev := range b.GetEvents() {
		if ev.GetCleared() != nil {
			f.index = map[string]map[string]bool{}
			continue
		}
		ns, keys, stored := ev.GetRemoved().GetNamespace(), ev.GetRemoved().GetKeys(), false
		if st := ev.GetStored(); st != nil {
			ns, keys, stored = st.GetNamespace(), st.GetKeys(), true
		}
		if f.index[ns] == nil {
			f.index[ns] = map[string]bool{}
		}
		for _, k := range keys {
			if stored {
				f.index[ns][hex.EncodeToString(k)] = true
			} else {
				delete(f.index[ns], hex.EncodeToString(k))
			}
		}
	}
}

// until waits (at most waitFor) for pred, under the feed's lock; it fails the
// test when the stream ends first.
func (f *feed) until(t *testing.T, what string, pred func(f *feed) bool) {
	t.Helper()
	deadline := time.After(waitFor)
	for {
		f.mu.Lock()
		ok, ended, err, ch, n := pred(f), f.ended, f.err, f.changed, len(f.batches)
		f.mu.Unlock()
		if ok {
			return
		}
		if ended {
			t.Fatalf("the stream ended before %s: %v", what, err)
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("no %s within %v (%d batches)", what, waitFor, n)
		}
	}
}

func (f *feed) keys(ns string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := []string{}
	for k := range f.index[ns] {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// snapshotDone: a batch with snapshot_done came (call it under the feed's lock, as until does).
func snapshotDone(f *feed) bool {
	for _, b := range f.batches {
		if b.GetSnapshotDone() {
			return true
		}
	}
	return false
}

// after is the batches that follow the first snapshot_done one.
func (f *feed) after() []*pb.EventBatch {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, b := range f.batches {
		if b.GetSnapshotDone() {
			return append([]*pb.EventBatch(nil), f.batches[i+1:]...)
		}
	}
	return nil
}

func (f *feed) all() []*pb.EventBatch {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*pb.EventBatch(nil), f.batches...)
}

// storedKeys and removedEvents of ns in batches.
func storedKeys(batches []*pb.EventBatch, ns string) []string {
	out := []string{}
	for _, b := range batches {
		for _, ev := range b.GetEvents() {
			if st := ev.GetStored(); st != nil && st.GetNamespace() == ns {
				for _, k := range st.GetKeys() {
					out = append(out, hex.EncodeToString(k))
				}
			}
		}
	}
	return out
}

func removedEvents(batches []*pb.EventBatch, ns string) []*pb.RemovedEvent {
	out := []*pb.RemovedEvent{}
	for _, b := range batches {
		for _, ev := range b.GetEvents() {
			if r := ev.GetRemoved(); r != nil && r.GetNamespace() == ns {
				out = append(out, r)
			}
		}
	}
	return out
}

func hexKeys(chunks []Chunk) []string {
	out := []string{}
	for _, c := range chunks {
		out = append(out, hex.EncodeToString(c.Key))
	}
	sort.Strings(out)
	return out
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	sort.Strings(out)
	return out
}

func randChunks(t *testing.T, n, size int) []Chunk {
	out := make([]Chunk, n)
	for i := range out {
		out[i] = Chunk{Key: randBytes(t, 16), Data: randBytes(t, size)}
	}
	return out
}

// presentKeys is the server's truth for chunks' keys: each key's own Lookup.
func presentKeys(t *testing.T, ctx context.Context, c *Client, ns string, chunks []Chunk) []string {
	t.Helper()
	out := []string{}
	for _, ch := range chunks {
		r, err := c.Lookup(ctx, ns, [][]byte{ch.Key})
		if err != nil {
			t.Fatal(err)
		}
		if r.HitChunks == 1 {
			out = append(out, hex.EncodeToString(ch.Key))
		}
	}
	sort.Strings(out)
	return out
}

func watch(t *testing.T, ctx context.Context, c *Client, w WatchOptions) *feed {
	t.Helper()
	s, err := c.WatchEvents(ctx, w)
	if err != nil {
		t.Fatal(err)
	}
	return follow(t, s)
}

func TestEventsStoredAndEvicted(t *testing.T) {
	s := startServer(t, "", "--store-bytes", "1M")
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 60*time.Second)
	ns := uniq(t, "evict")
	f := watch(t, ctx, c, WatchOptions{Namespaces: []string{ns}})
	f.until(t, "the first snapshot", snapshotDone)
	if first := f.all()[0]; !first.GetLost() {
		t.Fatalf("no cursor: the first batch is not lost: %v", first)
	}
	start := f.s.Cursor()
	info, err := c.ServerInfo(ctx)
	if err != nil || start == nil || start.Incarnation != info.ServerStartId {
		t.Fatalf("cursor %+v after the snapshot, server %v err=%v", start, info, err)
	}

	// 40 x 64 KiB into a 1 MiB store: the first ones are evicted.
	chunks := randChunks(t, 40, 64<<10)
	sizes := map[string]int{}
	for _, ch := range chunks {
		sizes[hex.EncodeToString(ch.Key)] = len(ch.Data)
	}
	for i := 0; i < len(chunks); i += 4 {
		if _, err := c.Store(ctx, ns, chunks[i:i+4]); err != nil {
			t.Fatal(err)
		}
	}
	last := hex.EncodeToString(chunks[len(chunks)-1].Key)
	f.until(t, "the last stored key", func(f *feed) bool { return f.index[ns][last] })

	live := f.after()
	if got := sorted(storedKeys(live, ns)); !reflect.DeepEqual(got, hexKeys(chunks)) {
		t.Fatalf("stored keys: %d events' keys, want each of the %d once", len(got), len(chunks))
	}
	prev := start.Sequence
	for _, b := range live {
		if b.GetLost() || b.GetSnapshot() || b.GetSequence() <= prev {
			t.Fatalf("live batch %v after sequence %d", b, prev)
		}
		prev = b.GetSequence()
		for _, ev := range b.GetEvents() {
			st := ev.GetStored()
			if st == nil {
				continue
			}
			want := 0
			for _, k := range st.GetKeys() {
				want += sizes[hex.EncodeToString(k)]
			}
			if st.GetLayout() != "inline" || st.GetTier() != pb.Tier_TIER_MEMORY || st.GetBytes() != uint64(want) {
				t.Fatalf("stored event %v: want layout inline, TIER_MEMORY, %d bytes", st, want)
			}
		}
	}
	removed := removedEvents(live, ns)
	if len(removed) == 0 {
		t.Fatal("a 1 MiB store evicted nothing of 2.5 MiB")
	}
	evictedFirst := false
	for _, r := range removed {
		if r.GetReason() != pb.RemovalReason_REMOVAL_REASON_EVICTED || r.GetTier() != pb.Tier_TIER_MEMORY || r.GetLayout() != "inline" {
			t.Fatalf("removed event %v: want EVICTED from TIER_MEMORY, inline", r)
		}
		for _, k := range r.GetKeys() {
			if _, ok := sizes[hex.EncodeToString(k)]; !ok {
				t.Fatalf("removed a key never stored: %x", k)
			}
			evictedFirst = evictedFirst || string(k) == string(chunks[0].Key)
		}
	}
	if !evictedFirst {
		t.Fatal("the least recently used chunk was not evicted")
	}
	if got, want := f.keys(ns), presentKeys(t, ctx, c, ns, chunks); !reflect.DeepEqual(got, want) {
		t.Fatalf("the index holds %d keys, the server %d:\n%v\n%v", len(got), len(want), got, want)
	}
	if cur := f.s.Cursor(); cur == nil || cur.Sequence != prev {
		t.Fatalf("cursor %+v, want the last batch's %d", cur, prev)
	}
}

func TestEventsCursorResumeLostAndSnapshot(t *testing.T) {
	s := startServer(t, "", "--events-ring", "16")
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 90*time.Second)
	ns := uniq(t, "resume")
	k1 := randChunks(t, 5, 100)
	if _, err := c.Store(ctx, ns, k1); err != nil {
		t.Fatal(err)
	}

	// No cursor: lost, the snapshot in pages of 2 keys (no cursor inside it), then live.
	f := watch(t, ctx, c, WatchOptions{Namespaces: []string{ns}, SnapshotPageKeys: 2})
	f.until(t, "the snapshot", snapshotDone)
	pages := 0
	batches := f.all()
	for i, b := range batches {
		if i == 0 && !b.GetLost() {
			t.Fatalf("first batch %v is not lost", b)
		}
		if b.GetSnapshot() {
			pages++
			if b.GetSequence() != batches[0].GetSequence() {
				t.Fatalf("snapshot page at %d, lost at %d: every page carries S", b.GetSequence(), batches[0].GetSequence())
			}
		}
		if c := cursorAfter(b); (c == nil) == b.GetSnapshotDone() {
			t.Fatalf("batch %d %v: cursor %+v", i, b, c)
		}
		if b.GetSnapshotDone() {
			break
		}
	}
	if pages < 3 {
		t.Fatalf("5 keys in pages of 2: %d pages", pages)
	}
	if got := f.keys(ns); !reflect.DeepEqual(got, hexKeys(k1)) {
		t.Fatalf("snapshot %v, want %v", got, hexKeys(k1))
	}
	cursor := f.s.Cursor()
	f.s.Close()
	<-f.done
	if !errors.Is(f.err, io.EOF) {
		t.Fatalf("Next after Close: %v, want io.EOF", f.err)
	}

	// Resume from the ring: no lost, exactly what happened since.
	k2 := randChunks(t, 3, 100)
	if _, err := c.Store(ctx, ns, k2); err != nil {
		t.Fatal(err)
	}
	f = watch(t, ctx, c, WatchOptions{Namespaces: []string{ns}, Cursor: cursor})
	f.until(t, "the events since the cursor", func(f *feed) bool { return len(storedKeys(f.batches, ns)) >= 3 })
	for _, b := range f.all() {
		if b.GetLost() || b.GetSnapshot() || b.GetSequence() <= cursor.Sequence {
			t.Fatalf("resumed at %d, got %v", cursor.Sequence, b)
		}
	}
	if got := sorted(storedKeys(f.all(), ns)); !reflect.DeepEqual(got, hexKeys(k2)) {
		t.Fatalf("resumed: %v, want %v", got, hexKeys(k2))
	}
	resumed := f.s.Cursor()
	f.s.Close()

	// A cursor of another incarnation: lost, the snapshot holds k1 + k2 + k3, then live.
	k3 := randChunks(t, 2, 100)
	if _, err := c.Store(ctx, ns, k3); err != nil {
		t.Fatal(err)
	}
	f = watch(t, ctx, c, WatchOptions{Namespaces: []string{ns},
		Cursor: &EventCursor{Incarnation: "not-" + resumed.Incarnation, Sequence: resumed.Sequence}})
	f.until(t, "the snapshot after a foreign cursor", snapshotDone)
	before := append(append(append([]Chunk(nil), k1...), k2...), k3...)
	if got := sorted(storedKeys(f.all(), ns)); !f.all()[0].GetLost() || !reflect.DeepEqual(got, hexKeys(before)) {
		t.Fatalf("foreign cursor: lost %v, snapshot %v, want %v", f.all()[0].GetLost(), got, hexKeys(before))
	}
	point := f.s.Cursor().Sequence
	if point <= resumed.Sequence {
		t.Fatalf("snapshot point %d is not past k3 (cursor was %d)", point, resumed.Sequence)
	}
	k4 := randChunks(t, 2, 100)
	if _, err := c.Store(ctx, ns, k4); err != nil {
		t.Fatal(err)
	}
	lastKey := hex.EncodeToString(k4[1].Key)
	f.until(t, "a live event after the snapshot", func(f *feed) bool { return f.index[ns][lastKey] })
	for _, b := range f.after() {
		if b.GetLost() || b.GetSnapshot() || b.GetSequence() <= point {
			t.Fatalf("live batch %v after the snapshot at %d", b, point)
		}
	}
	if got := sorted(storedKeys(f.after(), ns)); !reflect.DeepEqual(got, hexKeys(k4)) {
		t.Fatalf("live after the snapshot: %v, want only k4 %v (no gap, no duplicate)", got, hexKeys(k4))
	}
	all := append(before, k4...)
	if got, want := f.keys(ns), presentKeys(t, ctx, c, ns, all); !reflect.DeepEqual(got, want) {
		t.Fatalf("the index %v, the server %v", got, want)
	}
	kept := f.s.Cursor()
	f.s.Close()

	// 20 more events than the 16-event ring holds: the kept cursor was dropped.
	for i := 0; i < 20; i++ {
		if _, err := c.Store(ctx, uniq(t, "other"), randChunks(t, 1, 10)); err != nil {
			t.Fatal(err)
		}
	}
	f = watch(t, ctx, c, WatchOptions{Namespaces: []string{ns}, Cursor: kept})
	f.until(t, "the snapshot after a dropped cursor", snapshotDone)
	if !f.all()[0].GetLost() {
		t.Fatalf("a cursor older than the ring: first batch %v", f.all()[0])
	}
	if got, want := f.keys(ns), presentKeys(t, ctx, c, ns, all); !reflect.DeepEqual(got, want) {
		t.Fatalf("after the dropped cursor: the index %v, the server %v", got, want)
	}
}

func TestEventsTypedErrors(t *testing.T) {
	// A fatal failure ends the stream with the server's error batch.
	s := startServer(t, "transfer.before_copy=raise")
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 60*time.Second)
	f := watch(t, ctx, c, WatchOptions{})
	f.until(t, "the snapshot", snapshotDone)
	_, err := c.Store(ctx, "ns", []Chunk{{Key: []byte("k"), Data: []byte("v")}})
	expect(t, err, "FatalServerError")
	f.until(t, "the end of the stream", func(f *feed) bool { return f.ended })
	if e := expect(t, f.err, "ServiceNotServing"); !e.Remote || e.Method != "WatchEvents" {
		t.Fatalf("%+v: want a remote error of WatchEvents", e)
	}
	if _, again := f.s.Next(); again != f.err {
		t.Fatalf("Next after the end: %v, want the same %v", again, f.err)
	}

	// A wrong token, and the right one.
	token := newRequestID()
	file := filepath.Join(t.TempDir(), "tenants.json")
	raw, err := json.Marshal(map[string]any{"tenants": map[string]any{
		"a": map[string]any{"tokens": []string{token}, "namespaces": []string{"a/*"}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	authed := startServer(t, "", "--auth-token-file", file)
	wrong, err := newClient(t, authed.addr, Options{Token: newRequestID()}).WatchEvents(ctx, WatchOptions{})
	if err == nil {
		_, err = wrong.Next()
		wrong.Close()
	}
	expect(t, err, "Unauthenticated")
	right := newClient(t, authed.addr, Options{Token: token})
	mine := watch(t, ctx, right, WatchOptions{})
	mine.until(t, "the tenant's snapshot", snapshotDone)
	if _, err := right.Store(ctx, "a/x", []Chunk{{Key: []byte("k"), Data: []byte("v")}}); err != nil {
		t.Fatal(err)
	}
	mine.until(t, "the tenant's own event", func(f *feed) bool { return f.index["a/x"][hex.EncodeToString([]byte("k"))] })

	// Nothing listens: ServiceUnavailable (retryable).
	refused, err := newClient(t, refusedAddress(t), Options{}).WatchEvents(ctx, WatchOptions{})
	if err == nil {
		_, err = refused.Next()
		refused.Close()
	}
	if e := expect(t, err, "ServiceUnavailable"); !e.Retryable {
		t.Fatalf("%+v: want retryable", e)
	}

	// The context ends it: Cancelled; a timeout: DeadlineExceeded.
	cctx, cancel := context.WithCancel(ctx)
	cs := watch(t, cctx, right, WatchOptions{})
	cs.until(t, "the lost batch", func(f *feed) bool { return len(f.batches) > 0 })
	cancel()
	cs.until(t, "the end of a cancelled stream", func(f *feed) bool { return f.ended })
	expect(t, cs.err, "Cancelled")
	ts, err := right.WatchEvents(ctx, WatchOptions{}, WithTimeout(300*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	tf := follow(t, ts)
	tf.until(t, "the end of a timed stream", func(f *feed) bool { return f.ended })
	expect(t, tf.err, "DeadlineExceeded")

	// kill -9: the stream ends with ServiceUnavailable; the next incarnation answers
	// the kept cursor with lost and a snapshot of what it holds, then live events.
	kept := mine.s.Cursor()
	if kept == nil {
		t.Fatal("no cursor after the tenant's events")
	}
	if err := syscall.Kill(authed.cmd.Process.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	mine.until(t, "the end of the stream after kill -9", func(f *feed) bool { return f.ended })
	expect(t, mine.err, "ServiceUnavailable")
	next := startServer(t, "")
	again := newClient(t, next.addr, Options{})
	if _, err := again.Store(ctx, "n", []Chunk{{Key: []byte("before"), Data: []byte("v")}}); err != nil {
		t.Fatal(err)
	}
	resync := watch(t, ctx, again, WatchOptions{Cursor: kept})
	resync.until(t, "the snapshot of the new incarnation", snapshotDone)
	if !resync.all()[0].GetLost() || resync.s.Cursor().Incarnation == kept.Incarnation {
		t.Fatalf("a cursor of the last incarnation: %v, cursor %+v", resync.all()[0], resync.s.Cursor())
	}
	if got := resync.keys("n"); !reflect.DeepEqual(got, []string{hex.EncodeToString([]byte("before"))}) {
		t.Fatalf("the new incarnation's snapshot: %v", got)
	}
	if _, err := again.Store(ctx, "n", []Chunk{{Key: []byte("after"), Data: []byte("v")}}); err != nil {
		t.Fatal(err)
	}
	after := hex.EncodeToString([]byte("after"))
	resync.until(t, "a live event", func(f *feed) bool { return f.index["n"][after] })
}
