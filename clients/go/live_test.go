package kvsvc

// Against real `kvsvc serve` processes: the round trip, health, deadlines and
// every error the server can be made to raise.

import (
	"bytes"
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

var ridRE = regexp.MustCompile(`^[0-9a-f]{32}$`)

func randBytes(t *testing.T, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func uniq(t *testing.T, prefix string) string { return prefix + "-" + newRequestID() }

// mapRequest maps one rank with one uint8 tensor of 4 blocks of 64 bytes over file name.
func mapRequest(namespace, name string, sizeBytes uint64) *pb.MapRequest {
	return &pb.MapRequest{
		Namespace: namespace,
		Ranks: []*pb.RankRegion{{
			Context: &pb.RankContext{TpSize: 1, PpSize: 1, GroupId: "g"},
			Tensors: []*pb.KVTensor{{
				Name: "layer.0",
				Handle: &pb.MemoryHandle{Kind: &pb.MemoryHandle_SharedMemory{
					SharedMemory: &pb.SharedMemoryHandle{Name: name, SizeBytes: sizeBytes}}},
				Shape: []int64{4, 64}, Strides: []int64{64, 1}, Dtype: pb.Dtype_DTYPE_UINT8, BlockDim: 0,
			}},
		}},
	}
}

func blockStore(mappingID, key string, ids ...uint32) *pb.StoreRequest {
	return &pb.StoreRequest{Source: &pb.StoreRequest_Blocks{Blocks: &pb.BlockChunks{
		MappingId: mappingID, Chunks: []*pb.BlockChunk{{Key: []byte(key), BlockIds: ids}}}}}
}

func blockRetrieve(mappingID, key string, ids ...uint32) *pb.RetrieveRequest {
	return &pb.RetrieveRequest{Target: &pb.RetrieveRequest_Blocks{Blocks: &pb.BlockChunks{
		MappingId: mappingID, Chunks: []*pb.BlockChunk{{Key: []byte(key), BlockIds: ids}}}}}
}

// expect asserts that err is of class name (via errors.As) and returns its fields.
func expect(t *testing.T, err error, name string) *KVServiceError {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, want %s", name)
	}
	if !asClass(err, name) {
		t.Fatalf("got %T %v, want %s", err, err, name)
	}
	return base(t, err)
}

func TestRoundTripIsBitExact(t *testing.T) {
	c := newClient(t, sharedServer(t).addr, Options{})
	ctx := ctxFor(t, 30*time.Second)
	ns := uniq(t, "rt")
	chunks := []Chunk{
		{randBytes(t, 16), randBytes(t, 1000)},
		{randBytes(t, 16), append([]byte{0, 0}, randBytes(t, 5000)...)},
		{randBytes(t, 16), randBytes(t, 9000)},
	}
	var total uint64
	keys := [][]byte{}
	for _, ch := range chunks {
		total += uint64(len(ch.Data))
		keys = append(keys, ch.Key)
	}
	st, err := c.Store(ctx, ns, chunks)
	if err != nil {
		t.Fatal(err)
	}
	if st.StoredChunks != 3 || st.PresentChunks != 0 || st.StoredBytes != total || !ridRE.MatchString(st.TransferId) {
		t.Fatalf("store result %v", st)
	}
	missing := randBytes(t, 16)
	if r, err := c.Lookup(ctx, ns, keys); err != nil || r.HitChunks != 3 {
		t.Fatalf("lookup %v %v", r, err)
	}
	if r, err := c.Lookup(ctx, ns, [][]byte{keys[0], missing, keys[1]}); err != nil || r.HitChunks != 1 {
		t.Fatalf("lookup with a gap %v %v", r, err)
	}
	if r, err := c.Lookup(ctx, ns+"-other", keys); err != nil || r.HitChunks != 0 {
		t.Fatalf("other namespace %v %v", r, err)
	}
	got, err := c.Retrieve(ctx, ns, append(append([][]byte{}, keys...), missing, keys[0]))
	if err != nil {
		t.Fatal(err)
	}
	if got.LoadedChunks != 3 || len(got.Chunks) != 3 || got.LoadedBytes != total {
		t.Fatalf("retrieve result: %d chunks, %d bytes", got.LoadedChunks, got.LoadedBytes)
	}
	for i, ch := range got.Chunks {
		if !bytes.Equal(ch.Key, keys[i]) || !bytes.Equal(ch.Data, chunks[i].Data) {
			t.Errorf("chunk %d differs", i)
		}
	}
	again, err := c.Store(ctx, ns, chunks, WithTimeout(10*time.Second))
	if err != nil || again.StoredChunks != 0 || again.PresentChunks != 3 {
		t.Fatalf("second store %v %v", again, err)
	}
}

func TestServerInfoAndHealth(t *testing.T) {
	c := newClient(t, sharedServer(t).addr, Options{})
	ctx := ctxFor(t, 30*time.Second)
	info, err := c.ServerInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.EnvelopeVersion != 1 || !info.Serving || info.FailureReason != "" || info.FailureTime != nil ||
		info.CapacityBytes == 0 || info.Version == "" || info.Device != "cpu" {
		t.Errorf("info %v", info)
	}
	if d := time.Since(info.StartTime.AsTime()); d < -time.Minute || d > 10*time.Minute {
		t.Errorf("start time %v", info.StartTime.AsTime())
	}
	for _, name := range []string{"", HealthServiceName} {
		if s, err := c.HealthCheck(ctx, name); err != nil || s != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q: %v %v", name, s, err)
		}
	}
	_, err = c.HealthCheck(ctx, "no.such.Service")
	if e := expect(t, err, "NotFound"); e.Reason != "TRANSPORT_NOT_FOUND" || e.Remote {
		t.Errorf("unknown service: %+v", e)
	}
}

