"""Whether Redis may be called now, and what kind a failure was: the error kinds
(the label of kvsvc_remote_errors), the circuit breaker that stops calling a
Redis that keeps failing, and the resolver that keeps a DNS server that never
answers off every caller's path. The tier's one log and its rate-limited
warnings live here too, so every module of the tier shares the same limit."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import redis.exceptions as rx

from kvsvc.errors import BoundedLog
from kvsvc.server.config import REMOTE_BREAKER_OPEN_S, REMOTE_DNS_REFRESH_S
from kvsvc.server.ops import failpoints

log = logging.getLogger("kvsvc.server.tiers.redis")
#: at most one such warning per 10 s for the whole tier (a failing Redis fails every call)
warn = BoundedLog(log, 10.0)

# Error kinds (the label of kvsvc_remote_errors).
TIMEOUT, CONNECTION, AUTH, TLS, DNS, RESPONSE, BREAKER_OPEN, BUSY, OTHER = (
    "timeout",
    "connection",
    "auth",
    "tls",
    "dns",
    "response",
    "breaker_open",
    "busy",
    "other",
)


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, rx.AuthenticationError | rx.AuthorizationError | rx.NoPermissionError):
        return AUTH
    if caused_by(exc, ssl.SSLError):
        return TLS
    if caused_by(exc, socket.gaierror):
        return DNS
    if isinstance(exc, rx.TimeoutError | TimeoutError | asyncio.TimeoutError):
        return TIMEOUT
    if isinstance(exc, rx.ConnectionError | rx.ClusterError | rx.RedisClusterException | OSError):
        return CONNECTION
    if isinstance(exc, rx.ResponseError):
        text = str(exc)
        return AUTH if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")) else RESPONSE
    return OTHER


def caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is or comes from a ``kind`` (redis-py raises its own
    ConnectionError while handling ssl's or the resolver's error)."""
    seen: BaseException | None = exc
    for _ in range(5):  # a short chain; no cycles followed forever
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Unresolved(socket.gaierror):
    """--remote's host name has no answer from DNS (or none in time)."""


class Skipped(Exception):
    """A Redis exchange that did not happen or failed (already counted)."""


def consume(fut: asyncio.Future[Any]) -> None:
    """Read a dropped exchange's outcome so asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


class Resolver:
    """Looks --remote's host name up on its own thread, one lookup at a time, so a
    DNS server that never answers blocks that thread only, never a caller or a
    reader/writer thread. Redis is called only while the last lookup answered and
    none has been waiting longer than --remote-timeout (redis-py then looks the
    name up again as it connects, and the system's cache answers it; a DNS that
    stops answering between the two lookups is not covered). IP addresses need
    no lookup."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        self.port = parts.port or 6379
        self.timeout = timeout
        try:
            ipaddress.ip_address(self.host)
            self.needed = False
        except ValueError:
            self.needed = bool(self.host)
        self._lock = threading.Lock()
        self._answered = threading.Event()
        self._ok = False  # the last lookup that ended found the name
        self._ended = -math.inf  # when it ended (monotonic)
        self._since: float | None = None  # when the lookup under way began

    def usable(self) -> bool:
        """Whether a call to Redis may go ahead now; starts a lookup when one is due."""
        if not self.needed:
            return True
        now = time.monotonic()
        with self._lock:
            due = REMOTE_DNS_REFRESH_S if self._ok else REMOTE_BREAKER_OPEN_S
            if self._since is None and now - self._ended >= due:
                self._start(now)
            stuck = self._since is not None and now - self._since > self.timeout
            return self._ok and not stuck

    def first(self) -> bool:
        """At start-up: the first lookup's outcome, waited for --remote-timeout at most."""
        self.usable()
        return not self.needed or (self._answered.wait(self.timeout) and self.usable())

    def _start(self, now: float) -> None:
        self._since = now
        threading.Thread(target=self._lookup, name="kvsvc-remote-dns", daemon=True).start()

    def _lookup(self) -> None:
        try:
            failpoints.hit("remote.resolve")
            socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            ok = True
        except Exception as exc:  # noqa: BLE001 - any failure: the name is unusable now
            warn.warning("remote tier: cannot resolve %s (%s)", self.host, exc)
            ok = False
        with self._lock:
            self._ok, self._ended, self._since = ok, time.monotonic(), None
        self._answered.set()
