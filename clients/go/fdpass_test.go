//go:build linux

package kvsvc

// Sealed memfd regions: against real `kvsvc serve` processes (the round trip,
// refused fds, a server without an fd socket), and against fake fd sockets
// for the failures a real server does not produce on demand.

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

const fGetSeals = 1034

// memfdMapRequest maps one rank with one uint8 tensor of 4 blocks of 1024 bytes
// on the memfd registered as token.
func memfdMapRequest(namespace, token string) *pb.MapRequest {
	return &pb.MapRequest{
		Namespace: namespace,
		Ranks: []*pb.RankRegion{{
			Context: &pb.RankContext{TpSize: 1, PpSize: 1, GroupId: "g"},
			Tensors: []*pb.KVTensor{{
				Name: "layer.0",
				Handle: &pb.MemoryHandle{Kind: &pb.MemoryHandle_SealedMemfd{
					SealedMemfd: &pb.SealedMemfdHandle{Token: token, SizeBytes: 4096}}},
				Shape: []int64{4, 1024}, Strides: []int64{1024, 1}, Dtype: pb.Dtype_DTYPE_UINT8, BlockDim: 0,
			}},
		}},
	}
}

func closeFd(t *testing.T, fd int) {
	t.Helper()
	if err := syscall.Close(fd); err != nil {
		t.Error(err)
	}
}

func TestMakeSealedMemfd(t *testing.T) {
	fd, err := MakeSealedMemfd("kvsvc-go-test", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer closeFd(t, fd)
	seals, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), fGetSeals, 0)
	if errno != 0 || seals != fSealSeal|fSealShrink|fSealGrow {
		t.Errorf("seals %#x %v", seals, errno)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil || st.Size != 4096 {
		t.Errorf("size %d %v", st.Size, err)
	}
	if err := syscall.Ftruncate(fd, 0); err != syscall.EPERM {
		t.Errorf("shrinking a sealed memfd: %v, want EPERM", err)
	}
	flags, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), syscall.F_GETFD, 0)
	if errno != 0 || flags&syscall.FD_CLOEXEC == 0 {
		t.Errorf("not close-on-exec: %#x %v", flags, errno)
	}
}

