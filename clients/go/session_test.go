package kvsvc

// The Session stream against real `kvsvc serve` processes: the same results as
// unary calls, many calls on one stream, a server killed mid-call, a deadline
// per request, unary calls to a server without the RPC, and the token.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// sessionOf is the client's current session, failing the test when it has none.
func sessionOf(t *testing.T, c *Client) *session {
	t.Helper()
	c.sessMu.Lock()
	s := c.sess
	c.sessMu.Unlock()
	if s == nil {
		t.Fatal("the client opened no session")
	}
	return s
}

func sentOn(s *session) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sentN
}

// twoChunkStore stores two chunks of one block each: a transfer.copy failpoint
// (after the first chunk) fires in its middle.
func twoChunkStore(mappingID string) *pb.StoreRequest {
	return &pb.StoreRequest{Source: &pb.StoreRequest_Blocks{Blocks: &pb.BlockChunks{
		MappingId: mappingID, Chunks: []*pb.BlockChunk{
			{Key: []byte("x"), BlockIds: []uint32{1}}, {Key: []byte("y"), BlockIds: []uint32{2}}}}}}
}

// outcome is what a call returned, without the ids that differ from call to call.
func outcome(v interface{ String() string }, err error) string {
	if err != nil {
		var e *KVServiceError
		if !errors.As(err, &e) {
			return fmt.Sprintf("untyped %v", err)
		}
		return fmt.Sprintf("%s %s %v remote=%v", e.Class, e.Reason, e.TransferState, e.Remote)
	}
	text := v.String()
	for _, field := range []string{"transfer_id", "server_start_id"} {
		for {
			i := strings.Index(text, field+":")
			if i < 0 {
				break
			}
			j := strings.IndexByte(text[i:], '"')
			k := strings.IndexByte(text[i+j+1:], '"')
			text = text[:i] + text[i+j+1+k+1:]
		}
	}
	return text
}

func TestSessionResultsEqualUnary(t *testing.T) {
	s := sharedServer(t)
	ctx := ctxFor(t, 60*time.Second)
	run := func(c *Client, tag string) []string {
		ns := uniq(t, "eq-"+tag)
		name := "eq-" + tag
		content := bytes.Repeat([]byte{7, 1, 9, 3}, 64)
		if err := os.WriteFile(filepath.Join(s.shmDir, name), content, 0o600); err != nil {
			t.Fatal(err)
		}
		m, err := c.Map(ctx, mapRequest(ns, name, 256))
		if err != nil {
			t.Fatal(err)
		}
		k := func(s string) []byte { return []byte(s) }
		var out []string
		add := func(v interface{ String() string }, err error) { out = append(out, outcome(v, err)) }
		add(c.Store(ctx, ns, []Chunk{{k("a"), bytes.Repeat(k("A"), 100)}, {k("b"), k("bee")}}))
		add(c.Store(ctx, ns, []Chunk{{k("a"), k("again")}}))
		add(c.Lookup(ctx, ns, [][]byte{k("a"), k("b"), k("c")}))
		add(c.Lookup(ctx, ns, [][]byte{k("c"), k("a")}))
		add(c.Retrieve(ctx, ns, [][]byte{k("a"), k("b"), k("zz"), k("a")}))
		add(c.Lookup(ctx, "", [][]byte{k("a")}))                   // InvalidRequest
		add(c.LookupMapping(ctx, "nope", [][]byte{k("a")}))        // MappingLost
		add(c.StoreRaw(ctx, blockStore(m.MappingId, "blk", 0, 1))) // a block transfer
		add(c.LookupMapping(ctx, m.MappingId, [][]byte{k("blk"), k("a")}))
		add(c.RetrieveRaw(ctx, blockRetrieve(m.MappingId, "blk", 2, 3)))
		add(c.RetrieveRaw(ctx, blockRetrieve("gone", "blk", 2, 3))) // MappingLost, NOT_STARTED
		add(c.Fence(ctx, m.MappingId, nil))
		add(c.Fence(ctx, "", []string{uniq(t, "never-seen")}))
		add(c.StoreRaw(ctx, &pb.StoreRequest{})) // unset oneof: UnsupportedRequest
		after, _ := os.ReadFile(filepath.Join(s.shmDir, name))
		out = append(out, fmt.Sprintf("blocks 2..3 = blocks 0..1: %v", bytes.Equal(after[128:], content[:128])))
		if _, err := c.Unmap(ctx, m.MappingId); err != nil {
			t.Fatal(err)
		}
		return out
	}
	sc := newClient(t, s.addr, Options{})
	uc := newClient(t, s.addr, Options{DisableSession: true})
	viaSession, viaUnary := run(sc, "s"), run(uc, "u")
	for i := range viaUnary {
		if viaSession[i] != viaUnary[i] {
			t.Errorf("step %d:\n session: %s\n   unary: %s", i, viaSession[i], viaUnary[i])
		}
	}
	if !strings.Contains(viaSession[len(viaSession)-1], "true") {
		t.Errorf("the block round trip did not move the bytes: %v", viaSession)
	}
	sess := sessionOf(t, sc)
	if n := sentOn(sess); n != 14 || sess.failed() || !sc.UsesSession() {
		t.Errorf("the session carried %d of 14 calls (%v)", n, sess)
	}
	if uc.sess != nil || uc.UsesSession() {
		t.Error("DisableSession opened a session")
	}
}

