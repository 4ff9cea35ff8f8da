"""How the tier talks to Redis: the clients (sync for values on threads, asyncio
for Lookup on the loop) made from --remote's URL, TLS files and password, and the
gate every exchange passes (DNS, breaker, how many already wait), which turns a
failure into a counted miss. ``Connections`` is the base the tier's parts
(lookup, fetch, writer) build on; it holds the counters kvsvc.server.ops.tier_metrics reads.
``Replies`` reads Retrieve's GET replies off a connection's socket, without
hiredis, straight into the chunks they load.

Redis is never part of the contract: every call has socket timeouts and no
retries, and a failure is a miss and a counter, never an error, a hang or a
health change.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Encoder, PythonRespSerializer
from redis.exceptions import InvalidResponse
from redis.retry import Retry

from kvsvc.server.config import (
    REMOTE_BREAKER_FAILURES,
    REMOTE_BREAKER_OPEN_S,
    REMOTE_FETCHERS,
    REMOTE_MALLOC_KEEP_BYTES,
    REMOTE_SOCKET_READ_BYTES,
    REMOTE_WRITERS,
    ServerConfig,
    redact_url,
    remote_password,
)
from kvsvc.server.data.store import ChunkStore
from kvsvc.server.tiers.breaker import Breaker
from kvsvc.server.tiers.redis.health import (
    BREAKER_OPEN,
    BUSY,
    CONNECTION,
    DNS,
    TIMEOUT,
    Resolver,
    Skipped,
    error_kind,
    warn,
)

if TYPE_CHECKING:
    from kvsvc.server.events import EventLog


def value_connection_settings() -> dict[str, Any]:
    """What connections that carry values change in redis-py's defaults (the
    benchmark's like-for-like raw client uses them too): read REMOTE_SOCKET_READ_BYTES
    at once, and pack commands with redis-py's Python packer, which sends a large
    value as the buffer it is, where the hiredis packer (the default with hiredis)
    copies every argument into one new bytes object, holding the GIL."""
    return {
        "socket_read_size": REMOTE_SOCKET_READ_BYTES,
        "command_packer": PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode),
    }


#: Most writes and fetches kept for a recheck after Redis' run came into doubt (a
#: hint: the rest are simply not announced).
UNCONFIRMED_MAX = 65536

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def reuse_freed_memory() -> bool:
    """Have glibc's malloc serve large blocks from its heaps and keep up to
    REMOTE_MALLOC_KEEP_BYTES freed at the top of each: every value read from
    Redis is a new bytes object (hiredis makes it), and above malloc's mmap
    threshold (32 MiB at most) each came from a fresh mmap whose pages faulted
    in 4 KiB at a time, then went back to the kernel on free: half the reader
    thread's CPU for 32 MiB values (docs/benchmarks.md section 7). Process-wide
    and only where glibc is the C library; returns whether it was set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its defaults stay
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(
        mallopt(_M_TRIM_THRESHOLD, REMOTE_MALLOC_KEEP_BYTES)
    )


