"""Sealed memfds passed over a unix socket (SCM_RIGHTS): the fast CPU region kind,
the engine's side and the message format both sides share.

A file under --shm-dir can be truncated by its owner at any moment, so the server
copies it with positional file I/O (a short read is a typed error; a SIGBUS in an
mmap copy would kill the server). A memfd sealed with F_SEAL_SHRINK can never
shrink, so the server may map it and copy with memcpy. A memfd has no name the
server could open, so the client passes the fd itself: it connects to the
server's fd socket (SOCK_SEQPACKET), sends ``MAGIC`` with the fd, and gets back a
token that a Map names in a ``SealedMemfdHandle``. What the server does with it
(how long it holds it, for whom) is kvsvc.fdbroker's business; this module holds
no server code, so an engine that imports the client imports none.

Replies: ``b"\\0" + token`` or ``b"\\1" + RemoteError`` (the one error contract).
"""

from __future__ import annotations

import fcntl
import os
import socket

from kvsvc.config import FD_EXCHANGE_TIMEOUT_S
from kvsvc.errors import (
    DeadlineExceeded,
    KVServiceError,
    ServiceUnavailable,
    from_remote_error,
    to_remote_error,
)
from kvsvc.v1 import error_pb2

MAGIC = b"kvsvc-fd/1"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_TOKEN = b"\0"
_ERROR = b"\1"


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


def token_reply(token: str) -> bytes:
    """The broker's answer to an fd it holds."""
    return _TOKEN + token.encode()


def error_reply(exc: KVServiceError) -> bytes:
    """The broker's answer to an fd it refused, as the one error envelope."""
    return _ERROR + to_remote_error(exc, "").SerializeToString()


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
    if reply[:1] == _TOKEN and len(reply) > 1:
        return reply[1:].decode()
    if reply[:1] == _ERROR:
        raise from_remote_error(error_pb2.RemoteError.FromString(reply[1:]))
    raise ServiceUnavailable(
        f"the fd socket {path} closed without an answer",
        reason="FD_SOCKET_UNAVAILABLE",
        metadata={"path": path},
    )