func TestEmptyNamespaceIsInvalidRequest(t *testing.T) {
	c := newClient(t, sharedServer(t).addr, Options{})
	ctx := ctxFor(t, 30*time.Second)
	_, err1 := c.Store(ctx, "", []Chunk{{[]byte("k"), []byte("v")}})
	_, err2 := c.Retrieve(ctx, "", [][]byte{[]byte("k")})
	for _, err := range []error{err1, err2} {
		e := expect(t, err, "InvalidRequest")
		if e.Class != "InvalidRequest" || e.Code != codes.InvalidArgument || e.Reason != "INVALID_ARGUMENT" ||
			e.Metadata["field"] != "namespace" || !e.Remote || !ridRE.MatchString(e.RequestID) ||
			e.TransferState != pb.TransferState_TRANSFER_STATE_NOT_STARTED {
			t.Errorf("%+v", e)
		}
	}
	_, err := c.Store(ctx, "ns", []Chunk{{[]byte("a"), []byte("x")}, {nil, []byte("y")}})
	if e := expect(t, err, "InvalidRequest"); e.Metadata["keyIndex"] != "1" {
		t.Errorf("empty key: %+v", e)
	}
}

func TestUnsupportedRequests(t *testing.T) {
	c := newClient(t, sharedServer(t).addr, Options{})
	ctx := ctxFor(t, 30*time.Second)
	_, e1 := c.StoreRaw(ctx, &pb.StoreRequest{})
	_, e2 := c.RetrieveRaw(ctx, &pb.RetrieveRequest{})
	_, e3 := c.LookupRaw(ctx, &pb.LookupRequest{})
	for i, err := range []error{e1, e2, e3} {
		e := expect(t, err, "UnsupportedRequest")
		if !asClass(err, "InvalidRequest") || e.Reason != "UNSUPPORTED_REQUEST" ||
			e.Metadata["field"] != []string{"source", "target", "scope"}[i] {
			t.Errorf("unset oneof %d: %+v", i, e)
		}
	}
	req := &pb.LookupRequest{Header: &pb.RequestHeader{EnvelopeVersion: 99},
		Scope: &pb.LookupRequest_Namespace{Namespace: "ns"}, Keys: [][]byte{[]byte("k")}}
	_, err := c.LookupRaw(ctx, req)
	e := expect(t, err, "UnsupportedRequest")
	if e.Reason != "UNSUPPORTED_ENVELOPE_VERSION" || e.Metadata["envelopeVersion"] != "99" ||
		e.Metadata["supported"] != "1" || e.Type != "UnsupportedRequest" {
		t.Errorf("envelope 99: %+v", e)
	}
}