func TestSessionManyConcurrentCalls(t *testing.T) {
	// A slow Fence stays pending while every other answer overtakes it.
	s := startServer(t, "handler.enter=Fence@sleep(6000)")
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 120*time.Second)
	ns := uniq(t, "many")
	fenced := make(chan error, 1)
	t0 := time.Now()
	go func() {
		_, err := c.Fence(ctx, "", []string{uniq(t, "f")})
		fenced <- err
	}()
	const n = 64
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			key := []byte(fmt.Sprintf("key-%d", i))
			data := bytes.Repeat([]byte{byte(i)}, 100+i)
			if _, err := c.Store(ctx, ns, []Chunk{{key, data}}); err != nil {
				errs <- err
				return
			}
			missing := []byte(fmt.Sprintf("none-%d", i))
			hit, err := c.Lookup(ctx, ns, [][]byte{key, missing})
			if err != nil || hit.HitChunks != 1 {
				errs <- fmt.Errorf("lookup %d: %v %v", i, hit, err)
				return
			}
			got, err := c.Retrieve(ctx, ns, [][]byte{key})
			if err != nil || len(got.Chunks) != 1 || !bytes.Equal(got.Chunks[0].Key, key) ||
				!bytes.Equal(got.Chunks[0].Data, data) {
				errs <- fmt.Errorf("retrieve %d: another call's answer or none: %v", i, err)
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if time.Since(t0) < 5*time.Second { // else too loaded a host to tell
		select {
		case err := <-fenced:
			t.Errorf("the slow Fence ended before the %d other calls: %v", 3*n, err)
		default:
		}
	}
	if err := <-fenced; err != nil {
		t.Fatal(err)
	}
	sess := sessionOf(t, c)
	if got := sentOn(sess); got != 3*n+1 || sess.failed() {
		t.Errorf("one session carried %d of %d calls (%v)", got, 3*n+1, sess)
	}
}