class Connections:
    """The tier's settings, clients, gate and counters. Public counters are read
    by kvsvc.server.ops.tier_metrics (RemoteStats)."""

    def __init__(
        self, config: ServerConfig, store: ChunkStore, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.url = config.tiers.remote
        self.where = redact_url(config.tiers.remote)
        self.prefix = config.tiers.remote_prefix
        self.timeout = config.tiers.remote_timeout
        self.lookup_budget = config.tiers.remote_lookup_budget
        self.ttl = config.tiers.remote_ttl
        self.part_bytes = config.tiers.remote_value_bytes
        self.store = store
        self.loop = loop
        self.breaker = Breaker(
            REMOTE_BREAKER_FAILURES,
            REMOTE_BREAKER_OPEN_S,
            tier="remote",
            what="Redis",
            meanwhile="remote reads are misses, writes are dropped",
        )
        self.resolver = Resolver(config.tiers.remote, config.tiers.remote_timeout)
        self.cluster = "+cluster" in config.tiers.remote.split("://", 1)[0]
        self.tls_ca, self.tls_cert, self.tls_key = (
            config.tiers.remote_tls_ca,
            config.tiers.remote_tls_cert,
            config.tiers.remote_tls_key,
        )
        self._password = remote_password(config)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._aclient: Any = None  # used on the loop only
        # counters (ops.tier_metrics reads them; updated under _stats_lock off the loop)
        self._stats_lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.writes = 0
        self.dropped_writes = 0
        #: dropped_writes by why: queue (write-behind full), unavailable (Redis failing,
        #: breaker open), closing (the server stopping)
        self.skipped: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self._closed = False
        #: told of what the tier found, wrote or lost (WatchEvents; set by the servicer)
        self.events: EventLog | None = None
        #: changes whenever Redis' run is in doubt (kvsvc.server.tiers.redis.runs): a
        #: write sent before is announced only once the run now serving holds it
        self.run_epoch = 0
        #: (namespace, key, layout, bytes) written across such a change, to recheck
        self.unconfirmed: list[tuple[str, bytes, str, int]] = []
        #: while the announced keys are rechecked against a new run
        self.rechecking = False

    # --- clients ---
    def _redis(self) -> Any:
        """The client, made on first use (a Redis Cluster client asks the cluster
        for its slots when made, which fails while the cluster is down)."""
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _settings(self) -> tuple[str, dict[str, Any]]:
        """The URL redis-py parses and the settings of every connection, sync and
        asyncio alike: explicit timeouts, no health-check pings (no retries is
        set by each maker, as the two clients take different Retry classes)."""
        scheme, rest = self.url.split("://", 1)
        settings: dict[str, Any] = {
            "password": self._password,
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "health_check_interval": 0,
        }
        if scheme.startswith("rediss"):  # certificates and host name always verified
            settings["ssl_cert_reqs"] = "required"
            for name, path in (
                ("ssl_ca_certs", self.tls_ca),
                ("ssl_certfile", self.tls_cert),
                ("ssl_keyfile", self.tls_key),
            ):
                if path:
                    settings[name] = path
        return scheme.replace("+cluster", "") + "://" + rest, settings

    def _make_client(self) -> Any:
        """The sync client, which carries values: value_connection_settings
        (docs/benchmarks.md section 7 measured them)."""
        url, settings = self._settings()
        value_settings = value_connection_settings()
        no_retry = Retry(NoBackoff(), 0)
        if self.cluster:  # RedisCluster takes no packer (it drops unknown settings)
            read = value_settings["socket_read_size"]
            return RedisCluster.from_url(url, retry=no_retry, socket_read_size=read, **settings)
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=REMOTE_FETCHERS + REMOTE_WRITERS + 2,
            timeout=self.timeout,
            retry=no_retry,
            **value_settings,
            **settings,
        )
        return redis.Redis(connection_pool=pool)

    def _aredis(self) -> Any:
        """The asyncio client for Lookup, on the loop, made on first use."""
        if self._aclient is None:
            url, settings = self._settings()
            no_retry = AsyncRetry(NoBackoff(), 0)
            if self.cluster:
                self._aclient = aredis.RedisCluster.from_url(url, retry=no_retry, **settings)
            else:
                pool = aredis.ConnectionPool.from_url(
                    url, max_connections=REMOTE_FETCHERS, retry=no_retry, **settings
                )
                self._aclient = aredis.Redis(connection_pool=pool)
        return self._aclient

    def _close_client(self) -> None:
        with contextlib.suppress(Exception):
            if self._client is not None:
                self._client.close()

    # --- the gate ---
    def _refused(self) -> str | None:
        """Why no call may go to Redis now (counted), or None."""
        if not self.resolver.usable():
            self._count(self.errors, DNS)
            return DNS
        if self._closed or not self.breaker.allow():
            self._count(self.errors, BREAKER_OPEN)
            return BREAKER_OPEN
        return None

    def _turned_away(self, busy: int) -> bool:
        """Refused (and counted) before it takes a thread or task: the name does not
        resolve, the breaker is open, or ``busy`` exchanges already wait on Redis."""
        resolved = self.resolver.usable()
        if not resolved or self.breaker.blocked():
            self._count(self.errors, BREAKER_OPEN if resolved else DNS)
            return True
        if busy >= REMOTE_FETCHERS:
            self._count(self.errors, BUSY)
            return True
        return False

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run one Redis exchange under the breaker; raise only Skipped."""
        refused = self._refused()
        if refused:
            raise Skipped(refused)
        try:
            result = fn(self._redis())
        except Exception as exc:  # a Redis failure is a miss, counted
            self._count_error(exc)
            if self.cluster and error_kind(exc) in (CONNECTION, TIMEOUT):
                with self._client_lock:  # it may hold a stale slot table: make a new one
                    stale, self._client = self._client, None
                if stale is not None:
                    with contextlib.suppress(Exception):
                        stale.close()
            self.breaker.failure()
            warn.warning("remote tier: Redis call failed (%s: %s)", type(exc).__name__, exc)
            raise Skipped(error_kind(exc)) from exc
        self.breaker.success()
        return result

    def _failed(self, exc: BaseException) -> None:
        """A failed exchange on the loop: counted, fed to the breaker, logged (rate-limited)."""
        self._count_error(exc)
        self.breaker.failure()
        warn.warning("remote tier: Redis call failed (%s: %s)", type(exc).__name__, exc)

    def doubted(self, epoch: int) -> bool:
        """Whether what was written or read since ``epoch`` may have gone to a run of
        Redis that is lost: its announcement waits for a recheck (on the loop)."""
        return epoch != self.run_epoch or self.rechecking

    # --- counters ---
    def _count_error(self, exc: BaseException) -> None:
        self._count(self.errors, error_kind(exc))

    def _count(self, table: dict[str, int], kind: str) -> None:
        with self._stats_lock:
            table[kind] = table.get(kind, 0) + 1

    def _add(self, **counts: int) -> None:
        """Add to counters that several threads update (metrics and tests read them)."""
        with self._stats_lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    @property
    def breaker_state(self) -> int:
        return self.breaker.state


# --- replies read off the socket ---
# Replies to a pipeline of GETs read straight off a redis-py connection's socket
# (Retrieve's reads, kvsvc.server.tiers.redis.fetch). hiredis appends every byte
# of a reply to its own buffer, growing it a socket read at a time, then copies
# the whole reply into a new bytes object: two copies and a fresh allocation per
# value before kvsvc copied it once more into its store. Here a reply's bytes go
# from the socket straight to where the caller wants them (a chunk reserved in
# the store), a piece at a time, so the caller checks each piece while it is
# still in cache.
#
# Only what a GET answers is understood: a bulk string (``$<n>``), a nil
# (``$-1``, RESP3's ``_``) or an error (``-``); anything else is an
# InvalidResponse, and the caller drops the connection. The connection is
# redis-py's (connected, authenticated, TLS, timeouts: its socket's), checked out
# of its pool with nothing pending (the pool checks that), and goes back only
# when every reply was read and nothing more is buffered (``Replies.clean``).

#: bytes read ahead for the short parts of replies (the ``$<n>`` lines, headers)
LINE_BUFFER_BYTES = 64 << 10
#: the longest ``$<n>`` / ``-ERR ...`` line taken before the reply is judged garbage
MAX_LINE_BYTES = 64 << 10


class Stopped(Exception):
    """The caller's stop was set while a reply was being read (not a failure)."""