func TestSealedMemfdRegion(t *testing.T) {
	c := newClient(t, sharedServer(t).addr, Options{})
	ctx := ctxFor(t, 30*time.Second)

	t.Run("blocks round trip through a registered memfd", func(t *testing.T) {
		fd, err := MakeSealedMemfd("kvsvc-go-region", 4096)
		if err != nil {
			t.Fatal(err)
		}
		mem, err := syscall.Mmap(fd, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		if err != nil {
			closeFd(t, fd)
			t.Fatal(err)
		}
		defer syscall.Munmap(mem)
		content := randBytes(t, 4096)
		copy(mem, content)
		// No context deadline: the control timeout bounds the call.
		token, err := c.RegisterMemfd(context.Background(), fd)
		if err != nil {
			closeFd(t, fd)
			t.Fatal(err)
		}
		if !ridRE.MatchString(token) {
			t.Errorf("token %q", token)
		}
		closeFd(t, fd) // the server holds its own copy; the mapping keeps the memory
		m, err := c.Map(ctx, memfdMapRequest(uniq(t, "ns-memfd"), token))
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if _, err := c.Unmap(ctx, m.MappingId); err != nil {
				t.Error(err)
			}
		}()
		if m.NumBlocks != 4 || m.BlockBytes != 1024 {
			t.Fatalf("map %v", m)
		}
		st, err := c.StoreRaw(ctx, blockStore(m.MappingId, "memfd-blk", 0, 1))
		if err != nil || st.StoredChunks != 1 || st.StoredBytes != 2048 {
			t.Fatalf("store %v %v", st, err)
		}
		r, err := c.RetrieveRaw(ctx, blockRetrieve(m.MappingId, "memfd-blk", 2, 3))
		if err != nil || r.LoadedChunks != 1 || r.LoadedBytes != 2048 {
			t.Fatalf("retrieve %v %v", r, err)
		}
		if !bytes.Equal(mem[2048:4096], content[0:2048]) {
			t.Errorf("blocks 0..1 did not come back into blocks 2..3")
		}
		if !bytes.Equal(mem[0:2048], content[0:2048]) {
			t.Errorf("the source blocks changed")
		}
	})

	t.Run("a token serves more than one Map", func(t *testing.T) {
		fd, err := MakeSealedMemfd("kvsvc-go-shared", 4096)
		if err != nil {
			t.Fatal(err)
		}
		token, err := c.RegisterMemfd(ctx, fd, WithTimeout(5*time.Second))
		closeFd(t, fd)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 2; i++ {
			m, err := c.Map(ctx, memfdMapRequest(uniq(t, "ns-memfd-twice"), token))
			if err != nil {
				t.Fatalf("map %d: %v", i, err)
			}
			if _, err := c.Unmap(ctx, m.MappingId); err != nil {
				t.Error(err)
			}
		}
	})

	t.Run("fds that are not sealed memfds are InvalidRequest FD_NOT_SEALED", func(t *testing.T) {
		unsealed, err := memfdCreate("kvsvc-go-unsealed", mfdCloexec)
		if err != nil {
			t.Fatal(err)
		}
		defer closeFd(t, unsealed)
		sealable, err := memfdCreate("kvsvc-go-sealable", mfdCloexec|mfdAllowSealing)
		if err != nil {
			t.Fatal(err)
		}
		defer closeFd(t, sealable)
		plain, err := syscall.Open(filepath.Join(t.TempDir(), "plain"), syscall.O_RDWR|syscall.O_CREAT|syscall.O_CLOEXEC, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		defer closeFd(t, plain)
		for name, fd := range map[string]int{"no sealing": unsealed, "no seals": sealable, "plain file": plain} {
			if err := syscall.Ftruncate(fd, 4096); err != nil {
				t.Fatal(err)
			}
			_, err := c.RegisterMemfd(ctx, fd)
			e := expect(t, err, "InvalidRequest")
			if e.Code != codes.InvalidArgument || e.Reason != "FD_NOT_SEALED" || !e.Remote ||
				e.Method != "RegisterMemfd" || !strings.Contains(e.Message, "F_SEAL_SHRINK") {
				t.Errorf("%s: %+v", name, e)
			}
		}
	})

	t.Run("a Map naming an unknown token is InvalidRequest FD_TOKEN_UNKNOWN", func(t *testing.T) {
		_, err := c.Map(ctx, memfdMapRequest(uniq(t, "ns-memfd-unknown"), strings.Repeat("f", 32)))
		if e := expect(t, err, "InvalidRequest"); e.Reason != "FD_TOKEN_UNKNOWN" {
			t.Errorf("%+v", e)
		}
	})
}

func TestServerWithoutFdSocket(t *testing.T) {
	s := startServer(t, "", "--fd-socket", "off")
	c := newClient(t, s.addr, Options{})
	ctx := ctxFor(t, 30*time.Second)
	info, err := c.ServerInfo(ctx)
	if err != nil || info.FdSocket != "" {
		t.Fatalf("info %v %v", info, err)
	}
	fd, err := MakeSealedMemfd("kvsvc-go-off", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer closeFd(t, fd)
	_, err = c.RegisterMemfd(ctx, fd)
	e := expect(t, err, "Unimplemented")
	if e.Code != codes.Unimplemented || e.Reason != "FD_PASSING_DISABLED" || e.Remote || e.Method != "RegisterMemfd" {
		t.Errorf("%+v", e)
	}
}

// fakeFdSocket listens on a unixpacket socket and hands each connection, with
// the message and fds it got first, to serve.
func fakeFdSocket(t *testing.T, serve func(conn *net.UnixConn, msg []byte, fds []int)) string {
	t.Helper()
	path := filepath.Join(shortTempDir(t), "fds")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			conn, err := l.AcceptUnix()
			if err != nil {
				return
			}
			buf, oob := make([]byte, 64), make([]byte, syscall.CmsgSpace(4*4))
			n, oobn, _, _, err := conn.ReadMsgUnix(buf, oob)
			var fds []int
			if err == nil {
				msgs, _ := syscall.ParseSocketControlMessage(oob[:oobn])
				for _, m := range msgs {
					got, _ := syscall.ParseUnixRights(&m)
					fds = append(fds, got...)
				}
			}
			serve(conn, buf[:n], fds)
			for _, fd := range fds {
				syscall.Close(fd)
			}
		}
	}()
	return path
}

// shortTempDir is a temp dir whose name leaves room for a unix socket name
// (t.TempDir's names, made of the test's name, can exceed the 107 bytes).
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvsvc-go-fds-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// leaseSend is one pass on a new lease, closed with the test.
func leaseSend(t *testing.T, ctx context.Context, path string, fd int) (string, error) {
	t.Helper()
	lease := &fdLease{}
	t.Cleanup(lease.close)
	return lease.send(ctx, path, fd)
}

