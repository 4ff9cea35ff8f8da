"""Sealed memfds passed over a unix socket (SCM_RIGHTS): the fast CPU region kind.

A file under --shm-dir can be truncated by its owner at any moment, so the server
copies it with positional file I/O (a short read is a typed error; a SIGBUS in an
mmap copy would kill the server). A memfd sealed with F_SEAL_SHRINK can never
shrink, so the server may map it and copy with memcpy. A memfd has no name the
server could open, so the client passes the fd itself: it connects to the
server's fd socket (SOCK_SEQPACKET), sends ``MAGIC`` with the fd, and gets back a
token that a Map names in a ``SealedMemfdHandle``. The server keeps the fd for
``FD_TOKEN_TTL_S``, so a failed Map can be retried and ranks can share one fd.
The process that passed the fd owns it: the server holds a pidfd of it, and once
it has exited, a mapping of its memfd is released at the next Map, as one of a
deleted shm file is (else the server's mapping would keep a dead engine's KV
memory alive).

Replies: ``b"\\0" + token`` or ``b"\\1" + RemoteError`` (the one error contract).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import select
import socket
import stat
import struct
import tempfile
import threading
import time

from kvsvc.config import FD_EXCHANGE_TIMEOUT_S, FD_TOKEN_TTL_S, FD_TOKENS_MAX
from kvsvc.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    InvalidRequest,
    KVServiceError,
    ServiceUnavailable,
    from_remote_error,
    to_remote_error,
)
from kvsvc.v1 import error_pb2

log = logging.getLogger(__name__)

MAGIC = b"kvsvc-fd/1"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MAX_SUN_PATH = 107  # sockaddr_un.sun_path minus the NUL


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


def socket_path(setting: str, shm_dir: str, start_id: str) -> str | None:
    """Where the server listens for fds: ``setting``, or for 'auto' a per-server name
    in the shm dir (shared by engine and server containers), else in the temp dir
    when that path is too long for a unix socket; None for 'off'."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    name = f".kvsvc-{start_id[:12]}.fds"
    path = os.path.join(shm_dir, name)
    if len(os.fsencode(path)) > _MAX_SUN_PATH:
        path = os.path.join(tempfile.gettempdir(), name)
    return path


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


class FdBroker:
    """The server's fd socket: takes sealed memfds and holds them under tokens."""

    def __init__(
        self, path: str, ttl: float = FD_TOKEN_TTL_S, max_tokens: int = FD_TOKENS_MAX
    ) -> None:
        self.path = path
        self.ttl = ttl
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        # token -> (fd, size, expiry, pidfd of the passing process or -1)
        self._fds: dict[str, tuple[int, int, float, int]] = {}
        self._stop = threading.Event()
        if os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # a socket left by a server that died
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o660)
            self._sock.listen(64)
            self._sock.settimeout(0.2)  # accept wakes up to notice close()
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="kvsvc-fdpass", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def open(self, token: str) -> tuple[int, int, int]:
        """New fds for ``token``'s memfd and its owner's pidfd (-1: owner unknown;
        the caller closes both), and the memfd's size."""
        with self._lock:
            self._expire()
            entry = self._fds.get(token)
            if entry is None:
                raise InvalidRequest(
                    f"memfd token {token[:12]!r} is unknown or expired (a passed fd is kept "
                    f"{self.ttl:.0f} s for Map; pass it again)",
                    reason="FD_TOKEN_UNKNOWN",
                    metadata={"token": token[:12]},
                )
            fd, size, _, pidfd = entry
            return os.dup(fd), size, os.dup(pidfd) if pidfd >= 0 else -1

    def __len__(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=FD_EXCHANGE_TIMEOUT_S + 1)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            for fd, _, _, pidfd in self._fds.values():
                _close(fd, pidfd)
            self._fds.clear()

    # --- the socket thread ---
    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, (_, _, exp, _) in self._fds.items() if exp <= now]:
            fd, _, _, pidfd = self._fds.pop(token)
            _close(fd, pidfd)

    def _register(self, fd: int, pid: int) -> str:
        size = check_sealed(fd)
        with self._lock:
            self._expire()
            if len(self._fds) >= self.max_tokens:
                raise CapacityExhausted(
                    f"{len(self._fds)} passed fds are waiting for Map (the most held at "
                    f"once); they expire {self.ttl:.0f} s after being passed",
                    reason="FD_TOKENS_EXHAUSTED",
                )
            token = secrets.token_hex(16)
            self._fds[token] = (fd, size, time.monotonic() + self.ttl, _pidfd(pid))
        return token

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("fd socket accept failed")
                time.sleep(0.1)
                continue
            with conn:
                try:
                    self._exchange(conn)
                except Exception:
                    log.exception("fd socket exchange failed")

    def _exchange(self, conn: socket.socket) -> None:
        conn.settimeout(FD_EXCHANGE_TIMEOUT_S)
        pid = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )[0]
        msg, fds, _flags, _ = socket.recv_fds(conn, len(MAGIC) + 1, 4)
        kept = False
        try:
            if msg != MAGIC or len(fds) != 1:
                raise InvalidRequest(
                    f"send exactly one fd with the message {MAGIC!r} "
                    f"(got {len(fds)} fds and {len(msg)} bytes)",
                    reason="FD_PASS_MALFORMED",
                )
            token = self._register(fds[0], pid)
            kept = True
            log.info("fd from pid %d held as memfd token %s…", pid, token[:8])
            conn.sendall(b"\0" + token.encode())
        except KVServiceError as exc:
            log.info("fd from pid %d refused: %s", pid, exc)
            conn.sendall(b"\1" + to_remote_error(exc, "").SerializeToString())
        finally:
            for fd in fds if not kept else fds[1:]:
                os.close(fd)


def _pidfd(pid: int) -> int:
    """A pidfd of ``pid``, or -1 where it cannot be had (a peer in another pid
    namespace shows as pid 0; it may also have exited already)."""
    if pid <= 0:
        return -1
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


def exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (its pidfd is readable)."""
    return pidfd >= 0 and bool(select.select([pidfd], [], [], 0)[0])


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def send_fd(path: str, fd: int, timeout: float = FD_EXCHANGE_TIMEOUT_S) -> str:
    """Pass ``fd`` to the fd socket at ``path``; the token a Map names it by."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            socket.send_fds(s, [MAGIC], [fd])
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
    if reply[:1] == b"\0" and len(reply) > 1:
        return reply[1:].decode()
    if reply[:1] == b"\1":
        raise from_remote_error(error_pb2.RemoteError.FromString(reply[1:]))
    raise ServiceUnavailable(
        f"the fd socket {path} closed without an answer",
        reason="FD_SOCKET_UNAVAILABLE",
        metadata={"path": path},
    )