class Replies:
    """The replies on one socket, in order. Every method reads what it needs and
    no more than one socket read ahead into a small buffer; the caller's buffers
    get the rest directly. ``stop`` is checked before each socket read."""

    def __init__(self, sock: Any, stop: threading.Event | None = None) -> None:
        self._sock = sock
        self._stop = stop
        self._buf = bytearray(LINE_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._lo = 0  # unread bytes are _buf[_lo:_hi]
        self._hi = 0

    @property
    def clean(self) -> bool:
        """Nothing read from the socket beyond the replies consumed."""
        return self._lo == self._hi

    def _recv(self, into: memoryview) -> int:
        if self._stop is not None and self._stop.is_set():
            raise Stopped
        got = int(self._sock.recv_into(into))
        if got <= 0:
            raise redis.ConnectionError("Connection closed by server.")
        return got

    def _fill(self, need: int) -> None:
        """At least ``need`` unread bytes in the buffer (grown if it is too small)."""
        while self._hi - self._lo < need:
            if self._lo == self._hi:
                self._lo = self._hi = 0
            elif self._lo + need > len(self._buf):  # move the unread bytes to the front
                kept = self._hi - self._lo
                if need > len(self._buf):
                    bigger = bytearray(need)
                    bigger[:kept] = self._view[self._lo : self._hi]
                    self._buf, self._view = bigger, memoryview(bigger)
                else:
                    self._buf[:kept] = self._view[self._lo : self._hi]
                self._lo, self._hi = 0, kept
            self._hi += self._recv(self._view[self._hi :])

    def length(self) -> int | None:
        """The next reply's length: a bulk string's bytes follow (then ``end``);
        None for a nil. An error reply raises ResponseError; anything else,
        InvalidResponse."""
        while (eol := self._buf.find(b"\r\n", self._lo, self._hi)) < 0:
            if self._hi - self._lo > MAX_LINE_BYTES:
                raise InvalidResponse("reply line too long")
            self._fill(self._hi - self._lo + 1)
        line = bytes(self._view[self._lo : eol])
        self._lo = eol + 2
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            try:
                n = int(rest)
            except ValueError:
                raise InvalidResponse(f"bad bulk length {rest[:32]!r}") from None
            return None if n < 0 else n
        if kind == b"_":
            return None
        if kind == b"-":
            raise redis.ResponseError(rest.decode("utf-8", "replace"))
        raise InvalidResponse(f"unexpected reply to GET {line[:32]!r}")

    def peek(self, n: int) -> memoryview:
        """The next ``n`` bytes, not consumed (valid until the next call)."""
        self._fill(n)
        return self._view[self._lo : self._lo + n]

    def skip(self, n: int) -> None:
        """Consume ``n`` bytes."""
        while n:
            if self._lo == self._hi:
                self._fill(1)
            take = min(n, self._hi - self._lo)
            self._lo += take
            n -= take

    def some(self, dst: memoryview) -> int:
        """Up to ``len(dst)`` (> 0) next bytes into ``dst``: what is buffered, else
        one socket read straight into ``dst``. Returns how many."""
        have = self._hi - self._lo
        if have:
            take = min(have, len(dst))
            dst[:take] = self._view[self._lo : self._lo + take]
            self._lo += take
            return take
        return self._recv(dst)

    def into(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` next bytes into ``dst``."""
        pos, n = 0, len(dst)
        while pos < n:
            pos += self.some(dst[pos:])

    def end(self) -> None:
        """The CRLF that ends a bulk string."""
        if self.peek(2) != b"\r\n":
            raise InvalidResponse("bulk string not ended by CRLF")
        self._lo += 2