func TestFdSocketFailures(t *testing.T) {
	fd, err := MakeSealedMemfd("kvsvc-go-fake", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer closeFd(t, fd)

	t.Run("the exchange sends the magic with one fd and reads the token", func(t *testing.T) {
		got := make(chan string, 1)
		path := fakeFdSocket(t, func(conn *net.UnixConn, msg []byte, fds []int) {
			var st syscall.Stat_t
			size := int64(-1)
			if len(fds) == 1 && syscall.Fstat(fds[0], &st) == nil {
				size = st.Size
			}
			got <- string(msg) + " " + strings.Repeat("fd ", len(fds)) + "size=" + strconv.FormatInt(size, 10)
			conn.Write([]byte("\x00tok"))
			conn.Close()
		})
		token, err := leaseSend(t, ctxFor(t, 5*time.Second), path, fd)
		if err != nil || token != "tok" {
			t.Fatalf("%q %v", token, err)
		}
		if g := <-got; g != "kvsvc-fd/L fd size=4096" {
			t.Errorf("the server got %q", g)
		}
	})

	t.Run("a RemoteError reply is its class", func(t *testing.T) {
		raw, err := proto.Marshal(&pb.RemoteError{
			EnvelopeVersion: 1, Code: pb.Code_CODE_RESOURCE_EXHAUSTED, Reason: "FD_TOKENS_EXHAUSTED",
			Message: "1024 passed fds are waiting for Map", Type: "CapacityExhausted",
		})
		if err != nil {
			t.Fatal(err)
		}
		path := fakeFdSocket(t, func(conn *net.UnixConn, _ []byte, _ []int) {
			conn.Write(append([]byte{1}, raw...))
			conn.Close()
		})
		_, err = leaseSend(t, ctxFor(t, 5*time.Second), path, fd)
		if e := expect(t, err, "CapacityExhausted"); e.Reason != "FD_TOKENS_EXHAUSTED" || !e.Remote ||
			e.Method != "RegisterMemfd" {
			t.Errorf("%+v", e)
		}
	})

	unavailable := func(t *testing.T, err error, path, message string) {
		t.Helper()
		e := expect(t, err, "ServiceUnavailable")
		if e.Code != codes.Unavailable || e.Reason != "FD_SOCKET_UNAVAILABLE" || !e.Retryable || e.Remote ||
			e.Metadata["path"] != path || !strings.Contains(e.Message, message) {
			t.Errorf("%+v", e)
		}
	}

	t.Run("no socket at the path is ServiceUnavailable", func(t *testing.T) {
		path := filepath.Join(shortTempDir(t), "none")
		_, err := leaseSend(t, ctxFor(t, 5*time.Second), path, fd)
		unavailable(t, err, path, "cannot pass an fd through")
	})

	t.Run("a socket that closes without an answer is ServiceUnavailable", func(t *testing.T) {
		path := fakeFdSocket(t, func(conn *net.UnixConn, _ []byte, _ []int) { conn.Close() })
		_, err := leaseSend(t, ctxFor(t, 5*time.Second), path, fd)
		unavailable(t, err, path, "closed without an answer")
	})

	t.Run("an unreadable error reply is ServiceUnavailable", func(t *testing.T) {
		path := fakeFdSocket(t, func(conn *net.UnixConn, _ []byte, _ []int) {
			conn.Write([]byte{1, 0xff, 0xff})
			conn.Close()
		})
		_, err := leaseSend(t, ctxFor(t, 5*time.Second), path, fd)
		unavailable(t, err, path, "unreadable error")
	})

	silent := func(t *testing.T) string {
		held := make(chan *net.UnixConn, 4)
		t.Cleanup(func() {
			close(held)
			for conn := range held {
				conn.Close()
			}
		})
		return fakeFdSocket(t, func(conn *net.UnixConn, _ []byte, _ []int) { held <- conn })
	}

	t.Run("a socket that does not answer is DeadlineExceeded at the deadline", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		t0 := time.Now()
		_, err := leaseSend(t, ctx, silent(t), fd)
		e := expect(t, err, "DeadlineExceeded")
		if e.Code != codes.DeadlineExceeded || e.Reason != "FD_SOCKET_TIMEOUT" || e.Retryable || e.Remote {
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
		_, err := leaseSend(t, ctx, silent(t), fd)
		if e := expect(t, err, "Cancelled"); e.Code != codes.Canceled {
			t.Errorf("%+v", e)
		}
		if d := time.Since(t0); d > 3500*time.Millisecond {
			t.Errorf("took %v", d)
		}
	})

	t.Run("an unreachable server fails in GetServerInfo", func(t *testing.T) {
		c := newClient(t, refusedAddress(t), Options{ControlTimeout: 2 * time.Second})
		_, err := c.RegisterMemfd(context.Background(), fd)
		if e := expect(t, err, "ServiceUnavailable"); e.Reason != "TRANSPORT_UNAVAILABLE" || e.Method != "GetServerInfo" {
			t.Errorf("%+v", e)
		}
	})
}

// The memfd goes over the client's lease connection: closing the client (an
// engine that exits) makes the server release the mapping by itself, no Unmap.
func TestClosedClientsMemfdMappingIsReleased(t *testing.T) {
	addr := sharedServer(t).addr
	ctx := ctxFor(t, 30*time.Second)
	fd, err := MakeSealedMemfd("kvsvc-go-lease", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer closeFd(t, fd)
	engine, err := New(addr, Options{})
	if err != nil {
		t.Fatal(err)
	}
	token, err := engine.RegisterMemfd(ctx, fd)
	if err != nil {
		t.Fatal(err)
	}
	m, err := engine.Map(ctx, memfdMapRequest(uniq(t, "ns-lease"), token))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := engine.RegisterMemfd(ctx, fd); err != nil { // a second pass, same lease
		t.Fatal(err)
	}
	if err := engine.Close(); err != nil {
		t.Fatal(err)
	}
	other := newClient(t, addr, Options{})
	deadline := time.Now().Add(10 * time.Second) // released at once; a loaded CI host
	for {
		_, err := other.LookupMapping(ctx, m.MappingId, [][]byte{[]byte("k")})
		var lost *MappingLost
		if errors.As(err, &lost) {
			return
		}
		if err != nil {
			t.Fatalf("lookup: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("mapping %s outlived its client by 10 s", m.MappingId)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
