//go:build unix

package kvsvc

// Passing a sealed memfd to the server's fd socket (the fast CPU region kind):
// the client side of kvsvc/fdpass.py. Connect a SOCK_SEQPACKET socket to
// GetServerInfoResult.fd_socket, send fdMagic with exactly one fd in
// SCM_RIGHTS, and read one reply: 0x00 then the token, or 0x01 then a
// serialized RemoteError.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

// fdLeaseMagic is the message of a pass over a lease connection
// (fdpass.LEASE_MAGIC): the connection stays open for the next passes, and
// while it is open the server keeps the mappings of the memfds passed over it.
var fdLeaseMagic = []byte("kvsvc-fd/L")

const registerMemfdMethod = "RegisterMemfd"

// RegisterMemfd passes fd, a sealed memfd (see MakeSealedMemfd), to the
// server's fd socket and returns the token that a SealedMemfdHandle names in
// a Map. The server keeps its own copy of the fd for 60 s, so a failed Map can
// be retried and several ranks can share one token; fd stays the caller's.
// The fd goes over the client's lease connection, open until Close: the
// server keeps mappings of the memfd while it is open and releases them when
// it closes (Close, or this process dies, in any container).
//
// It asks GetServerInfo where the socket is (unless Options.FdSocket says),
// then does the exchange, all within one deadline: the context's, else
// WithTimeout, else the control timeout. Errors: Unimplemented (FD_PASSING_DISABLED) when the server has no
// fd socket; ServiceUnavailable (FD_SOCKET_UNAVAILABLE) when the socket cannot
// be reached or closes without an answer; DeadlineExceeded (FD_SOCKET_TIMEOUT);
// Cancelled; and whatever the server refuses the fd with, e.g. InvalidRequest
// (FD_NOT_SEALED) for a memfd without F_SEAL_SHRINK.
func (c *Client) RegisterMemfd(ctx context.Context, fd int, opts ...CallOption) (string, error) {
	var header *pb.RequestHeader
	p, err := prepare(registerMemfdMethod, false, false, &header, opts)
	if err != nil {
		return "", err
	}
	ctx, cancel := c.deadline(ctx, p)
	defer cancel()
	if c.fdSocket != "" {
		return c.lease.send(ctx, c.fdSocket, fd)
	}
	info, err := c.ServerInfo(ctx)
	if err != nil {
		return "", err
	}
	if info.GetFdSocket() == "" {
		return "", build("Unimplemented", &KVServiceError{
			Message: "the server has no fd socket (--fd-socket off, or it could not make one: " +
				"see its log), so it takes no memfds; map a file under its shm dir instead",
			Code:     codes.Unimplemented,
			Reason:   "FD_PASSING_DISABLED",
			Metadata: map[string]string{},
			Method:   registerMemfdMethod,
		})
	}
	return c.lease.send(ctx, info.GetFdSocket(), fd)
}

// fdLease is a client's lease connection to the fd socket, made on first use.
// A connection whose exchange failed midway is kept open (its passes stay
// leased) but not reused: a late reply there could be taken for the next one.
type fdLease struct {
	mu      sync.Mutex
	path    string
	conn    *net.UnixConn
	retired []*net.UnixConn
}

func (l *fdLease) send(ctx context.Context, path string, fd int) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil && l.path != path { // the server moved: a new lease there
		l.retired = append(l.retired, l.conn)
		l.conn = nil
	}
	if l.conn == nil {
		var dialer net.Dialer
		conn, err := dialer.DialContext(ctx, "unixpacket", path)
		if err != nil {
			return "", fdSocketError(ctx, path, err)
		}
		l.conn, l.path = conn.(*net.UnixConn), path
	}
	token, broken, err := exchange(ctx, l.conn, path, fd)
	if broken {
		l.retired = append(l.retired, l.conn)
		l.conn = nil
	}
	return token, err
}

func (l *fdLease) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range append(l.retired, l.conn) {
		if c != nil {
			_ = c.Close()
		}
	}
	l.conn, l.retired = nil, nil
}

// exchange does one pass on uc, bounded by ctx; broken: uc must not be reused.
func exchange(ctx context.Context, uc *net.UnixConn, path string, fd int) (string, bool, error) {
	deadline, _ := ctx.Deadline() // zero: none, which also clears an earlier one
	if err := uc.SetDeadline(deadline); err != nil {
		return "", true, fdSocketError(ctx, path, err)
	}
	// A cancelled context wakes the blocked write or read.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-ctx.Done():
			_ = uc.SetDeadline(time.Unix(1, 0))
		case <-stop:
		}
	}()
	if _, _, err := uc.WriteMsgUnix(fdLeaseMagic, syscall.UnixRights(fd), nil); err != nil {
		return "", true, fdSocketError(ctx, path, err)
	}
	buf := make([]byte, 1<<16)
	n, err := uc.Read(buf)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", true, fdSocketError(ctx, path, err)
	}
	reply := buf[:n]
	switch {
	case n > 1 && reply[0] == 0:
		return string(reply[1:]), false, nil
	case n >= 1 && reply[0] == 1:
		env := &pb.RemoteError{}
		if err := proto.Unmarshal(reply[1:], env); err != nil {
			return "", true, fdSocketUnavailable(path, fmt.Sprintf("the fd socket %s answered an unreadable error: %v", path, err), err)
		}
		// A refused fd leaves the lease as it was; one refused for the lease
		// itself (FD_SOCKET_BUSY) comes with the connection's end.
		return "", env.GetReason() == "FD_SOCKET_BUSY", FromRemoteError(env, registerMemfdMethod)
	}
	return "", true, fdSocketUnavailable(path, fmt.Sprintf("the fd socket %s closed without an answer", path), nil)
}

// fdSocketError is the error for a failed connect, write or read: Cancelled
// or DeadlineExceeded (FD_SOCKET_TIMEOUT) by the context, else
// ServiceUnavailable (FD_SOCKET_UNAVAILABLE), as fdpass.send_fd raises them.
func fdSocketError(ctx context.Context, path string, err error) error {
	switch {
	case errors.Is(ctx.Err(), context.Canceled):
		return build("Cancelled", &KVServiceError{
			Message:  fmt.Sprintf("passing an fd through %s was cancelled", path),
			Code:     codes.Canceled,
			Reason:   "CANCELLED",
			Metadata: map[string]string{"path": path},
			Method:   registerMemfdMethod,
			Cause:    err,
		})
	case ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded):
		return build("DeadlineExceeded", &KVServiceError{
			Message:  fmt.Sprintf("the fd socket %s did not answer before the deadline", path),
			Code:     codes.DeadlineExceeded,
			Reason:   "FD_SOCKET_TIMEOUT",
			Metadata: map[string]string{},
			Method:   registerMemfdMethod,
			Cause:    err,
		})
	}
	return fdSocketUnavailable(path, fmt.Sprintf("cannot pass an fd through %s: %v", path, err), err)
}

func fdSocketUnavailable(path, message string, cause error) error {
	return build("ServiceUnavailable", &KVServiceError{
		Message:   message,
		Code:      codes.Unavailable,
		Reason:    "FD_SOCKET_UNAVAILABLE",
		Metadata:  map[string]string{"path": path},
		Retryable: true,
		Method:    registerMemfdMethod,
		Cause:     cause,
	})
}