func TestUnknownMappingIsMappingLost(t *testing.T) {
	c := newClient(t, sharedServer(t).addr, Options{})
	ctx := ctxFor(t, 30*time.Second)
	_, e1 := c.LookupMapping(ctx, "nope", [][]byte{[]byte("k")})
	_, e2 := c.Unmap(ctx, "nope")
	_, e3 := c.Fence(ctx, "nope", nil)
	for _, err := range []error{e1, e2, e3} {
		e := expect(t, err, "MappingLost")
		if !asClass(err, "NotFound") || e.Reason != "MAPPING_NOT_FOUND" || e.Metadata["mappingId"] != "nope" ||
			e.Metadata["serverStartId"] == "" {
			t.Errorf("%+v", e)
		}
	}
}

func TestRequestIDsAndFence(t *testing.T) {
	c := newClient(t, sharedServer(t).addr, Options{})
	ctx := ctxFor(t, 30*time.Second)
	rid := uniq(t, "rid")
	r, err := c.Store(ctx, "ns-rid", []Chunk{{[]byte("k"), []byte("v")}}, WithRequestID(rid))
	if err != nil || r.TransferId != rid {
		t.Fatalf("%v %v", r, err)
	}
	_, err = c.Store(ctx, "ns-rid", []Chunk{{[]byte("k2"), []byte("v")}}, WithRequestID(rid))
	if e := expect(t, err, "InvalidRequest"); e.Reason != "DUPLICATE_TRANSFER_ID" || e.RequestID != rid {
		t.Errorf("%+v", e)
	}
	late := uniq(t, "late")
	f, err := c.Fence(ctx, "", []string{late})
	if err != nil || f.BarredTransfers != 1 || f.WaitedTransfers != 0 {
		t.Fatalf("fence %v %v", f, err)
	}
	_, err = c.Store(ctx, "ns-fence", []Chunk{{[]byte("k"), []byte("v")}}, WithRequestID(late))
	if e := expect(t, err, "InvalidRequest"); e.Reason != "TRANSFER_BARRED" ||
		e.TransferState != pb.TransferState_TRANSFER_STATE_NOT_STARTED {
		t.Errorf("%+v", e)
	}
	if r, err := c.Lookup(ctx, "ns-fence", [][]byte{[]byte("k")}); err != nil || r.HitChunks != 0 {
		t.Errorf("a barred transfer stored something: %v %v", r, err)
	}
}

