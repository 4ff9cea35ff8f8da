"""The server's fd socket: it takes the sealed memfds engines pass (kvsvc.client.fdpass
has the engine's side and the message format) and holds them under tokens.

The server keeps a passed fd for ``FD_TOKEN_TTL_S`` once a Map used it, so a
failed Map can be retried and ranks can share one fd, but only
``FD_TOKEN_UNUSED_TTL_S`` if no Map came; what it holds is bounded in all and per
process, and a silent peer delays no one.

Who owns a passed memfd (kvsvc.server.data.fdowners), so that a dead engine's KV
memory is not kept alive by the server's mapping: an engine that passes over a
*lease* connection (it stays open, ``LEASE_MAGIC``) owns it while that connection
is open. The kernel closes it when the engine's process dies, whatever its pid
namespace, and the broker then releases its tokens at once and tells the server
(``on_lease_end``) to release its mappings. A one-shot pass (``MAGIC``, the older
clients) is owned by the passing pid through a pidfd; a peer in another pid
namespace has pid 0 there and no owner: its mappings live until unmapped (use a
lease). Where the socket listens and who may connect: kvsvc.server.data.fdsocket.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import resource
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsvc.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    InvalidRequest,
    KVServiceError,
    ServiceUnavailable,
)
from kvsvc.framing import FILE_LEASE_MAGIC, LEASE_MAGIC, MAGIC, error_reply, token_reply
from kvsvc.pidfds import exited, pidfd
from kvsvc.server.config import (
    FD_LEASES_MAX,
    FD_PEER_TIMEOUT_S,
    FD_PEERS_MAX,
    FD_TOKEN_TTL_S,
    FD_TOKEN_UNUSED_TTL_S,
    FD_TOKENS_MAX,
    FD_TOKENS_PER_PEER_MAX,
)
from kvsvc.server.data.fdowners import Lease, Owner, PidOwner, SharedPidfd
from kvsvc.server.data.fdsocket import answers, restrict_socket

log = logging.getLogger(__name__)


def check_sealed(fd: int) -> int:
    """The memfd's size, if the server may map it; else a typed error."""
    st = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if stat.S_ISREG(st.st_mode) else 0
    except OSError:  # EINVAL: a file without seal support (not a memfd)
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidRequest(
            "the fd is not a memfd sealed with F_SEAL_SHRINK (create it with "
            "MFD_ALLOW_SEALING and add the seal): only such memory is safe to map, "
            "since it can never be truncated under the server",
            reason="FD_NOT_SEALED",
            metadata={"seals": seals},
        )
    if st.st_size <= 0:
        raise InvalidRequest("the memfd is empty", reason="FD_NOT_SEALED")
    return int(st.st_size)


def check_file(fd: int) -> int:
    """The size of a passed plain shared-memory file (``FILE_LEASE_MAGIC``), if the
    server may copy it: a non-empty regular file the client opened read-write. It
    may shrink, so regions copy it with positional I/O only (a short read is a
    typed error, never a SIGBUS); the client proved access by passing it."""
    st = os.fstat(fd)
    rw = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    if not stat.S_ISREG(st.st_mode) or not rw or st.st_size <= 0:
        raise InvalidRequest(
            "a passed shared-memory file must be a non-empty regular file opened read-write",
            reason="FD_NOT_A_FILE",
            metadata={"regular": stat.S_ISREG(st.st_mode), "readWrite": rw},
        )
    return int(st.st_size)


@dataclass
class _Held:
    fd: int
    size: int
    pid: int  # the passing process as SO_PEERCRED shows it (0: another pid namespace)
    owner: SharedPidfd | None  # one-shot passes with a pid
    lease: Lease | None  # passes over a lease connection
    passed: float
    used: bool = False  # a Map has opened it

    @property
    def peer(self) -> object:
        """What one quota counts: the lease, else the pid."""
        return self.lease if self.lease is not None else self.pid


