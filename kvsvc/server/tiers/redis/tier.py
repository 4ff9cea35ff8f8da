"""RemoteTier, the Redis tier behind the tier interface (kvsvc.server.tiers.base):
its parts (Lookup's EXISTS, Retrieve's fetch, the write-behind) put together, and
its life (start-up's credential check, close)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from typing import Any

from kvsvc.server.config import ConfigError, ServerConfig
from kvsvc.server.data.store import ChunkStore
from kvsvc.server.events import EventLog
from kvsvc.server.tiers.base import Tier
from kvsvc.server.tiers.breaker import OPEN
from kvsvc.server.tiers.redis.connection import reuse_freed_memory
from kvsvc.server.tiers.redis.fetch import Fetches
from kvsvc.server.tiers.redis.health import (
    AUTH,
    Skipped,
    Unresolved,
    caused_by,
    error_kind,
    log,
)
from kvsvc.server.tiers.redis.runs import Runs
from kvsvc.server.tiers.redis.values import redis_keys
from kvsvc.server.tiers.redis.writer import WriteBehind
from kvsvc.v1 import kv_cache_service_pb2 as pb


class RemoteTier(Runs, Fetches, WriteBehind, Tier):
    """One per server (--remote): ``present`` (Lookup), ``fetch`` (Retrieve),
    ``write_behind`` (chunks committed here). Public counters are read by
    kvsvc.server.ops.tier_metrics (RemoteStats)."""

    name = "redis"
    asked = True  # Lookup asks Redis (one pipelined EXISTS)

    def __init__(
        self,
        config: ServerConfig,
        store: ChunkStore,
        loop: asyncio.AbstractEventLoop,
        events: EventLog | None = None,
    ) -> None:
        super().__init__(config, store, loop)
        #: told of what the tier found, wrote or lost (WatchEvents)
        self.events = events

    @property
    def writing(self) -> bool:
        """Writes are skipped (counted) while the breaker is open."""
        return self.breaker.state != OPEN

    def describe(self, out: pb.TierStats) -> None:
        """What this server knows without asking Redis (its size is Redis' to say)."""
        out.writing, out.ready = self.writing, True
        out.chunks = len(self.events.remote) if self.events is not None else 0
        out.read_bytes = self.bytes_read
        out.written_chunks, out.written_bytes = self.writes, self.bytes_written
        out.queued_bytes = self.queued_bytes
        with self._stats_lock:
            out.skipped_writes.update(self.skipped)

    def collector(self) -> Any:
        from kvsvc.server.ops.tier_metrics import RemoteCollector

        return RemoteCollector(self)

    async def load(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        committed: Callable[[], None],
    ) -> None:
        await self.fetch(namespace, layout, keys, budget, committed)

    async def drop(self, namespace: str, budget: float, result: pb.DropNamespaceResult) -> None:
        """Announced keys leave the events' table first (a write that lands during
        the scan is unlinked by it or was never announced), then the SCAN."""
        if self.events is not None:
            announced = [k for k in self.events.remote if k[0] == namespace]
            for ns, key, layout in announced:
                self.events.removed(ns, (key,), layout, pb.REMOVAL_REASON_DROPPED, pb.TIER_REDIS)
        result.redis_keys, result.redis_complete = await self.drop_namespace(namespace, budget)

    def start(self, ready: Callable[[], None] | None = None) -> None:
        """Check the credentials once: refused ones are a ConfigError (they will not
        heal by themselves); an unreachable Redis is only a warning (the breaker
        and the misses handle it until it answers), and so is a host name that does
        not resolve within --remote-timeout (start-up never waits on DNS longer)."""
        if not reuse_freed_memory():
            log.info("remote tier: malloc keeps its defaults (not glibc, or mallopt refused)")
        try:
            if not self.resolver.first():
                raise Unresolved(f"{self.resolver.host} does not resolve (yet)")
            self._redis().ping()
            if not self.cluster:  # the run its first announcements belong to
                self.run_id = str(self._redis().info("server").get("run_id") or "") or None
            self.breaker.success()
            log.info("remote tier: Redis at %s answers", self.where)
        except Exception as exc:  # noqa: BLE001 - any failure here is judged below
            if error_kind(exc) == AUTH:
                raise ConfigError(
                    f"--remote {self.where}: Redis refused the credentials "
                    f"(--remote-password-file, the URL's user name): {exc}"
                ) from None
            if caused_by(exc, ssl.SSLCertVerificationError):  # will not heal
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
        self._start_writers()
        self._start_run_checks()
        if ready is not None:
            ready()

    def close(self, timeout: float = 0.0) -> None:
        """Stop the writers (queued writes are dropped and counted) and the readers."""
        self._closed = True
        self._stop_run_checks()
        self._stop_writers()
        self._stop_fetchers()
        self._close_client()

    async def aclose(self, timeout: float = 0.0) -> None:
        """close(), and the loop's connections (Lookup's), within --remote-timeout."""
        self.close()
        await self._close_lookups()

    async def drop_namespace(self, namespace: str, budget: float) -> tuple[int, bool]:
        """Unlink every Redis key of ``namespace`` (each layout, each part: a SCAN
        MATCH of its key prefix, UNLINK in batches; a cluster's every primary) on a
        thread, within ``budget`` s. Returns (keys unlinked, whether the scan ended):
        a Redis that fails or answers too slowly leaves the rest, counted."""
        head = redis_keys(self.prefix, namespace, "", [b""])[0]  # prefix:ns-hex::
        pattern = _glob_escape(head[:-1]) + b"*"  # prefix:ns-hex:<layout>:<key>[:part]
        stop = time.monotonic() + budget
        done = [0, False]

        def drop(r: Any) -> None:
            batch: list[bytes] = []
            for key in r.scan_iter(match=pattern, count=DROP_SCAN_COUNT):
                batch.append(key)
                if len(batch) >= DROP_SCAN_COUNT:
                    done[0] += int(r.unlink(*batch))
                    batch = []
                if time.monotonic() > stop:
                    return
            if batch:
                done[0] += int(r.unlink(*batch))
            done[1] = True

        def run() -> None:
            with contextlib.suppress(Skipped):  # counted, and what was done is kept
                self._call(drop)

        work = self.loop.run_in_executor(None, run)
        try:
            await asyncio.wait_for(asyncio.shield(work), max(budget, 0.0) + self.timeout)
        except TimeoutError:
            log.warning("remote tier: dropping namespace keys outlived its budget")
        return done[0], bool(done[1])


#: keys per SCAN step and per UNLINK
DROP_SCAN_COUNT = 512


def _glob_escape(text: bytes) -> bytes:
    """``text`` matched literally by Redis' glob patterns (the prefix may hold any
    character; the namespace is hex)."""
    out = bytearray()
    for b in text:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)