func TestMappedRegions(t *testing.T) {
	s := sharedServer(t)
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 30*time.Second)

	t.Run("tensor beyond its handle is InvalidRequest", func(t *testing.T) {
		_, err := c.Map(ctx, mapRequest("ns-oob", "oob", 100))
		if e := expect(t, err, "InvalidRequest"); e.Reason != "TENSOR_OUT_OF_BOUNDS" || e.Metadata["endBytes"] != "256" {
			t.Errorf("%+v", e)
		}
	})

	t.Run("a region that never appears is DeadlineExceeded at the control timeout", func(t *testing.T) {
		short := newClient(t, s.addr, Options{ControlTimeout: 3 * time.Second})
		t0 := time.Now()
		_, err := short.Map(context.Background(), mapRequest(uniq(t, "ns"), "never-created", 256))
		// The server retries until just before the deadline; on a loaded host its
		// REGION_NOT_READY reply can land after it, and gRPC's own error wins.
		// Either way the caller gets a typed DeadlineExceeded at the deadline.
		e := expect(t, err, "DeadlineExceeded")
		if e.Remote && e.Reason != "REGION_NOT_READY" || !e.Remote && e.Reason != "TRANSPORT_DEADLINE_EXCEEDED" {
			t.Errorf("%+v", e)
		}
		if d := time.Since(t0); d < 1500*time.Millisecond || d > 7*time.Second {
			t.Errorf("took %v for a 3 s timeout", d)
		}
	})

	t.Run("blocks round trip; an inline chunk is a miss for a mapping", func(t *testing.T) {
		file := filepath.Join(s.shmDir, "region")
		content := randBytes(t, 256)
		if err := os.WriteFile(file, content, 0o600); err != nil {
			t.Fatal(err)
		}
		ns := uniq(t, "ns-layout")
		m, err := c.Map(ctx, mapRequest(ns, "region", 256))
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if _, err := c.Unmap(ctx, m.MappingId); err != nil {
				t.Error(err)
			}
			_, err := c.LookupMapping(ctx, m.MappingId, [][]byte{[]byte("blk")})
			expect(t, err, "MappingLost")
		}()
		if m.NumBlocks != 4 || m.BlockBytes != 64 {
			t.Fatalf("map %v", m)
		}
		st, err := c.StoreRaw(ctx, blockStore(m.MappingId, "blk", 1, 2))
		if err != nil || st.StoredBytes != 128 {
			t.Fatalf("%v %v", st, err)
		}
		if _, err := c.RetrieveRaw(ctx, blockRetrieve(m.MappingId, "blk", 2, 3)); err != nil {
			t.Fatal(err)
		}
		after, _ := os.ReadFile(file)
		if !bytes.Equal(after[128:256], content[64:192]) {
			t.Errorf("blocks 1..2 did not come back into blocks 2..3")
		}
		if _, err := c.Store(ctx, ns, []Chunk{{[]byte("inline-key"), make([]byte, 64)}}); err != nil {
			t.Fatal(err)
		}
		// Presence is per (namespace, key, layout): the inline chunk is a miss here.
		before, _ := os.ReadFile(file)
		got, err := c.RetrieveRaw(ctx, blockRetrieve(m.MappingId, "inline-key", 0))
		if err != nil || got.LoadedChunks != 0 {
			t.Errorf("%v %v", got, err)
		}
		if now, _ := os.ReadFile(file); !bytes.Equal(now, before) {
			t.Errorf("a block was written")
		}
	})

	t.Run("a region truncated after Map is RegionUnavailable, copy FINISHED", func(t *testing.T) {
		file := filepath.Join(s.shmDir, "shrinks")
		if err := os.WriteFile(file, randBytes(t, 256), 0o600); err != nil {
			t.Fatal(err)
		}
		m, err := c.Map(ctx, mapRequest(uniq(t, "ns-trunc"), "shrinks", 256))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Unmap(ctx, m.MappingId)
		if err := os.Truncate(file, 0); err != nil {
			t.Fatal(err)
		}
		_, err = c.StoreRaw(ctx, blockStore(m.MappingId, "t", 3))
		e := expect(t, err, "RegionUnavailable")
		if e.Code != codes.FailedPrecondition || e.Reason != "REGION_TRUNCATED" || e.Metadata["name"] != "shrinks" ||
			e.TransferState != pb.TransferState_TRANSFER_STATE_FINISHED || !e.BuffersReusable() {
			t.Errorf("%+v", e)
		}
		if h, err := c.HealthCheck(ctx, ""); err != nil || h != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("a client fault must not be fatal: %v %v", h, err)
		}
	})
}

func TestConnectionRefusedIsServiceUnavailable(t *testing.T) {
	c := newClient(t, refusedAddress(t), Options{})
	ctx := context.Background() // the defaults bound every call
	t0 := time.Now()
	_, e1 := c.Lookup(ctx, "ns", [][]byte{[]byte("k")})
	_, e2 := c.ServerInfo(ctx)
	_, e3 := c.Store(ctx, "ns", []Chunk{{[]byte("k"), []byte("v")}})
	_, e4 := c.HealthCheck(ctx, "")
	for i, err := range []error{e1, e2, e3, e4} {
		e := expect(t, err, "ServiceUnavailable")
		if e.Code != codes.Unavailable || e.Reason != "TRANSPORT_UNAVAILABLE" || !e.Retryable || e.Remote ||
			!strings.Contains(strings.ToLower(e.Message), "connect") {
			t.Errorf("call %d: %+v", i, e)
		}
	}
	// A block transfer that could not be sent provably did not start.
	_, err := c.StoreRaw(ctx, blockStore("m", "k", 0))
	if e := expect(t, err, "ServiceUnavailable"); e.TransferState != pb.TransferState_TRANSFER_STATE_NOT_STARTED ||
		!ridRE.MatchString(e.RequestID) {
		t.Errorf("%+v", e)
	}
	if d := time.Since(t0); d > 10*time.Second {
		t.Errorf("took %v: not failing fast", d)
	}
}

