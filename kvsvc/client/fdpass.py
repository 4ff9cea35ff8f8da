"""Sealed memfds passed over a unix socket (SCM_RIGHTS): the fast CPU region kind,
the engine's side and the message format both sides share.

A file under --shm-dir can be truncated by its owner at any moment, so the server
copies it with positional file I/O (a short read is a typed error; a SIGBUS in an
mmap copy would kill the server). A memfd sealed with F_SEAL_SHRINK can never
shrink, so the server may map it and copy with memcpy. A memfd has no name the
server could open, so the client passes the fd itself: it connects to the
server's fd socket (SOCK_SEQPACKET), sends ``MAGIC`` with the fd, and gets back a
token that a Map names in a ``SealedMemfdHandle``.

An engine should pass over a lease (``FdLease``: ``LEASE_MAGIC``, the connection
stays open for further passes): the server then holds the engine's memory only
while that connection is open, and releases its mappings as soon as it closes —
when the engine exits or dies, in whatever container or pid namespace. A
one-shot ``send_fd`` is owned by the passing pid instead, which the server
cannot see from another pid namespace. What the server does with it
(how long it holds it, for whom) is kvsvc.server.data.fdbroker's business; this module holds
no server code, so an engine that imports the client imports none.

Replies: ``b"\\0" + token`` or ``b"\\1" + RemoteError`` (the one error contract).

``FdLease.server_watch`` watches the server process at the other end of a lease:
a server that copies in place into memory it was passed (LMCache's L1 file) has
ended its copies once that process exited, whether or not it ever answers again.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import threading

from kvsvc.errors import (
    DeadlineExceeded,
    KVServiceError,
    ServiceUnavailable,
    from_remote_error,
)
from kvsvc.framing import ERROR_REPLY, FILE_LEASE_MAGIC, LEASE_MAGIC, MAGIC, TOKEN_REPLY
from kvsvc.limits import FD_EXCHANGE_TIMEOUT_S
from kvsvc.pidfds import ProcessWatch, pidfd
from kvsvc.v1 import error_pb2

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def make_sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes whose size is sealed: what the server requires."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def send_fd(path: str, fd: int, timeout: float = FD_EXCHANGE_TIMEOUT_S) -> str:
    """Pass ``fd`` to the fd socket at ``path`` once (owned by this pid, see the
    module's docstring); the token a Map names it by."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        return _exchange(s, path, MAGIC, fd, timeout, connect=True)


class FdLease:
    """A connection to the fd socket kept open: what is passed over it lives in the
    server while it is open. ``close`` (or this process's exit) ends the lease, and
    the server then releases every mapping of those memfds. Thread-safe."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        # Connections whose exchange failed midway: a late reply could be taken for
        # the next one's, so they are not reused, but their passes stay leased.
        self._retired: list[socket.socket] = []

    def send(
        self, fd: int, timeout: float = FD_EXCHANGE_TIMEOUT_S, *, shared_file: bool = False
    ) -> str:
        """Pass ``fd`` under this lease; the token a Map names it by. ``shared_file``:
        ``fd`` is a plain shared-memory file opened read-write, not a sealed memfd
        (one whose owner cannot seal it, like vLLM's offload file); the server then
        copies it with positional I/O, never mmap."""
        magic = FILE_LEASE_MAGIC if shared_file else LEASE_MAGIC
        with self._lock:
            fresh = self._sock is None
            if self._sock is None:
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
                )
            s = self._sock
            try:
                return _exchange(s, self.path, magic, fd, timeout, connect=fresh)
            except KVServiceError as exc:
                if exc.reason in ("FD_SOCKET_TIMEOUT", "FD_SOCKET_UNAVAILABLE", "FD_SOCKET_BUSY"):
                    self._sock = None  # the next pass opens a new connection
                    self._retired.append(s)
                raise

    def server_watch(self) -> ProcessWatch | None:
        """A watch of the server process holding this lease's connection: what was
        passed over it lately went to that process. None without a connection, a
        pid (the server in another pid namespace) or pidfds."""
        with self._lock:
            return None if self._sock is None else peer_watch(self._sock)

    def close(self) -> None:
        with self._lock:
            for s in [*self._retired, *([self._sock] if self._sock else [])]:
                s.close()
            self._sock, self._retired = None, []


def peer_watch(s: socket.socket) -> ProcessWatch | None:
    """A watch of the process at the other end of the connected unix socket ``s``,
    or None (pid 0: it is in another pid namespace; no pidfds here). The pid is
    SO_PEERCRED's, taken at connect: the connection still open after the pidfd is
    open proves that pid was still the peer's, not a later process's."""
    try:
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, _, _ = struct.unpack("3i", creds)
    fd = pidfd(pid)
    if fd < 0:
        return None
    if not _quiet(s):
        os.close(fd)
        return None
    return ProcessWatch(fd)


def _quiet(s: socket.socket) -> bool:
    """Whether ``s`` is open with nothing to read: the server only replies to a
    request, so a hang-up, an error or stray bytes mean the peer may be gone."""
    poller = select.poll()
    poller.register(s.fileno(), select.POLLIN)
    return not poller.poll(0)


def _exchange(
    s: socket.socket, path: str, magic: bytes, fd: int, timeout: float, *, connect: bool
) -> str:
    """One pass on ``s``: ``magic`` with ``fd``, then the token or the typed error."""
    s.settimeout(timeout)
    try:
        if connect:
            s.connect(path)
        socket.send_fds(s, [magic], [fd])
        reply = s.recv(1 << 16)
    except TimeoutError as exc:
        raise DeadlineExceeded(
            f"the fd socket {path} did not answer within {timeout:g} s",
            reason="FD_SOCKET_TIMEOUT",
        ) from exc
    except OSError as exc:
        raise ServiceUnavailable(
            f"cannot pass an fd through {path}: {exc}",
            reason="FD_SOCKET_UNAVAILABLE",
            metadata={"path": path},
        ) from exc
    if reply[:1] == TOKEN_REPLY and len(reply) > 1:
        return reply[1:].decode()
    if reply[:1] == ERROR_REPLY:
        raise from_remote_error(error_pb2.RemoteError.FromString(reply[1:]))
    raise ServiceUnavailable(
        f"the fd socket {path} closed without an answer",
        reason="FD_SOCKET_UNAVAILABLE",
        metadata={"path": path},
    )