class FdBroker:
    """The server's fd socket: takes sealed memfds and holds them under tokens.

    One thread serves every connection through a selector: a peer that connects
    and says nothing is closed after ``peer_timeout`` without delaying anyone
    else. What it holds is bounded: ``max_tokens`` fds in all, ``per_peer`` from
    one process, each closed ``unused_ttl`` after it was passed unless a Map used
    it (then ``ttl``), and ``max_peers`` connections."""

    def __init__(
        self,
        path: str,
        ttl: float | None = None,
        max_tokens: int | None = None,
        *,
        unused_ttl: float | None = None,
        per_peer: int | None = None,
        max_peers: int | None = None,
        peer_timeout: float | None = None,
        max_leases: int | None = None,
        on_lease_end: Callable[[Lease], None] | None = None,
        gid: int = -1,
    ) -> None:
        # Defaults are read at construction, so a test can patch this module's names.
        self.path = path
        self.ttl = FD_TOKEN_TTL_S if ttl is None else ttl
        self.unused_ttl = min(self.ttl, FD_TOKEN_UNUSED_TTL_S if unused_ttl is None else unused_ttl)
        self.max_tokens = _fd_budget(FD_TOKENS_MAX if max_tokens is None else max_tokens)
        self.per_peer = min(
            self.max_tokens, FD_TOKENS_PER_PEER_MAX if per_peer is None else per_peer
        )
        self.max_peers = FD_PEERS_MAX if max_peers is None else max_peers
        self.peer_timeout = FD_PEER_TIMEOUT_S if peer_timeout is None else peer_timeout
        self.max_leases = FD_LEASES_MAX if max_leases is None else max_leases
        # Called from the socket thread once a lease ended and its tokens are gone.
        self.on_lease_end = on_lease_end
        self._lock = threading.Lock()
        self._fds: dict[str, _Held] = {}
        self._owners: dict[int, SharedPidfd] = {}  # pid -> its live pidfd
        self._peers: dict[socket.socket, float] = {}  # connection -> when it is dropped
        self._leases: dict[socket.socket, Lease] = {}  # lease connections, open until EOF
        self._stop = threading.Event()
        if os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
            if answers(path):
                raise FileExistsError(f"{path}: another server is listening on this fd socket")
            os.unlink(path)  # a socket left by a server that died
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(path)
            restrict_socket(path, gid)
            self._sock.listen(64)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="kvsvc-fdpass", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def open(self, token: str) -> tuple[int, int, Owner | None]:
        """A new fd of ``token``'s memfd (the caller closes it), its size, and its
        owner (None: unknown; the caller closes it too). The token is then kept
        ``ttl`` after it was passed, for retries and other ranks."""
        with self._lock:
            self._expire()
            held = self._fds.get(token)
            if held is None:
                raise InvalidRequest(
                    f"memfd token {token[:12]!r} is unknown or expired (a passed fd is kept "
                    f"{self.unused_ttl:g} s for its first Map, {self.ttl:g} s once one used "
                    f"it; pass it again)",
                    reason="FD_TOKEN_UNKNOWN",
                    metadata={"token": token[:12], **self._ttls()},
                )
            held.used = True
            fd = os.dup(held.fd)
            if held.lease is not None:
                return fd, held.size, held.lease
            try:
                owner = PidOwner(os.dup(held.owner.fd)) if held.owner is not None else None
            except BaseException:
                os.close(fd)
                raise
            return fd, held.size, owner

    def __len__(self) -> int:
        return len(self._fds)

    @property
    def peers(self) -> int:
        """Connections open on the fd socket, waiting for their fd."""
        return len(self._peers)

    def lease_peers(self) -> list[tuple[int, int]]:
        """(pid, uid) of each open lease as the server sees it (pid 0: the engine
        is in another pid namespace)."""
        return [(lease.pid, lease.uid) for lease in list(self._leases.values())]

    @property
    def leases(self) -> int:
        """Lease connections open: engines whose passed memory lives while they do."""
        return len(self._leases)

    def open_fds(self) -> int:
        """Every fd the broker holds: passed memfds, owners' pidfds, connections and
        its socket (what bounds the server's fd count, exported as a metric)."""
        with self._lock:
            held = len(self._fds) + len({id(h.owner) for h in self._fds.values() if h.owner})
        conns = len(self._peers) + len(self._leases)
        return held + conns + (0 if self._sock.fileno() < 0 else 1)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            for token in list(self._fds):
                self._release(token)

    def _ttls(self) -> dict[str, object]:
        return {"unusedTtlS": self.unused_ttl, "ttlS": self.ttl}

    # --- tokens (under self._lock) ---
    def _expire(self) -> None:
        now = time.monotonic()
        for token, held in list(self._fds.items()):
            if now >= held.passed + (self.ttl if held.used else self.unused_ttl):
                self._release(token)

    def _release(self, token: str) -> None:
        held = self._fds.pop(token)
        os.close(held.fd)
        owner = held.owner
        if owner is not None:
            owner.refs -= 1
            if owner.refs == 0:
                os.close(owner.fd)
                if self._owners.get(owner.pid) is owner:
                    del self._owners[owner.pid]

    def _owner(self, pid: int) -> SharedPidfd | None:
        owner = self._owners.get(pid)
        if owner is not None and not exited(owner.fd):
            return owner
        fd = pidfd(pid)  # an exited owner's pid may now be another process's
        if fd < 0:
            return None
        self._owners[pid] = owner = SharedPidfd(pid, fd)
        return owner

    def _register(self, fd: int, pid: int, lease: Lease | None, *, file: bool = False) -> str:
        size = check_file(fd) if file else check_sealed(fd)
        with self._lock:
            self._expire()
            peer = lease if lease is not None else pid
            mine = sum(1 for h in self._fds.values() if h.peer is peer or h.peer == peer)
            if mine >= self.per_peer:
                raise CapacityExhausted(
                    f"process {pid} already has {mine} passed fds waiting (the most one "
                    f"process may hold); one is closed {self.unused_ttl:g} s after it was "
                    f"passed unless a Map used it, {self.ttl:g} s if one did",
                    reason="FD_TOKENS_EXHAUSTED",
                    metadata={"peerPid": pid, "held": mine, "limit": self.per_peer, **self._ttls()},
                )
            if len(self._fds) >= self.max_tokens:
                raise CapacityExhausted(
                    f"{len(self._fds)} passed fds are waiting (the most held at once); one "
                    f"is closed {self.unused_ttl:g} s after it was passed unless a Map used "
                    f"it, {self.ttl:g} s if one did",
                    reason="FD_TOKENS_EXHAUSTED",
                    metadata={"held": len(self._fds), "limit": self.max_tokens, **self._ttls()},
                )
            # A lease owns what is passed over it; a pid only where no lease does.
            owner = self._owner(pid) if lease is None else None
            if owner is not None:
                owner.refs += 1
            token = secrets.token_hex(16)
            self._fds[token] = _Held(fd, size, pid, owner, lease, time.monotonic())
        return token

    def _end(self, lease: Lease) -> None:
        """A lease connection closed (its engine exited or let go): its tokens go at
        once, and the server is told to release the mappings that used them."""
        with self._lock:
            for token in [t for t, h in self._fds.items() if h.lease is lease]:
                self._release(token)
        lease.end()
        log.info("fd lease of pid %d (uid %d) ended", lease.pid, lease.uid)
        if self.on_lease_end is not None:
            self.on_lease_end(lease)

    # --- the socket thread: it alone touches the connections ---
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()  # epoll: no FD_SETSIZE limit
        sel.register(self._sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = min([0.2, *(d - now for d in self._peers.values())])
                for key, _ in sel.select(max(wait, 0.0)):
                    if key.fileobj is self._sock:
                        self._accept(sel)
                    else:
                        conn = key.fileobj
                        assert isinstance(conn, socket.socket)
                        self._answer(sel, conn)
                self._drop_silent(sel)
                with self._lock:
                    self._expire()  # closed on time even when no Map comes
        except Exception:
            log.exception("fd socket thread failed: sealed memfds are no longer taken")
        finally:
            for conn in [*self._peers, *self._leases]:
                self._drop(sel, conn)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(self.max_peers):  # a bounded batch, then the others get a turn
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE: the fds held are bounded, others are not
                log.warning("fd socket accept failed: %s", exc)
                time.sleep(0.05)
                return
            conn.setblocking(False)
            taken = self._take(conn, None)  # its fd was already sent: the usual case
            if isinstance(taken, Lease):
                self._leases[conn] = taken
                sel.register(conn, selectors.EVENT_READ)
            elif taken:
                conn.close()
            elif len(self._peers) >= self.max_peers:
                busy = error_reply(
                    CapacityExhausted(
                        f"the fd socket already serves {len(self._peers)} connections that "
                        f"have not sent their fd (the most at once); retry",
                        reason="FD_SOCKET_BUSY",
                        metadata={"peers": len(self._peers), "limit": self.max_peers},
                        retryable=True,
                    ),
                )
                _reply(conn, busy)
                conn.close()
            else:
                self._peers[conn] = time.monotonic() + self.peer_timeout
                sel.register(conn, selectors.EVENT_READ)

    def _answer(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        taken = self._take(conn, self._leases.get(conn))
        if isinstance(taken, Lease):
            if self._peers.pop(conn, None) is not None:  # a waiting peer took a lease
                self._leases[conn] = taken
        elif taken:
            self._drop(sel, conn)

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        self._peers.pop(conn, None)
        lease = self._leases.pop(conn, None)
        sel.unregister(conn)
        conn.close()
        if lease is not None:
            self._end(lease)

    def _drop_silent(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for conn in [c for c, deadline in self._peers.items() if deadline <= now]:
            log.info(
                "fd socket peer %s sent no fd within %g s: closed",
                _peer(conn)[0],
                self.peer_timeout,
            )
            silent = error_reply(
                DeadlineExceeded(
                    f"the fd socket got no fd within {self.peer_timeout:g} s of accepting "
                    f"the connection",
                    reason="FD_SOCKET_TIMEOUT",
                    metadata={"timeoutS": self.peer_timeout},
                ),
            )
            _reply(conn, silent)
            self._drop(sel, conn)

    def _take(self, conn: socket.socket, lease: Lease | None) -> bool | Lease:
        """Read one message of a connection and answer it. False: none has come yet;
        a Lease: keep the connection open (it is, or now became, a lease); True:
        close it (a one-shot pass answered, an end of file, an error). Every fd
        received is kept under a token or closed here."""
        try:
            msg, ancdata, flags, _ = conn.recvmsg(
                len(MAGIC) + 1,
                socket.CMSG_SPACE(_MAX_FDS * _FD_BYTES),
                socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC,
            )
        except BlockingIOError:
            return False
        except OSError:  # the peer reset the connection
            return True
        fds: list[int] = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % _FD_BYTES]))
        if not msg and not fds and not flags & socket.MSG_CTRUNC:
            return True  # end of file: the peer closed (for a lease: its engine is gone)
        pid, uid = _peer(conn) if conn.fileno() >= 0 else (0, 0)
        keep: bool | Lease = True if lease is None else lease
        token, reply = None, b""
        try:  # every fd received is kept under a token or closed before the reply
            cut = flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC)
            leased = (LEASE_MAGIC, FILE_LEASE_MAGIC)
            allowed = leased if lease is not None else (MAGIC, *leased)
            if msg not in allowed or len(fds) != 1 or cut:
                raise InvalidRequest(
                    f"send exactly one fd with the message {MAGIC!r}, or {LEASE_MAGIC!r} "
                    f"({FILE_LEASE_MAGIC!r}: a plain shared-memory file) on a connection "
                    f"kept open as a lease (got {len(fds)} fds"
                    f"{', more cut off' if cut else ''} and {len(msg)} bytes)",
                    reason="FD_PASS_MALFORMED",
                    metadata={"fds": len(fds), "bytes": len(msg), "truncated": bool(cut)},
                )
            if msg in leased and lease is None:
                if len(self._leases) >= self.max_leases:
                    raise CapacityExhausted(
                        f"the fd socket already holds {len(self._leases)} lease connections "
                        f"(the most at once); one ends when its engine closes it or exits",
                        reason="FD_SOCKET_BUSY",
                        metadata={"leases": len(self._leases), "limit": self.max_leases},
                        retryable=True,
                    )
                keep = lease = Lease(pid, uid)
            token = self._register(fds[0], pid, lease, file=msg == FILE_LEASE_MAGIC)
            reply = token_reply(token)
        except KVServiceError as exc:
            log.info("fd from pid %d refused: %s", pid, exc)
            reply = error_reply(exc)
        except Exception:
            log.exception("fd socket exchange failed")
            reply = error_reply(ServiceUnavailable("the fd socket failed; see the server log"))
        finally:
            for fd in fds if token is None else fds[1:]:
                os.close(fd)
        if _reply(conn, reply):
            if token is not None:
                how = "leased" if lease is not None else "one-shot"
                log.info("fd from pid %d held as memfd token %s… (%s)", pid, token[:8], how)
            return keep
        if token is not None:  # nobody learned the token: no Map can name it
            with self._lock:
                self._release(token)
        if isinstance(keep, Lease) and keep is not self._leases.get(conn):
            keep.end()  # a lease nobody learned of: nothing was registered under it
        return True


_MAX_FDS = 4  # received per message: enough to see a peer sent more than one
_FD_BYTES = array.array("i").itemsize


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the connected process; pid 0 when in another pid namespace."""
    pid, uid, _ = struct.unpack(
        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return pid, uid


def _reply(conn: socket.socket, data: bytes) -> bool:
    """Answer without blocking: a reply is small and a connection gets only one."""
    try:
        conn.send(data, socket.MSG_DONTWAIT)
    except OSError:  # the peer is gone or reads nothing: it gets no answer
        return False
    return True


def _fd_budget(max_tokens: int) -> int:
    """``max_tokens``, but at most a quarter of the soft fd limit, so the fds held
    (a memfd and perhaps a pidfd each) leave room for what the server must open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or max_tokens <= soft // 4:
        return max_tokens
    log.warning(
        "RLIMIT_NOFILE is %d: the fd socket holds at most %d passed fds, not %d",
        soft,
        soft // 4,
        max_tokens,
    )
    return max(1, soft // 4)