func TestSlowServer(t *testing.T) {
	// Each sleep outlasts the deadline it races by seconds (a loaded CI host).
	s := startServer(t, "handler.enter=Lookup@sleep(4000);transfer.before_copy=sleep(5000)", "--store-bytes", "64K")
	c := newClient(t, s.addr, Options{})

	t.Run("Lookup with a 300 ms deadline is DeadlineExceeded at 300 ms", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		t0 := time.Now()
		_, err := c.Lookup(ctx, "ns", [][]byte{[]byte("k")})
		e := expect(t, err, "DeadlineExceeded")
		if e.Code != codes.DeadlineExceeded || e.Reason != "TRANSPORT_DEADLINE_EXCEEDED" || e.Remote ||
			e.TransferState != pb.TransferState_TRANSFER_STATE_UNSPECIFIED || !ridRE.MatchString(e.RequestID) {
			t.Errorf("%+v", e)
		}
		if d := time.Since(t0); d < 250*time.Millisecond || d > 3500*time.Millisecond {
			t.Errorf("took %v", d)
		}
	})

	t.Run("a cancelled context is Cancelled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		timer := time.AfterFunc(200*time.Millisecond, cancel)
		defer timer.Stop()
		t0 := time.Now()
		_, err := c.Lookup(ctx, "ns", [][]byte{[]byte("k")})
		if e := expect(t, err, "Cancelled"); e.Code != codes.Canceled {
			t.Errorf("%+v", e)
		}
		if d := time.Since(t0); d > 3500*time.Millisecond {
			t.Errorf("took %v", d)
		}
	})

	t.Run("a chunk larger than the store is CapacityExhausted", func(t *testing.T) {
		_, err := c.Store(ctxFor(t, 10*time.Second), "ns", []Chunk{{[]byte("big"), make([]byte, 100<<10)}})
		e := expect(t, err, "CapacityExhausted")
		need, _ := strconv.Atoi(e.Metadata["requestBytes"])
		if e.Code != codes.ResourceExhausted || e.Reason != "REQUEST_EXCEEDS_CAPACITY" || e.Retryable ||
			need <= 100<<10 || e.TransferState != pb.TransferState_TRANSFER_STATE_NOT_STARTED {
			t.Errorf("%+v", e)
		}
	})

	t.Run("the transfer timeout default bounds an inline Store", func(t *testing.T) {
		short := newClient(t, s.addr, Options{TransferTimeout: 1500 * time.Millisecond})
		// Connected first: the copy must start within the deadline.
		if _, err := short.ServerInfo(ctxFor(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
		rid := uniq(t, "slow")
		t0 := time.Now()
		_, err := short.Store(context.Background(), "ns-slow", []Chunk{{[]byte("k"), []byte("v")}}, WithRequestID(rid))
		if e := expect(t, err, "DeadlineExceeded"); e.RequestID != rid {
			t.Errorf("%+v", e)
		}
		if d := time.Since(t0); d < 1400*time.Millisecond || d > 4500*time.Millisecond {
			t.Errorf("took %v for a 1.5 s default", d)
		}
		ctx := ctxFor(t, 20*time.Second)
		if _, err := c.Fence(ctx, "", []string{rid}); err != nil {
			t.Fatal(err)
		}
		if r, err := c.Lookup(ctx, "ns-slow", [][]byte{[]byte("k")}); err != nil || r.HitChunks != 1 {
			t.Errorf("the copy that outlived its call: %v %v", r, err)
		}
	})

	t.Run("a block Store whose reply is lost is TransferUnprovable until a Fence", func(t *testing.T) {
		ctx := ctxFor(t, 30*time.Second)
		if err := os.WriteFile(filepath.Join(s.shmDir, "r"), randBytes(t, 256), 0o600); err != nil {
			t.Fatal(err)
		}
		m, err := c.Map(ctx, mapRequest(uniq(t, "ns-unprovable"), "r", 256))
		if err != nil {
			t.Fatal(err)
		}
		rid := uniq(t, "blk")
		t0 := time.Now()
		_, err = c.StoreRaw(ctx, blockStore(m.MappingId, "b", 0, 1), WithRequestID(rid), WithTimeout(1500*time.Millisecond))
		e := expect(t, err, "TransferUnprovable")
		if e.Code != codes.DeadlineExceeded || e.Reason != "TRANSFER_UNPROVABLE" || e.BuffersReusable() ||
			e.RequestID != rid || e.Metadata["grpcCode"] != "DEADLINE_EXCEEDED" {
			t.Errorf("%+v", e)
		}
		if d := time.Since(t0); d > 4500*time.Millisecond {
			t.Errorf("took %v: not at the deadline", d)
		}
		f, err := c.Fence(ctx, "", []string{rid})
		if err != nil || f.BarredTransfers != 0 {
			t.Fatalf("fence %v %v", f, err)
		}
		if r, err := c.LookupMapping(ctx, m.MappingId, [][]byte{[]byte("b")}); err != nil || r.HitChunks != 1 {
			t.Errorf("after the fence: %v %v", r, err)
		}
		if _, err := c.Unmap(ctx, m.MappingId); err != nil {
			t.Error(err)
		}
	})
}

func TestFatalFailureFlipsHealth(t *testing.T) {
	s := startServer(t, "transfer.before_copy=raise")
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 30*time.Second)
	for _, name := range []string{"", HealthServiceName} {
		if h, err := c.HealthCheck(ctx, name); err != nil || h != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("before: %q %v %v", name, h, err)
		}
	}
	_, err := c.Store(ctx, "ns", []Chunk{{[]byte("k"), []byte("v")}})
	e := expect(t, err, "FatalServerError")
	if !asClass(err, "RemoteHandlerError") || e.Code != codes.Internal || e.Reason != "TRANSFER_WORKER_FAILED" ||
		e.Metadata["error"] != "FailpointError" || e.TransferState != pb.TransferState_TRANSFER_STATE_FINISHED ||
		strings.Contains(e.Message, "Traceback") {
		t.Errorf("%+v", e)
	}
	deadline := time.Now().Add(10 * time.Second)
	h, err := c.HealthCheck(ctx, "")
	for err == nil && h != healthpb.HealthCheckResponse_NOT_SERVING && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		h, err = c.HealthCheck(ctx, "")
	}
	if err != nil || h != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf(`health "" after the fatal error: %v %v`, h, err)
	}
	if h, err := c.HealthCheck(ctx, HealthServiceName); err != nil || h != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("health %s: %v %v", HealthServiceName, h, err)
	}
	info, err := c.ServerInfo(ctx)
	if err != nil || info.Serving || info.FailureReason != "TRANSFER_WORKER_FAILED" || info.FailureTime == nil {
		t.Errorf("info %v %v", info, err)
	}
	_, e1 := c.Store(ctx, "ns", []Chunk{{[]byte("k2"), []byte("v")}})
	_, e2 := c.Retrieve(ctx, "ns", [][]byte{[]byte("k")})
	for _, err := range []error{e1, e2} {
		e := expect(t, err, "ServiceNotServing")
		if e.Code != codes.Unavailable || e.Reason != "SERVICE_NOT_SERVING" || e.Retryable ||
			e.Metadata["failureReason"] != "TRANSFER_WORKER_FAILED" ||
			e.TransferState != pb.TransferState_TRANSFER_STATE_NOT_STARTED {
			t.Errorf("%+v", e)
		}
	}
	if r, err := c.Lookup(ctx, "ns", [][]byte{[]byte("k")}); err != nil || r.HitChunks != 0 {
		t.Errorf("control calls still answer: %v %v", r, err)
	}
}

func TestUnknownMethodIsUnimplemented(t *testing.T) {
	c := newClient(t, sharedServer(t).addr, Options{})
	err := c.conn.Invoke(ctxFor(t, 10*time.Second), "/kvsvc.v1.KVCacheService/NoSuchMethod",
		&pb.LookupRequest{}, &pb.LookupResponse{})
	e := expect(t, FromGRPCError(err, "", "NoSuchMethod", true, true), "Unimplemented")
	if e.Reason != "TRANSPORT_UNIMPLEMENTED" || e.Code != codes.Unimplemented {
		t.Errorf("%+v", e)
	}
}
