"""The remote tier: chunks shared across nodes through Redis / Valkey (standalone
or Redis Cluster), behind the local store and best-effort by design.

- Writes are write-behind: a committed chunk is read-pinned and queued (bounded
  in bytes; a full queue drops the write and counts it, so a Store's reply never
  waits for Redis); writer threads build the values in a reused buffer, send
  them (pipelined, redis-py's packer that does not copy them again) and unpin
  the chunks on the event loop.
- Reads are one pipelined round trip per request for the keys missing locally
  (EXISTS for Lookup within its budget, GET for Retrieve within the call's
  deadline); verified values are copied into the local store like a Store would
  reserve and commit them, so the copy into the engine's blocks is the usual one.
  A Retrieve's replies go to that copy (native, without the GIL) in groups as
  they are read, so copying one group overlaps reading the next; commits follow
  key order and stop at the first value that fails (the prefix).
- Lookup's EXISTS runs on the server's event loop (redis.asyncio): a hop to a
  thread and back cost more than the round trip itself. GETs and SETs of large
  values stay on threads (sync redis-py was faster for them, and parsing
  megabytes on the loop would stall every other call); docs/benchmarks.md §7.
- Redis is never part of the contract: every call has socket timeouts and no
  retries, a circuit breaker stops calling a Redis that keeps failing and lets
  one probe through after a pause, and a failure is a miss and a counter —
  never an error, a hang or a health change.
- A value is self-describing: a header (magic, format version, layout
  fingerprint, the Redis key's hash, length, parts, one checksum per store
  segment) before the bytes. A value whose header or checksum does not match is
  a miss, counted, and never loaded. Values above ``--remote-value-bytes`` are
  split into parts under ``KEY:1``, ``KEY:2``, ...
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ipaddress
import logging
import math
import queue
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import hiredis
import numpy as np
import redis
import redis.asyncio as aredis
import redis.exceptions as rx
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Encoder, HiredisRespSerializer, PythonRespSerializer
from redis.retry import Retry

from kvsvc.errors import BoundedLog, CapacityExhausted
from kvsvc.server import failpoints
from kvsvc.server.config import (
    REMOTE_BREAKER_FAILURES,
    REMOTE_BREAKER_OPEN_S,
    REMOTE_DNS_REFRESH_S,
    REMOTE_FETCH_GROUP_BYTES,
    REMOTE_FETCHERS,
    REMOTE_MALLOC_KEEP_BYTES,
    REMOTE_SOCKET_READ_BYTES,
    REMOTE_WRITE_BATCH_BYTES,
    REMOTE_WRITERS,
    ConfigError,
    ServerConfig,
    redact_url,
    remote_password,
)
from kvsvc.server.data import copies
from kvsvc.server.data.copies import checksum, segments
from kvsvc.server.data.store import Chunk, ChunkStore

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # redis-py depends on async-timeout below 3.11.3
    from async_timeout import timeout as _deadline

log = logging.getLogger("kvsvc.server.tiers.redis")
_warn = BoundedLog(log, 10.0)

MAGIC = b"KVR"
#: 2: segment digests and the key hash are CRC-32C (kvsvc.server.data.copies, STORE_FORMAT 2)
FORMAT_VERSION = 2
# magic, version, fingerprint length, parts, key hash, data length, segments
_HEAD = struct.Struct("<3sBHHQQI")

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
# Why a value was refused (the label of kvsvc_remote_rejected_values).
BAD_HEADER, OTHER_LAYOUT, BAD_CHECKSUM, MISSING_PART = (
    "header",
    "layout",
    "checksum",
    "part",
)
CLOSED, OPEN, HALF_OPEN = 0, 1, 2


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, rx.AuthenticationError | rx.AuthorizationError | rx.NoPermissionError):
        return AUTH
    if _caused_by(exc, ssl.SSLError):
        return TLS
    if _caused_by(exc, socket.gaierror):
        return DNS
    if isinstance(exc, rx.TimeoutError | TimeoutError | asyncio.TimeoutError):
        return TIMEOUT
    if isinstance(exc, rx.ConnectionError | rx.ClusterError | rx.RedisClusterException | OSError):
        return CONNECTION
    if isinstance(exc, rx.ResponseError):
        text = str(exc)
        return AUTH if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")) else RESPONSE
    return OTHER


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
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


# --- values ---
def redis_key(prefix: str, namespace: str, layout: str, key: bytes) -> bytes:
    """Namespaced, binary-safe, and without '{': no accidental Redis Cluster hash tag
    pins every key to one shard (hex spreads them over all)."""
    return redis_keys(prefix, namespace, layout, [key])[0]


def redis_keys(prefix: str, namespace: str, layout: str, keys: Sequence[bytes]) -> list[bytes]:
    """redis_key of each of ``keys`` (the common part made once: Lookup's path)."""
    head = b"%s:%s:%s:" % (prefix.encode(), namespace.encode().hex().encode(), layout.encode())
    return [head + key.hex().encode() for key in keys]


def encode(
    rkey: bytes,
    layout: str,
    data: memoryview,
    digests: Sequence[int],
    part_bytes: int,
    stage: Staging | None = None,
    addr: int = 0,
) -> list[tuple[bytes, Any]]:
    """(Redis key, value) pairs of one chunk: header + first part, then the rest
    (views of ``data``, sent as they are). With ``stage``: the first value is built
    in it, its bytes copied from ``addr`` (where ``data`` starts)."""
    fp = layout.encode()
    n = len(data)
    first = max(0, part_bytes - _HEAD.size - len(fp) - 8 * len(digests))
    if first <= 0:
        raise ValueError("--remote-value-bytes is too small for the header")
    rest = [data[lo : lo + part_bytes] for lo in range(first, n, part_bytes)]
    head = b"".join(
        (
            _HEAD.pack(
                MAGIC, FORMAT_VERSION, len(fp), 1 + len(rest), checksum(rkey), n, len(digests)
            ),
            fp,
            struct.pack(f"<{len(digests)}Q", *digests),
        )
    )
    value: Any
    if stage is None:
        value = b"".join((head, data[:first]))
    else:
        value = stage.add(head, addr, min(first, n))
    return [(rkey, value)] + [(rkey + b":%d" % (i + 1), part) for i, part in enumerate(rest)]


class Staging:
    """A writer's buffer for the first value of each chunk (header + bytes), reused
    batch after batch: no allocation and no page faults per value (a fresh bytes
    object per value cost more than the copy itself), and the bytes are copied by
    memmove without the GIL (ctypes releases it)."""

    def __init__(self) -> None:
        self._array = np.empty(0, dtype=np.uint8)
        self._used = 0

    def reset(self, need: int) -> None:
        """Room for ``need`` bytes; the views handed out before are dead from now."""
        if len(self._array) < need:
            self._array = np.empty(need, dtype=np.uint8)
        self._used = 0

    def add(self, head: bytes, addr: int, n: int) -> memoryview:
        lo = self._used
        hi = lo + len(head) + n
        if hi > len(self._array):
            raise ValueError("staging buffer too small (reset with the batch's size)")
        view = self._array.data[lo:hi]
        view[: len(head)] = head
        ctypes.memmove(self._array.ctypes.data + lo + len(head), addr, n)
        self._used = hi
        return view


@dataclass
class Value:
    """A verified chunk from Redis: its bytes and the store's per-segment checksums."""

    parts: list[memoryview]
    size: int
    digests: list[int]


class Rejected(Exception):
    """A value that is not this chunk: a miss of the given kind, never loaded."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def parse_head(rkey: bytes, layout: str, raw: bytes) -> tuple[int, list[int], memoryview, int]:
    """(parts, digests, first part's data, total length) of a value's first key."""
    if len(raw) < _HEAD.size:
        raise Rejected(BAD_HEADER)
    magic, version, fp_len, parts, key_hash, n, nseg = _HEAD.unpack_from(raw)
    if magic != MAGIC or version != FORMAT_VERSION or parts < 1:
        raise Rejected(BAD_HEADER)
    pos = _HEAD.size
    if raw[pos : pos + fp_len] != layout.encode():
        raise Rejected(OTHER_LAYOUT)
    if key_hash != checksum(rkey) or nseg != len(segments(n)):
        raise Rejected(BAD_HEADER)
    pos += fp_len
    if len(raw) < pos + 8 * nseg:
        raise Rejected(BAD_HEADER)
    digests = list(struct.unpack_from(f"<{nseg}Q", raw, pos))
    return parts, digests, memoryview(raw)[pos + 8 * nseg :], n


def load_into(
    dst: memoryview, parts: list[memoryview], digests: list[int], addr: int | None = None
) -> None:
    """Copy a value's parts into ``dst`` (at address ``addr``) one store segment at
    a time, hashing each segment right after its copy (still in cache: one pass
    over the bytes, as the copy path does); Rejected if any does not match (``dst``
    is then garbage). With ``addr`` and the native copy loop: one call without
    the GIL, so a reader thread reads the next replies meanwhile."""
    if sum(len(p) for p in parts) != len(dst):
        raise Rejected(BAD_HEADER)
    native = copies.NATIVE
    if native is not None and addr is not None:
        rows, pos = [], 0
        for part in parts:
            if len(part):
                rows.append((np.frombuffer(part, dtype=np.uint8).ctypes.data, pos, len(part)))
                pos += len(part)
        runs = np.array(rows, dtype=np.uint64).reshape(-1, 3)
        got = (ctypes.c_uint32 * len(digests))()
        native.copy(runs, addr, 0, len(dst), got, to_store=True)
        if list(got) != digests:
            raise Rejected(BAD_CHECKSUM)
        return
    pi, off = 0, 0  # where in the parts the next byte comes from
    for (lo, hi), digest in zip(segments(len(dst)), digests, strict=True):
        pos = lo
        while pos < hi:
            part = parts[pi]
            take = min(hi - pos, len(part) - off)
            dst[pos : pos + take] = part[off : off + take]
            pos += take
            off += take
            if off == len(part):
                pi, off = pi + 1, 0
        if checksum(dst[lo:hi]) != digest:
            raise Rejected(BAD_CHECKSUM)


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


# --- the breaker ---
class Breaker:
    """Closed → open after REMOTE_BREAKER_FAILURES failures in a row; open → one probe
    call after REMOTE_BREAKER_OPEN_S; the probe's outcome closes or reopens it."""

    def __init__(self, failures: int, open_s: float) -> None:
        self.failures = failures
        self.open_s = open_s
        self.state = CLOSED
        self._fails = 0
        self._opened = 0.0
        self._probing = False
        self._lock = threading.Lock()
        self.opened_total = 0

    def allow(self) -> bool:
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and time.monotonic() - self._opened >= self.open_s:
                self.state = HALF_OPEN
            if self.state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def blocked(self) -> bool:
        """Whether a call now would be refused (without taking the probe's turn)."""
        with self._lock:
            if self.state == CLOSED:
                return False
            if self.state == OPEN:
                return time.monotonic() - self._opened < self.open_s
            return self._probing

    def success(self) -> None:
        with self._lock:
            if self.state != CLOSED:
                log.warning("remote tier: Redis answers again; breaker closed")
            self.state, self._fails, self._probing = CLOSED, 0, False

    def failure(self) -> None:
        with self._lock:
            self._fails += 1
            self._probing = False
            if self.state == HALF_OPEN or (self.state == CLOSED and self._fails >= self.failures):
                if self.state == CLOSED:
                    log.warning(
                        "remote tier: %d Redis failures in a row; breaker open, probing "
                        "every %g s (remote reads are misses, writes are dropped)",
                        self._fails,
                        self.open_s,
                    )
                    self.opened_total += 1
                self.state = OPEN
                self._opened = time.monotonic()


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
            _warn.warning("remote tier: cannot resolve %s (%s)", self.host, exc)
            ok = False
        with self._lock:
            self._ok, self._ended, self._since = ok, time.monotonic(), None
        self._answered.set()


@dataclass
class _Write:
    namespace: str
    key: bytes
    layout: str
    chunk: Chunk


class RemoteTier:
    """One per server. Public counters are read by kvsvc.server.metrics (RemoteStats)."""

    def __init__(
        self, config: ServerConfig, store: ChunkStore, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.url = config.remote
        self.where = redact_url(config.remote)
        self.prefix = config.remote_prefix
        self.timeout = config.remote_timeout
        self.lookup_budget = config.remote_lookup_budget
        self.ttl = config.remote_ttl
        self.part_bytes = config.remote_value_bytes
        self.store = store
        self.loop = loop
        # Pinned chunks block eviction: at most a quarter of the store waits for Redis.
        self.queue_limit = min(config.remote_queue_bytes, store.capacity // 4)
        self.breaker = Breaker(REMOTE_BREAKER_FAILURES, REMOTE_BREAKER_OPEN_S)
        self.resolver = Resolver(config.remote, config.remote_timeout)
        self.cluster = "+cluster" in config.remote.split("://", 1)[0]
        self.tls_ca, self.tls_cert, self.tls_key = (
            config.remote_tls_ca,
            config.remote_tls_cert,
            config.remote_tls_key,
        )
        self._password = remote_password(config)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._aclient: Any = None  # used on the loop only
        self._links: list[_Link] = []  # Lookup's idle connections (standalone Redis)
        self._asking = 0  # asyncio exchanges in flight
        # counters (kvsvc.server.metrics reads them; updated under _stats_lock off the loop)
        self._stats_lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.writes = 0
        self.dropped_writes = 0
        self.errors: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.queued_bytes = 0
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self._queued_lock = threading.Lock()
        self._fetching = 0
        self._fetchers = concurrent.futures.ThreadPoolExecutor(
            REMOTE_FETCHERS, thread_name_prefix="kvsvc-remote-read"
        )
        self._writers = [
            threading.Thread(target=self._write_loop, name=f"kvsvc-remote-write-{i}", daemon=True)
            for i in range(REMOTE_WRITERS)
        ]
        self._closed = False

    # --- life ---
    def start(self) -> None:
        """Check the credentials once: refused ones are a ConfigError (they will not
        heal by themselves); an unreachable Redis is only a warning (the breaker
        and the misses handle it until it answers), and so is a host name that does
        not resolve within --remote-timeout (start-up never waits on DNS longer)."""
        if not reuse_freed_memory():
            log.info("remote tier: malloc keeps its defaults (not glibc, or mallopt refused)")
        try:
            if not self.resolver.first():
                raise _Unresolved(f"{self.resolver.host} does not resolve (yet)")
            self._redis().ping()
            self.breaker.success()
            log.info("remote tier: Redis at %s answers", self.where)
        except Exception as exc:  # noqa: BLE001 - any failure here is judged below
            if error_kind(exc) == AUTH:
                raise ConfigError(
                    f"--remote {self.where}: Redis refused the credentials "
                    f"(--remote-password-file, the URL's user name): {exc}"
                ) from None
            if _caused_by(exc, ssl.SSLCertVerificationError):  # will not heal
                raise ConfigError(
                    f"--remote {self.where}: Redis' TLS certificate did not verify "
                    f"(--remote-tls-ca, the host name in the URL): {exc.__context__ or exc}"
                ) from None
            log.warning(
                "remote tier: Redis at %s does not answer at start-up (%s: %s); serving "
                "from the local store, remote reads are misses until it answers",
                self.where,
                type(exc).__name__,
                exc,
            )
            self._count_error(exc)
        for t in self._writers:
            t.start()

    def close(self) -> None:
        """Stop the writers (queued writes are dropped and counted) and the readers."""
        self._closed = True
        for _ in self._writers:
            self._queue.put(None)
        for t in self._writers:
            t.join(self.timeout * 4 + 1)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            if self._client is not None:
                self._client.close()

    async def aclose(self) -> None:
        """close(), and the loop's connections (Lookup's), within --remote-timeout."""
        self.close()
        client, self._aclient = self._aclient, None
        links, self._links = self._links, []
        for link in links:
            link.close()
        if client is not None:
            try:
                await asyncio.wait_for(client.aclose(), self.timeout)
            except Exception as exc:  # noqa: BLE001 - closing: the sockets go anyway
                log.debug("remote tier: closing the asyncio client: %s", exc)

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

    def _refused(self) -> str | None:
        """Why no call may go to Redis now (counted), or None."""
        if not self.resolver.usable():
            self._count(self.errors, DNS)
            return DNS
        if self._closed or not self.breaker.allow():
            self._count(self.errors, BREAKER_OPEN)
            return BREAKER_OPEN
        return None

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run one Redis exchange under the breaker; raise only _Skipped."""
        refused = self._refused()
        if refused:
            raise _Skipped(refused)
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
            _warn.warning("remote tier: Redis call failed (%s: %s)", type(exc).__name__, exc)
            raise _Skipped(error_kind(exc)) from exc
        self.breaker.success()
        return result

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

    # --- writes ---
    def write_behind(self, namespace: str, layout: str, chunks: list[Chunk]) -> None:
        """On the loop, after a Store committed ``chunks``: pin and queue each, or
        drop and count it when the queue is full. Never waits."""
        for chunk in chunks:
            with self._queued_lock:
                take = not self._closed and self.queued_bytes + chunk.size <= self.queue_limit
                if take:
                    self.queued_bytes += chunk.size
            if not take:
                self._add(dropped_writes=1)
                continue
            chunk.readers += 1  # the store frees nothing a writer still reads
            self._queue.put(_Write(namespace, chunk.key[1], layout, chunk))

    def _write_loop(self) -> None:
        stage = Staging()
        while True:
            batch = [self._queue.get()]
            size = batch[0].chunk.size if batch[0] is not None else 0
            while batch[-1] is not None and size < REMOTE_WRITE_BATCH_BYTES:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
                size += item.chunk.size if item is not None else 0
            writes = [w for w in batch if w is not None]
            try:
                self._write(writes, stage)
            finally:
                with self._queued_lock:
                    self.queued_bytes -= sum(w.chunk.size for w in writes)
                self._unpin([w.chunk for w in writes])
            if len(writes) < len(batch):
                return

    def _write(self, writes: list[_Write], stage: Staging) -> None:
        """One pipeline of SETs for a batch of chunks (their values built in ``stage``)."""
        if self._closed:
            self._add(dropped_writes=len(writes))
            return
        # Each chunk's first value: header + bytes, at most part_bytes.
        stage.reset(
            sum(
                min(
                    self.part_bytes,
                    _HEAD.size + len(w.layout.encode()) + 8 * len(w.chunk.digests) + w.chunk.size,
                )
                for w in writes
            )
        )
        pairs: list[tuple[bytes, Any]] = []
        for w in writes:
            buf = self.store.buffer(w.chunk)
            rkey = redis_key(self.prefix, w.namespace, w.layout, w.key)
            pairs += encode(
                rkey, w.layout, buf.view, w.chunk.digests, self.part_bytes, stage, buf.addr
            )

        def send(r: Any) -> None:
            pipe = r.pipeline(transaction=False)
            for k, v in pairs:
                pipe.set(k, v, ex=self.ttl or None)
            pipe.execute()

        try:
            self._call(send)
        except _Skipped:
            self._add(dropped_writes=len(writes))
            return
        self._add(writes=len(writes), bytes_written=sum(w.chunk.size for w in writes))

    def _unpin(self, chunks: list[Chunk]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the store goes with it
            self.loop.call_soon_threadsafe(self.store.release, chunks)

    # --- reads ---
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

    def _submit(self, fn: Callable[[Any], Any]) -> asyncio.Future[Any] | None:
        """Run an exchange on a reader thread; None (busy, counted) when every reader
        is still waiting on Redis, so a stuck Redis never queues up requests."""
        if self._turned_away(self._fetching):
            return None

        def run() -> Any:
            try:
                return self._call(fn)
            finally:
                self.loop.call_soon_threadsafe(self._done_fetching)

        self._fetching += 1
        try:
            return asyncio.wrap_future(self._fetchers.submit(run), loop=self.loop)
        except RuntimeError:  # shut down
            self._fetching -= 1
            return None

    def _done_fetching(self) -> None:
        self._fetching -= 1

    async def present(self, namespace: str, layout: str, keys: list[bytes]) -> list[bool]:
        """Whether Redis holds each of ``keys`` (Lookup; values are verified when
        Retrieve fetches them); [] when it cannot say within the budget. One
        pipelined EXISTS round trip, on the loop."""
        rkeys = redis_keys(self.prefix, namespace, layout, keys)
        found = await self._ask(rkeys, self.lookup_budget)
        return [] if found is None else [bool(f) for f in found]

    async def _ask(self, rkeys: list[bytes], budget: float) -> list[int] | None:
        """EXISTS of each key, or None: skipped, failed or over budget. The exchange
        is bounded by --remote-timeout; past the budget the caller goes on and the
        exchange ends by itself (its outcome still feeds the breaker), so a
        cut-off read never leaves a connection mid-reply. On an idle link
        (standalone Redis) it is a write and a callback (``_exchange``); otherwise
        (connecting, Redis Cluster) a task."""
        if self._turned_away(self._asking):
            return None
        link = self._idle_link()
        if link is not None:
            if self._refused():
                self._links.append(link)
                return None
            return await self._exchange(link, rkeys, budget)
        self._asking += 1
        task = self.loop.create_task(self._acall(rkeys))
        # A bare future woken by the task or the budget's timer: what wait_for does,
        # without shield's and timeout's extra futures and cancellation (about 20 µs
        # of a 0.3 ms exchange on the benchmark host).
        woken = self.loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        task.add_done_callback(self._done_asking)
        task.add_done_callback(wake)
        timer = self.loop.call_later(max(budget, 0.0), wake)
        try:
            await woken
        finally:  # also when the call is cancelled: the task ends by itself
            timer.cancel()
            if not task.done():
                task.add_done_callback(_consume)
        if not task.done():
            self._count(self.errors, "budget")
            return None
        if task.cancelled() or task.exception() is not None:  # _Skipped: counted
            return None
        return task.result()

    def _done_asking(self, _task: asyncio.Task[list[int]]) -> None:
        self._asking -= 1

    def _idle_link(self) -> _Link | None:
        while self._links:
            link = self._links.pop()
            if not link.closed:
                return link
        return None

    async def _exchange(self, link: _Link, rkeys: list[bytes], budget: float) -> list[int] | None:
        """One EXISTS round trip on an idle link, in the caller's task: one future and
        one timer (the budget's, then the rest of --remote-timeout's); the link's
        callback ends it, whether or not the caller still waits."""
        loop = self.loop
        self._asking += 1
        waiter: asyncio.Future[list[int] | None] = loop.create_future()
        start = loop.time()
        timer: asyncio.TimerHandle | None = None

        def end(outcome: list[Any] | BaseException) -> None:
            if timer is not None:
                timer.cancel()
            self._asking -= 1
            found: list[int] | None = None
            try:
                found = _checked(outcome)
            except Exception as exc:  # noqa: BLE001 - a Redis failure is a miss, counted
                link.close()
                self._failed(exc)
            else:
                self.breaker.success()
                self._links.append(link)
            if not waiter.done():
                waiter.set_result(found)

        def over() -> None:
            link.fail(rx.TimeoutError(f"Timeout reading from {self.where}"))

        def late() -> None:
            nonlocal timer
            timer = loop.call_at(start + self.timeout, over)
            if not waiter.done():
                self._count(self.errors, "budget")
                waiter.set_result(None)

        if budget < self.timeout:
            timer = loop.call_at(start + max(budget, 0.0), late)
        else:
            timer = loop.call_at(start + self.timeout, over)
        link.send([("EXISTS", k) for k in rkeys], end)
        return await waiter  # cancelled: the exchange ends by itself

    def _failed(self, exc: BaseException) -> None:
        """A failed exchange on the loop: counted, fed to the breaker, logged (rate-limited)."""
        self._count_error(exc)
        self.breaker.failure()
        _warn.warning("remote tier: Redis call failed (%s: %s)", type(exc).__name__, exc)

    async def _link(self) -> _Link:
        """A new link, connected and authenticated as redis-py would (its reading of
        the URL and TLS settings; AUTH, SELECT); the caller bounds it."""
        conn = self._aredis().connection_pool.make_connection()
        ssl_context = conn.ssl_context.get() if isinstance(conn, aredis.SSLConnection) else None
        link = _Link()
        await self.loop.create_connection(
            lambda: link,
            conn.host,
            conn.port,
            ssl=ssl_context,
            server_hostname=conn.host if ssl_context is not None else None,
        )
        hello: list[tuple[Any, ...]] = []
        if conn.password:
            auth = (conn.username, conn.password) if conn.username else (conn.password,)
            hello.append(("AUTH", *auth))
        if conn.db:
            hello.append(("SELECT", conn.db))
        try:
            if hello:
                _checked(await link.roundtrip(hello))
        except BaseException:
            link.close()
            raise
        return link

    async def _acall(self, rkeys: list[bytes]) -> list[int]:
        """The asyncio twin of _call for EXISTS: the breaker, one deadline of
        --remote-timeout for connect, send and reply together; raises only _Skipped."""
        refused = self._refused()
        if refused:
            raise _Skipped(refused)
        try:
            async with _deadline(self.timeout):
                found = await self._exists(self._aredis(), rkeys)
        except Exception as exc:  # a Redis failure is a miss, counted
            self._failed(exc)
            if self.cluster and error_kind(exc) in (CONNECTION, TIMEOUT):
                stale, self._aclient = self._aclient, None  # maybe a stale slot table
                if stale is not None:
                    with contextlib.suppress(Exception):
                        await stale.aclose()
            raise _Skipped(error_kind(exc)) from exc
        self.breaker.success()
        return found

    async def _exists(self, r: Any, rkeys: list[bytes]) -> list[int]:
        """One pipelined EXISTS round trip (in a task, bounded by its caller).
        Standalone: on a link (a new one when none is idle), kept once it answered;
        a failed or cut-off one is closed, never reused mid-reply."""
        if self.cluster:  # keys on every shard: redis-py groups them by node
            pipe = r.pipeline(transaction=False)
            for k in rkeys:
                pipe.exists(k)
            return list(await pipe.execute())
        link = self._idle_link() or await self._link()
        try:
            found = _checked(await link.roundtrip([("EXISTS", k) for k in rkeys]))
        except BaseException:
            link.close()
            raise
        self._links.append(link)
        return found

    async def fetch(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        on_commit: Callable[[], None] | None = None,
    ) -> int:
        """Bring ``keys`` missing from the local store, verified, from Redis into it up
        to the first miss (reserved as a Store reserves; a refused reservation is a
        miss). Returns how many were loaded. One pipelined GET round trip (and one
        more for the parts of values split above --remote-value-bytes); the replies
        are copied in by groups of about REMOTE_FETCH_GROUP_BYTES as they arrive, so
        the copy of one group overlaps the reading of the next. ``on_commit`` is
        called on the loop each time more leading keys were committed (a Retrieve
        starts copying them into the engine's blocks then)."""
        keys = [k for k in keys if self.store.get(namespace, k, layout) is None]
        if not keys:
            return 0
        started = time.monotonic()
        rkeys = redis_keys(self.prefix, namespace, layout, keys)
        run = _Fetch(self, namespace, layout, keys, on_commit)
        fut = self._submit(lambda r: self._stream(r, rkeys, layout, run.deliver, run.stop))
        if fut is None:
            self.misses += len(keys)
            return 0
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(budget, 0.0))
        except asyncio.TimeoutError:  # what arrived in time is kept; the rest is not read
            self._count(self.errors, "budget")
            fut.add_done_callback(_consume)
        except _Skipped:  # failed (counted): what arrived before the failure is kept
            pass
        finally:
            run.close()
        read = time.monotonic()
        good = await run.settled()
        self.misses += len(keys) - good
        self.hits += good
        self.bytes_read += run.loaded_bytes
        log.debug(
            "remote tier: %d chunks fetched in %.1f ms (replies read in %.1f ms)",
            good,
            1e3 * (time.monotonic() - started),
            1e3 * (read - started),
        )
        return good

    def _copy_in(self, pairs: list[tuple[Chunk, Value]]) -> list[bool]:
        """Copy and verify each fetched value into its reserved chunk: whether it
        matched; stops at the first that does not (the prefix ends there)."""
        out = []
        for chunk, value in pairs:
            try:
                buf = self.store.buffer(chunk)
                load_into(buf.view, value.parts, value.digests, buf.addr)
                out.append(True)
            except Rejected as exc:
                self._count(self.rejected, exc.kind)
                break
        return out

    def _stream(
        self,
        r: Any,
        rkeys: list[bytes],
        layout: str,
        deliver: Callable[[list[Value]], None],
        stop: threading.Event,
    ) -> None:
        """On a reader thread: one pipelined GET of every key; each group of about
        REMOTE_FETCH_GROUP_BYTES of leading values whose header matches goes to
        ``deliver`` as soon as its replies are read. Stops at the first miss or
        refused value, or when ``stop`` is set (the caller's budget is spent); a
        connection left with replies unread is closed, never reused mid-reply.
        Redis Cluster (keys on every shard) and split values: redis-py pipelines,
        then one group."""
        if self.cluster:
            deliver(self._get_values(r, rkeys, layout))
            return
        pool = r.connection_pool
        conn = pool.get_connection()
        read = 0
        group: list[Value] = []
        size = 0
        split: list[Any] = []  # from the first split value on: the replies, unparsed
        try:
            conn.send_packed_command(conn.pack_commands([("GET", k) for k in rkeys]))
            for rkey in rkeys:
                if stop.is_set():
                    break
                raw = conn.read_response()
                read += 1
                if raw is None:
                    break
                try:
                    nparts, digests, first, n = parse_head(rkey, layout, raw)
                except Rejected as exc:
                    self._count(self.rejected, exc.kind)
                    break
                if nparts > 1:  # the rest as before: parts in one more round trip
                    split = [raw] + [conn.read_response() for _ in rkeys[read:]]
                    read = len(rkeys)
                    break
                if len(first) != n:
                    self._count(self.rejected, BAD_HEADER)
                    break
                group.append(Value([first], n, digests))
                size += n
                if size >= REMOTE_FETCH_GROUP_BYTES:
                    deliver(group)
                    group, size = [], 0
        finally:
            if read < len(rkeys):
                conn.disconnect()
            pool.release(conn)
        deliver(group)
        if split and not stop.is_set():
            deliver(self._values(r, rkeys[len(rkeys) - len(split) :], split, layout))

    def _get_values(self, r: Any, rkeys: list[bytes], layout: str) -> list[Value]:
        """GET the first key of each value (pipelined), then the parts of split ones."""
        pipe = r.pipeline(transaction=False)
        for k in rkeys:
            pipe.get(k)
        return self._values(r, rkeys, pipe.execute(), layout)

    def _values(self, r: Any, rkeys: list[bytes], raws: list[Any], layout: str) -> list[Value]:
        """The leading values of ``raws`` (replies to GET ``rkeys``) whose header
        matches and whose parts are all there, the parts fetched in one pipelined
        round trip (their checksums are checked as they are copied in)."""
        heads: list[tuple[int, list[int], memoryview, int]] = []
        for rkey, raw in zip(rkeys, raws, strict=True):
            if raw is None:
                break
            try:
                heads.append(parse_head(rkey, layout, raw))
            except Rejected as exc:
                self._count(self.rejected, exc.kind)
                break
        extra = [(i, p) for i, h in enumerate(heads) for p in range(1, h[0])]
        more: dict[tuple[int, int], Any] = {}
        if extra:
            pipe = r.pipeline(transaction=False)
            for i, p in extra:
                pipe.get(rkeys[i] + b":%d" % p)
            more = dict(zip(extra, pipe.execute(), strict=True))
        out: list[Value] = []
        for i, (nparts, digests, first, n) in enumerate(heads):
            parts = [first] + [more[(i, p)] for p in range(1, nparts)]
            if any(p is None for p in parts):
                self._count(self.rejected, MISSING_PART)
                break
            views = [memoryview(p) for p in parts]
            if sum(len(v) for v in views) != n:
                self._count(self.rejected, BAD_HEADER)
                break
            out.append(Value(views, n, digests))
        return out

    # --- what metrics read ---
    @property
    def breaker_state(self) -> int:
        return self.breaker.state

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()


class _Fetch:
    """One fetch's groups of values, on the loop: each group is reserved and copied
    in (on the default executor) as it arrives; chunks are committed in key order
    up to the first value that fails (the prefix) and the rest freed, whatever the
    caller does meanwhile. Committed chunks stay read-pinned until the fetch ends,
    so a later group's reservation cannot evict an earlier one."""

    def __init__(
        self,
        tier: RemoteTier,
        namespace: str,
        layout: str,
        keys: list[bytes],
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        self.tier, self.namespace, self.layout, self.keys = tier, namespace, layout, keys
        self.on_commit = on_commit
        self.stop = threading.Event()  # set: the reader reads no more replies
        self.good = 0  # leading keys loaded (or committed meanwhile by another call)
        self.loaded_bytes = 0
        self._arrived = 0  # values delivered so far
        # (values, indexes of those to copy, their (chunk, value), the copy)
        self._groups: list[
            tuple[int, list[int], list[tuple[Chunk, Value]], asyncio.Future[Any]]
        ] = []
        self._pinned: list[Chunk] = []
        self._ended = False  # the prefix ended: later values are dropped
        self._closed = False  # the exchange is over (or the caller stopped waiting)
        self._done: asyncio.Future[int] = tier.loop.create_future()

    def deliver(self, values: list[Value]) -> None:
        """From the reader thread: the next values, in key order."""
        if values:
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing to load into
                self.tier.loop.call_soon_threadsafe(self._arrive, values)

    def _arrive(self, values: list[Value]) -> None:
        first = self._arrived
        self._arrived += len(values)
        if self._ended or self._closed:
            return
        store = self.tier.store
        keys = self.keys[first : first + len(values)]
        todo = [j for j, k in enumerate(keys) if store.get(self.namespace, k, self.layout) is None]
        try:
            chunks, _ = (
                store.reserve(
                    self.namespace, [(keys[j], values[j].size) for j in todo], self.layout
                )
                if todo
                else ([], 0)
            )
        except CapacityExhausted as exc:  # no room now: the prefix ends here
            self.tier._count(self.tier.errors, "capacity")
            _warn.warning("remote tier: no room in the local store for fetched chunks: %s", exc)
            self._end()
            return
        pairs = [(c, values[j]) for c, j in zip(chunks, todo, strict=True)]
        copy: asyncio.Future[Any]
        if pairs:  # not on the reader threads: they may all be waiting on a slow Redis
            copy = self.tier.loop.run_in_executor(None, self.tier._copy_in, pairs)
        else:
            copy = self.tier.loop.create_future()
            copy.set_result([])
        self._groups.append((len(values), todo, pairs, copy))
        copy.add_done_callback(lambda _: self._settle())

    def _end(self) -> None:
        self._ended = True
        self.stop.set()

    def _settle(self) -> None:
        """Commit (or free) the groups whose copies ended, in key order."""
        store = self.tier.store
        good = self.good
        while self._groups and self._groups[0][3].done():
            count, todo, pairs, copy = self._groups.pop(0)
            verified: list[bool] = []
            if not copy.cancelled():
                if copy.exception() is None:
                    verified = copy.result()
                else:  # a failed copy-in is a miss
                    exc = copy.exception()
                    log.error("remote tier: copying fetched chunks in failed", exc_info=exc)
            slot = {j: pos for pos, j in enumerate(todo)}
            for j in range(count):
                pos = slot.get(j)
                if pos is None:  # committed meanwhile by another call: kept
                    self.good += not self._ended
                    continue
                chunk, value = pairs[pos]
                if self._ended or pos >= len(verified) or not verified[pos]:
                    store.abort(chunk)
                    self._end()
                    continue
                if store.commit(chunk, value.digests):
                    chunk.readers += 1
                    self._pinned.append(chunk)
                    self.loaded_bytes += value.size
                self.good += 1
        if self.good > good and self.on_commit is not None:
            self.on_commit()
        self._finish_if_over()

    def _finish_if_over(self) -> None:
        if self._closed and not self._groups and not self._done.done():
            self.tier.store.release(self._pinned)
            self._done.set_result(self.good)

    def close(self) -> None:
        """The exchange is over: no more values are taken."""
        self._closed = True
        self.stop.set()
        self._finish_if_over()

    async def settled(self) -> int:
        """Leading keys loaded, once every group is committed or freed."""
        return await asyncio.shield(self._done)


#: redis-py's packer for Lookup's commands (hiredis packs; keys are small)
_PACKER = HiredisRespSerializer()


class _Link(asyncio.Protocol):
    """One connection the tier keeps for Lookup's EXISTS (standalone Redis): the
    commands packed by redis-py's packer, the replies parsed by hiredis' reader as
    the bytes arrive, on the loop. An exchange is a write and a callback: no task,
    no stream reader, no await per reply (they cost about as much as the round
    trip itself; docs/benchmarks.md section 7). One exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reader = hiredis.Reader(protocolError=rx.InvalidResponse, replyError=rx.ResponseError)
        self._replies: list[Any] = []
        self._want = 0
        self._on_end: Callable[[list[Any] | BaseException], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(
        self, commands: list[tuple[Any, ...]], on_end: Callable[[list[Any] | BaseException], None]
    ) -> None:
        """Write ``commands``; ``on_end`` gets every reply, or the failure, once."""
        assert self.transport is not None and self._on_end is None
        self._replies, self._want, self._on_end = [], len(commands), on_end
        self.transport.writelines([part for c in commands for part in _PACKER.pack(*c)])

    async def roundtrip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``send`` and wait (a task's exchange; cut off: the link is closed)."""
        done: asyncio.Future[list[Any] | BaseException] = asyncio.get_running_loop().create_future()

        def end(outcome: list[Any] | BaseException) -> None:
            if not done.done():
                done.set_result(outcome)

        self.send(commands, end)
        try:
            outcome = await done
        except BaseException:
            self.close()
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def data_received(self, data: bytes) -> None:
        if self._on_end is None:
            self.fail(rx.InvalidResponse("a reply nobody asked for"))
            return
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                self._replies.append(reply)
        except rx.InvalidResponse as exc:
            self.fail(exc)
            return
        if len(self._replies) >= self._want:
            self._end(self._replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._end(rx.ConnectionError(f"Redis closed the connection ({exc or 'EOF'})"))

    def _end(self, outcome: list[Any] | BaseException) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(outcome)

    def fail(self, exc: BaseException) -> None:
        """End the exchange with ``exc`` and close the link (never reused mid-reply)."""
        self.close()
        self._end(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _checked(outcome: list[Any] | BaseException) -> list[Any]:
    """The replies of an exchange, or its failure (an error reply too) raised as
    redis-py would raise it."""
    if isinstance(outcome, BaseException):
        raise outcome
    for reply in outcome:
        if isinstance(reply, rx.ResponseError):
            message = str(reply)
            if message.startswith(("WRONGPASS", "NOAUTH", "invalid password")):
                raise rx.AuthenticationError(message)
            if message.startswith("NOPERM"):
                raise rx.NoPermissionError(message)
            raise reply
    return outcome


class _Unresolved(socket.gaierror):
    """--remote's host name has no answer from DNS (or none in time)."""


class _Skipped(Exception):
    """A Redis exchange that did not happen or failed (already counted)."""


def _consume(fut: asyncio.Future[Any]) -> None:
    """Read a dropped exchange's outcome so asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()