func TestSessionServerKilledMidCall(t *testing.T) {
	s := startServer(t, "transfer.copy=sleep(20000);handler.enter=Lookup@sleep(20000)")
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 60*time.Second)
	if err := os.WriteFile(filepath.Join(s.shmDir, "r"), randBytes(t, 256), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := c.Map(ctx, mapRequest(uniq(t, "ns-kill"), "r", 256))
	if err != nil {
		t.Fatal(err)
	}
	rid := uniq(t, "killed")
	stored, looked := make(chan error, 1), make(chan error, 1)
	go func() {
		_, err := c.StoreRaw(ctx, twoChunkStore(m.MappingId), WithRequestID(rid))
		stored <- err
	}()
	go func() {
		_, err := c.Lookup(ctx, "ns", [][]byte{[]byte("k")})
		looked <- err
	}()
	for {
		info, err := c.ServerInfo(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.InflightTransfers >= 1 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(time.Second) // the Lookup reached the server too
	t0 := time.Now()
	if err := syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	e := expect(t, <-stored, "TransferUnprovable")
	if e.TransferState != pb.TransferState_TRANSFER_STATE_UNKNOWN || e.BuffersReusable() || e.RequestID != rid ||
		e.Code != codes.Unavailable || !strings.Contains(e.Message, "session stream broke") {
		t.Errorf("%+v", e)
	}
	l := expect(t, <-looked, "ServiceUnavailable")
	if l.Code != codes.Unavailable || !l.Retryable || !strings.Contains(l.Message, "session stream broke") {
		t.Errorf("%+v", l)
	}
	if d := time.Since(t0); d > 10*time.Second {
		t.Errorf("took %v: not at once (the deadlines were 60 s)", d)
	}
	broken := sessionOf(t, c)
	// The next call opens a new stream: to nothing, it provably did not start...
	_, err = c.StoreRaw(ctx, blockStore(m.MappingId, "z", 3), WithTimeout(10*time.Second))
	if e := expect(t, err, "ServiceUnavailable"); e.TransferState != pb.TransferState_TRANSFER_STATE_NOT_STARTED {
		t.Errorf("%+v", e)
	}
	// ...and to a server back on the same address, it works.
	again, err := launch("", "--listen", s.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(again.stop)
	for {
		_, err = c.Store(ctx, "ns", []Chunk{{[]byte("k"), []byte("v")}}, WithTimeout(5*time.Second))
		if err == nil || !asClass(err, "ServiceUnavailable") || ctx.Err() != nil {
			break
		}
		time.Sleep(200 * time.Millisecond) // the channel's reconnect backoff
	}
	if err != nil {
		t.Fatal(err)
	}
	if r, err := c.Lookup(ctx, "ns", [][]byte{[]byte("k")}); err != nil || r.HitChunks != 1 {
		t.Fatalf("%v %v", r, err)
	}
	if now := sessionOf(t, c); now == broken || now.failed() {
		t.Errorf("no new session after the break: %v", now)
	}
}

func TestSessionDeadlinePerRequest(t *testing.T) {
	s := startServer(t, "handler.enter=Lookup@hang")
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 60*time.Second)
	if _, err := c.Store(ctx, "ns", []Chunk{{[]byte("k"), []byte("v")}}); err != nil {
		t.Fatal(err)
	}
	sess := sessionOf(t, c)
	hung := make(chan error, 1)
	t0 := time.Now()
	go func() {
		_, err := c.Lookup(ctx, "ns", [][]byte{[]byte("k")}, WithTimeout(3*time.Second))
		hung <- err
	}()
	// Others on the stream go on while the Lookup waits for its deadline.
	for i := 0; i < 5; i++ {
		got, err := c.Retrieve(ctx, "ns", [][]byte{[]byte("k")})
		if err != nil || len(got.Chunks) != 1 || string(got.Chunks[0].Data) != "v" {
			t.Fatalf("%v %v", got, err)
		}
	}
	if time.Since(t0) < 2500*time.Millisecond { // else too loaded a host to tell
		select {
		case err := <-hung:
			t.Fatalf("the Lookup ended before its deadline: %v", err)
		default:
		}
	}
	e := expect(t, <-hung, "DeadlineExceeded")
	if e.Code != codes.DeadlineExceeded || e.Reason != "TRANSPORT_DEADLINE_EXCEEDED" || e.Remote {
		t.Errorf("%+v", e)
	}
	if d := time.Since(t0); d < 2900*time.Millisecond || d > 6*time.Second {
		t.Errorf("took %v for a 3 s deadline", d)
	}
	// A context deadline is a request's deadline too.
	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	_, err := c.Lookup(short, "ns", [][]byte{[]byte("k")})
	expect(t, err, "DeadlineExceeded")
	if _, err := c.Fence(ctx, "", []string{uniq(t, "f")}); err != nil {
		t.Fatal(err)
	}
	if now := sessionOf(t, c); now != sess || sess.failed() {
		t.Errorf("the deadline broke the session: %v", now)
	}
	// Closing the client ends a pending call at once, as Cancelled.
	closing := make(chan error, 1)
	go func() {
		_, err := c.Lookup(ctx, "ns", [][]byte{[]byte("k")}, WithTimeout(30*time.Second))
		closing <- err
	}()
	time.Sleep(300 * time.Millisecond)
	t1 := time.Now()
	c.Close()
	if e := expect(t, <-closing, "Cancelled"); e.Code != codes.Canceled {
		t.Errorf("%+v", e)
	}
	if d := time.Since(t1); d > 3*time.Second {
		t.Errorf("close took %v to end the call", d)
	}
}

func TestSessionFallsBackToUnary(t *testing.T) {
	cmd, err := withoutSessionCmd()
	if err != nil {
		t.Fatal(err)
	}
	s, err := launchCmd(cmd, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stop)
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 60*time.Second)
	if err := os.WriteFile(filepath.Join(s.shmDir, "r"), randBytes(t, 256), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := c.Map(ctx, mapRequest(uniq(t, "ns-old"), "r", 256))
	if err != nil {
		t.Fatal(err)
	}
	// The first call that would use the session: a block transfer, sent unary instead.
	if st, err := c.StoreRaw(ctx, blockStore(m.MappingId, "b", 0, 1)); err != nil || st.StoredBytes != 128 {
		t.Fatalf("%v %v", st, err)
	}
	if c.UsesSession() {
		t.Error("still using a session after UNIMPLEMENTED")
	}
	if r, err := c.LookupMapping(ctx, m.MappingId, [][]byte{[]byte("b")}); err != nil || r.HitChunks != 1 {
		t.Fatalf("%v %v", r, err)
	}
	if _, err := c.Fence(ctx, m.MappingId, nil); err != nil {
		t.Fatal(err)
	}
	// The server may send (empty) headers before UNIMPLEMENTED, so a request can
	// have been written; none ran, and each was answered by its unary call.
	if sess := sessionOf(t, c); status.Code(sess.failureErr()) != codes.Unimplemented {
		t.Errorf("the refused session ended as %v", sess)
	}
	// Its own client, many calls at once before any answer: each goes unary.
	fresh := newClient(t, s.addr, Options{})
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := fresh.Lookup(ctx, "ns", [][]byte{[]byte("k")}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
}

func TestSessionCarriesTheToken(t *testing.T) {
	token := newRequestID()
	file := filepath.Join(t.TempDir(), "tenants.json")
	raw, _ := json.Marshal(map[string]any{"tenants": map[string]any{
		"a": map[string]any{"tokens": []string{token}, "namespaces": []string{"*"}}}})
	if err := os.WriteFile(file, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	s := startServer(t, "", "--auth-token-file", file)
	ctx := ctxFor(t, 30*time.Second)
	good := newClient(t, s.addr, Options{Token: token})
	if _, err := good.Store(ctx, "ns", []Chunk{{[]byte("k"), []byte("v")}}); err != nil {
		t.Fatal(err)
	}
	if r, err := good.Lookup(ctx, "ns", [][]byte{[]byte("k")}); err != nil || r.HitChunks != 1 {
		t.Fatalf("%v %v", r, err)
	}
	if n := sentOn(sessionOf(t, good)); n != 2 {
		t.Errorf("the session carried %d of 2 calls", n)
	}
	for _, token := range []string{"", newRequestID()} {
		bad := newClient(t, s.addr, Options{Token: token})
		for i := 0; i < 2; i++ { // and again on a new stream
			_, err := bad.Lookup(ctx, "ns", [][]byte{[]byte("k")})
			if e := expect(t, err, "Unauthenticated"); e.Code != codes.Unauthenticated {
				t.Errorf("%+v", e)
			}
			_, err = bad.Retrieve(ctx, "ns", [][]byte{[]byte("k")})
			expect(t, err, "Unauthenticated")
			// Refused before any handler ran: a block transfer's buffers are free.
			_, err = bad.StoreRaw(ctx, blockStore("m", "k", 0))
			if e := expect(t, err, "Unauthenticated"); !e.BuffersReusable() {
				t.Errorf("%+v", e)
			}
		}
		if !bad.UsesSession() {
			t.Error("UNAUTHENTICATED turned the session off")
		}
	}
}
