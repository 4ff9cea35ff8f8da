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
	"syscall"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

// fdMagic is the one message the fd socket takes (fdpass.MAGIC).
var fdMagic = []byte("kvsvc-fd/1")

const registerMemfdMethod = "RegisterMemfd"

// RegisterMemfd passes fd, a sealed memfd (see MakeSealedMemfd), to the
// server's fd socket and returns the token that a SealedMemfdHandle names in
// a Map. The server keeps its own copy of the fd for 60 s, so a failed Map can
// be retried and several ranks can share one token; fd stays the caller's.
//
// It asks GetServerInfo where the socket is, then does the exchange, all
// within one deadline: the context's, else WithTimeout, else the control
// timeout. Errors: Unimplemented (FD_PASSING_DISABLED) when the server has no
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
	return sendFd(ctx, info.GetFdSocket(), fd)
}

// sendFd does the exchange on the fd socket at path, bounded by ctx.
func sendFd(ctx context.Context, path string, fd int) (string, error) {
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "unixpacket", path)
	if err != nil {
		return "", fdSocketError(ctx, path, err)
	}
	uc := conn.(*net.UnixConn)
	defer uc.Close()
	if deadline, ok := ctx.Deadline(); ok {
		if err := uc.SetDeadline(deadline); err != nil {
			return "", fdSocketError(ctx, path, err)
		}
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
	if _, _, err := uc.WriteMsgUnix(fdMagic, syscall.UnixRights(fd), nil); err != nil {
		return "", fdSocketError(ctx, path, err)
	}
	buf := make([]byte, 1<<16)
	n, err := uc.Read(buf)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", fdSocketError(ctx, path, err)
	}
	reply := buf[:n]
	switch {
	case n > 1 && reply[0] == 0:
		return string(reply[1:]), nil
	case n >= 1 && reply[0] == 1:
		env := &pb.RemoteError{}
		if err := proto.Unmarshal(reply[1:], env); err != nil {
			return "", fdSocketUnavailable(path, fmt.Sprintf("the fd socket %s answered an unreadable error: %v", path, err), err)
		}
		return "", FromRemoteError(env, registerMemfdMethod)
	}
	return "", fdSocketUnavailable(path, fmt.Sprintf("the fd socket %s closed without an answer", path), nil)
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
