"""TierChain: the tiers below memory, in order (disk, Redis, Mooncake, then S3), built once from
the configuration by :func:`build`, and all the handlers know of them.

- Lookup: the local prefix continued by the tiers whose index is held here, then
  by those that must be asked (one round trip each, concurrently).
- Retrieve: each tier in turn loads the leading keys memory still lacks.
- Writes: the chain is the store's listener. A chunk committed by a Store is
  written behind to every tier; one loaded from a tier only to the tiers above
  it (``Chunk.origin``), which could not have it: no tier is written what it
  gave. Evictions go to every tier (one that keeps them copies the bytes).
- DropNamespace, durability waits, health holds, metrics and stop: each tier."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvsvc.server.config import ServerConfig
from kvsvc.server.data.engine import reply_budget
from kvsvc.server.data.store import INLINE_LAYOUT, Chunk, ChunkKey, ChunkStore
from kvsvc.server.events import EventLog
from kvsvc.server.tiers.base import Tier
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger("kvsvc.server.tiers")


def build(
    config: ServerConfig, store: ChunkStore, loop: asyncio.AbstractEventLoop, events: EventLog
) -> TierChain:
    """The tiers the configuration asks for, top to bottom; each checks its
    settings when started (TierChain.start). Adding a tier is a line here."""
    from kvsvc.server.tiers.disk import DiskTier
    from kvsvc.server.tiers.mooncake import MooncakeTier
    from kvsvc.server.tiers.redis import RemoteTier
    from kvsvc.server.tiers.s3 import S3Tier

    tiers: list[Tier] = []
    if config.tiers.disk_dir:
        tiers.append(DiskTier(config, store, loop, events))
    if config.tiers.remote != "off":
        tiers.append(RemoteTier(config, store, loop, events))
    if config.tiers.mooncake_master:
        tiers.append(MooncakeTier(config, store, loop, events))
    if config.tiers.s3_endpoint:
        tiers.append(S3Tier(config, store, loop, events))
    return TierChain(store, tiers)


class TierChain:
    """The handlers' one view of every tier below memory."""

    def __init__(self, store: ChunkStore, tiers: Sequence[Tier]) -> None:
        self.store = store
        self.tiers = list(tiers)
        self._known = [t for t in self.tiers if not t.asked]
        self._asked = [t for t in self.tiers if t.asked]
        #: by tier name ("memory" too): the keys past memory's leading run that
        #: Lookup counted present, each the first holder's (GetServerInfo's stats)
        self.lookup_hits: dict[str, int] = {}
        #: by tier: chunks Retrieve asked of it (those memory and the tiers above
        #: lacked), and those it loaded
        self.retrieve_asked: dict[str, int] = {}
        self.retrieve_hits: dict[str, int] = {}
        if self.tiers:
            store.listeners.append(self)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def named(self, name: str) -> Tier | None:
        """The tier called ``name``, if the server has it (tests, diagnostics)."""
        return next((t for t in self.tiers if t.name == name), None)

    # --- life ---
    def start(self, hold: Callable[[str], None], release: Callable[[str], None]) -> None:
        """Start every tier; one that must be ready before the server serves holds
        health (``hold``) until it is."""
        for tier in self.tiers:
            reason = f"{tier.name}_index"
            if tier.wait_ready:
                hold(reason)
            tier.start(functools.partial(release, reason))

    async def aclose(self, timeout: float) -> None:
        for tier in self.tiers:
            await tier.aclose(timeout)

    def close(self, timeout: float) -> None:
        for tier in self.tiers:
            tier.close(timeout)

    # --- Lookup ---
    def prefix(
        self, namespace: str, layout: str, keys: list[bytes], hits: int
    ) -> int | Coroutine[Any, Any, int]:
        """The local prefix of ``hits`` keys continued by the keys memory or a tier
        holds: an int when no tier has to be asked (no coroutine on the hot path)."""
        local = None if layout == INLINE_LAYOUT else layout  # as the local Lookup counts
        hits = self._continue(namespace, local, keys, hits, ())
        if hits < len(keys) and self._asked:
            return self._ask(namespace, layout, local, keys, hits)
        return hits

    def _continue(
        self,
        namespace: str,
        local: str | None,
        keys: list[bytes],
        hits: int,
        answers: Sequence[list[bool]],
    ) -> int:
        """``hits`` extended over the keys memory, a known tier or an asked tier's
        ``answers`` (each for ``keys[first:]``) hold."""
        first = hits
        counted = self.lookup_hits
        for i in range(hits, len(keys)):
            holder = self._holder(namespace, local, keys[i], answers, i - first)
            if holder is None:
                break
            counted[holder] = counted.get(holder, 0) + 1
            hits += 1
        return hits

    def _holder(
        self,
        namespace: str,
        local: str | None,
        key: bytes,
        answers: Sequence[list[bool]],
        at: int,
    ) -> str | None:
        """The first of memory and the tiers, in order, that holds ``key`` (``answers``:
        the asked tiers', in their order, ``at`` its index there), or None."""
        if self.store.lookup(namespace, [key], local):
            return "memory"
        for tier in self._known:
            if tier.holds(namespace, key, local):
                return tier.name
        for tier, answer in zip(self._asked, answers, strict=False):
            if at < len(answer) and answer[at]:
                return tier.name
        return None

    async def _ask(
        self, namespace: str, layout: str, local: str | None, keys: list[bytes], hits: int
    ) -> int:
        rest = keys[hits:]
        if len(self._asked) == 1:
            answers = [await self._asked[0].present(namespace, layout, rest)]
        else:
            answers = list(
                await asyncio.gather(*(t.present(namespace, layout, rest) for t in self._asked))
            )
        return self._continue(namespace, local, keys, hits, answers)

    # --- Retrieve ---
    async def load(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        deadline: float,
        committed: Callable[[], None],
    ) -> None:
        """Each tier in turn loads the leading ``keys`` memory still lacks, within
        half of what is left of the reply's budget when its turn comes."""
        start = self.store.lookup(namespace, keys, layout)
        for tier in self.tiers:
            if start == len(keys):
                return
            await tier.load(namespace, layout, keys[start:], reply_budget(deadline) / 2, committed)
            now = self.store.lookup(namespace, keys, layout)
            _add(self.retrieve_asked, tier.name, len(keys) - start)
            _add(self.retrieve_hits, tier.name, max(0, now - start))
            start = now

    def describe(self) -> list[pb.TierStats]:
        """Each tier's stats (Tier.describe) with the hits counted here, in order."""
        out = []
        for tier in self.tiers:
            stats = pb.TierStats(name=tier.name)
            tier.describe(stats)
            stats.lookup_hit_chunks = self.lookup_hits.get(tier.name, 0)
            stats.retrieve_asked_chunks = self.retrieve_asked.get(tier.name, 0)
            stats.retrieve_hit_chunks = self.retrieve_hits.get(tier.name, 0)
            out.append(stats)
        return out

    # --- writes (the store's listener) ---
    def stored(self, chunk: Chunk) -> None:
        for tier in self.tiers:
            if tier.name == chunk.origin:
                return
            tier.write_behind(chunk)

    def removed(self, chunk: Chunk, reason: str) -> None:
        if reason == "evicted":
            for tier in self.tiers:
                tier.evicted(chunk)

    async def durable(self, keys: list[ChunkKey], budget: float) -> None:
        for tier in self.tiers:
            await tier.durable(keys, budget)

    # --- DropNamespace ---
    async def drop(self, namespace: str, deadline: float, result: pb.DropNamespaceResult) -> None:
        """Every tier forgets ``namespace``, saying what in its fields of ``result``."""
        for tier in self.tiers:
            await tier.drop(namespace, reply_budget(deadline) * 0.8, result)


def _add(table: dict[str, int], name: str, n: int) -> None:
    table[name] = table.get(name, 0) + n
