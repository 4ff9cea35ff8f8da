"""MooncakeTier, the Mooncake Store tier behind the tier interface
(kvsvc.server.tiers.base): Lookup's answer (what this server wrote or read, else
one bounded ``batch_is_exist``), Retrieve's reads (reads), the write-behind
(writer), DropNamespace by a key pattern, and its life (start, close)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvsvc.server.config import ServerConfig
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.events import EventLog
from kvsvc.server.tiers.base import Tier
from kvsvc.server.tiers.breaker import OPEN
from kvsvc.server.tiers.mooncake.client import FAILURES, Connection, Failed, code_kind, log, warn
from kvsvc.server.tiers.mooncake.gate import Gate
from kvsvc.server.tiers.mooncake.reads import Reads
from kvsvc.server.tiers.mooncake.values import drop_pattern, key_name
from kvsvc.server.tiers.mooncake.writer import Known, Writer, version
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: keys one Lookup asks Mooncake about at most (one batch_is_exist)
ASK_MAX = 64
#: a stop closes Mooncake's client only if no call failed this long before it
#: (close() with a dead master holds the GIL ~17 s: the client is left open then)
QUIET_S = 30.0


class MooncakeTier(Tier):
    """One per server (--mooncake-master). Counters live on ``gate`` (metrics)."""

    name = "mooncake"
    asked = True  # Lookup asks the master for keys this server has not seen

    def __init__(
        self,
        config: ServerConfig,
        store: ChunkStore,
        loop: asyncio.AbstractEventLoop,
        events: EventLog | None = None,
    ) -> None:
        t = config.tiers
        self.store = store
        self.loop = loop
        self.prefix = t.mooncake_prefix.strip("/")
        self.lookup_budget = t.mooncake_lookup_budget
        self.connection = Connection(config, store)
        self.gate = Gate(config, self.connection, loop)
        self.known = Known(events)
        self.reads = Reads(self.gate, store, self.prefix)
        self.writer = Writer(
            self.gate, store, loop, self.known, self.prefix, t.mooncake_queue_bytes
        )
        self._connecting: asyncio.Future[None] | None = None

    # --- life ---
    def start(self, ready: Callable[[], None]) -> None:
        """Missing settings or the missing extra are a ConfigError; a master that
        does not answer, a warning (misses and the breaker until it does). The
        client is set up on a Mooncake thread: the start never waits for it."""
        self.connection.check()
        self._connecting = asyncio.ensure_future(self._connect(), loop=self.loop)
        self.writer.start()
        ready()

    async def _connect(self) -> None:
        g = self.gate
        try:
            await g.run(lambda client: None, g.timeout)
        except Failed as exc:
            log.warning(
                "mooncake tier: master %s not ready at start-up (%s); Mooncake reads are "
                "misses until it is",
                self.connection.master,
                exc.kind,
            )

    def close(self, timeout: float = 0.0) -> None:
        """Stop the writer (queued writes are skipped and counted), the threads,
        then Mooncake's client, each waited a bounded time."""
        wait = max(min(timeout, self.gate.timeout + 1.0), 0.5)
        self.gate.stop()
        self.writer.stop(wait)
        # A call still inside Mooncake writes into the store's memory or uses the
        # client: closing under it would crash the process. Past the wait, the
        # client is left open to the process's exit.
        if self.gate.idle(wait):
            self.connection.close(wait, answering=self.gate.answering(QUIET_S))
        else:
            self.connection.close(wait, answering=False)

    async def aclose(self, timeout: float) -> None:
        await self.loop.run_in_executor(None, self.close, timeout)

    # --- what it says of itself ---
    @property
    def writing(self) -> bool:
        """Writes are skipped (counted) while the breaker is open."""
        return self.gate.breaker.state != OPEN

    def describe(self, out: pb.TierStats) -> None:
        """What this server knows without asking Mooncake."""
        g = self.gate
        out.writing, out.ready = self.writing, self.connection.client is not None
        out.chunks = len(self.known.versions)
        with g.lock:
            out.read_bytes = g.bytes_read
            out.written_chunks, out.written_bytes = g.writes, g.bytes_written
            out.skipped_writes.update(g.skipped)
            if g.dropped_values:
                out.removed_chunks["dropped"] = g.dropped_values
        out.queued_bytes = self.writer.queued_bytes

    def collector(self) -> Any:
        from kvsvc.server.tiers.mooncake.metrics import MooncakeCollector

        return MooncakeCollector(self.gate, self.writer, self.known)

    # --- Lookup ---
    async def present(self, namespace: str, layout: str, keys: list[bytes]) -> list[bool]:
        """Whether Mooncake holds each of the leading ``keys`` (a hint: Mooncake
        evicts on its own): those this server wrote or read at once, then one
        ``batch_is_exist`` within the Lookup budget."""
        out: list[bool] = []
        for key in keys:
            if (namespace, key, layout) not in self.known.versions:
                break
            out.append(True)
        rest = keys[len(out) : len(out) + ASK_MAX]
        if not rest:
            return out
        names = [key_name(self.prefix, namespace, layout, k) for k in rest]
        try:
            codes = await self.gate.run(lambda c: _exist(c, names), self.lookup_budget)
        except Failed:
            return out
        for rc in codes:
            if rc != 1:
                if rc < 0:
                    self.gate.count(self.gate.errors, code_kind(rc))
                break
            out.append(True)
        return out

    # --- Retrieve ---
    async def load(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        committed: Callable[[], None],
    ) -> None:
        # Shielded: a Retrieve cancelled meanwhile must not leave chunks reserved
        # while Mooncake still writes into them; the load ends (within its budget)
        # and what it committed is released then.
        work = asyncio.ensure_future(
            self.reads.load(namespace, layout, keys, budget, self.known.stale)
        )
        try:
            loaded = await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(self._release)
            raise
        if loaded:
            for chunk in loaded:
                self.known.remember(chunk.key, version(chunk), chunk.size)
            try:
                committed()  # the caller pins its prefix while these are pinned here
            finally:
                self.store.release(loaded)

    def _release(self, work: asyncio.Future[list[Chunk]]) -> None:
        if not work.cancelled() and work.exception() is None:
            self.store.release(work.result())

    # --- writes ---
    def write_behind(self, chunk: Chunk) -> None:
        self.writer.put(chunk)

    # --- DropNamespace ---
    async def drop(self, namespace: str, budget: float, result: pb.DropNamespaceResult) -> None:
        """Remove every value under the namespace's keys (every server's: one
        ``remove_by_regex``, forced past Mooncake's read leases) within
        ``budget`` s; what a failing or slow master leaves is counted. A write in
        flight meanwhile removes its own value once put (its chunk is discarded).
        ``mooncake_values`` is the master's count of values removed (it says no
        bytes); ``mooncake_complete`` False where it failed or was given up on."""
        g = self.gate
        self.known.forget_namespace(namespace)
        pattern = drop_pattern(self.prefix, namespace)

        def remove(client: Any) -> int:
            n = int(client.remove_by_regex(pattern, True))
            if n < 0 and code_kind(n) in FAILURES:
                raise Failed(code_kind(n))
            return n

        try:
            n = await g.run(remove, max(budget, 0.0), capped=False)
        except Failed:
            n = -1
        result.mooncake_values, result.mooncake_complete = max(n, 0), n >= 0
        if n >= 0:
            g.add(dropped_values=n)
            log.debug("mooncake tier: %d values of a dropped namespace removed", n)
            return
        g.count(g.errors, "drop_incomplete")
        warn.warning("mooncake tier: values of a dropped namespace may be left (%s)", pattern)


def _exist(client: Any, names: list[str]) -> list[int]:
    codes = list(client.batch_is_exist(names))
    failed = next((code_kind(rc) for rc in codes if rc < 0), None)
    if failed in FAILURES and not any(rc == 1 for rc in codes):
        raise Failed(failed)
    return codes
