"""The one interface every tier below the memory store implements, and nothing
else: the handlers reach tiers only through the chain (kvsvc.server.tiers.chain),
so a new tier is one folder that subclasses :class:`Tier`.

Every method runs on the event loop and must neither block it nor raise for a
failure of the tier's backend: a tier that fails or fills is a miss or a skipped
write (its reason counted), never a failed call, a hang or a dead thread."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

from kvsvc.server.data.store import Chunk, ChunkKey
from kvsvc.v1 import kv_cache_service_pb2 as pb


class Tier(abc.ABC):
    """A tier below memory, from the chain's point of view."""

    #: its name in logs, metrics labels, health holds and ``Chunk.origin``
    name: ClassVar[str]
    #: whether Lookup must ask it (a round trip) rather than read an index held here
    asked: ClassVar[bool] = False
    #: health stays NOT_SERVING until ``start``'s ``ready`` runs (--disk-wait-index)
    wait_ready: bool = False

    # --- life ---
    @abc.abstractmethod
    def start(self, ready: Callable[[], None]) -> None:
        """Check the settings now (a ConfigError names the flag), start the tier's
        threads; ``ready`` runs on the loop once it serves what it holds."""

    @abc.abstractmethod
    async def aclose(self, timeout: float) -> None:
        """At stop: finish or drop what is queued (counted) within ``timeout`` s."""

    @abc.abstractmethod
    def close(self, timeout: float) -> None:
        """The same, from a start-up that failed (no loop to wait on)."""

    @property
    def writing(self) -> bool:
        """Whether its writes land now (False: skipped and counted until it heals)."""
        return True

    @abc.abstractmethod
    def collector(self) -> Any:
        """Its Prometheus collector (read when scraped)."""

    def describe(self, out: pb.TierStats) -> None:
        """Fill what it holds and did in ``out`` (GetServerInfo's FULL view; the
        chain fills its hit counts): cheap, on the loop, never a round trip."""
        out.writing = self.writing
        out.ready = True

    # --- what it holds ---
    def holds(self, namespace: str, key: bytes, layout: str | None) -> bool:
        """Whether its index, kept here, lists the chunk (``layout`` None: any)."""
        return False

    async def present(self, namespace: str, layout: str, keys: list[bytes]) -> list[bool]:
        """Asked tiers (``asked``): whether it holds each of ``keys``, within the
        Lookup budget; [] when it cannot say in time."""
        return []

    @abc.abstractmethod
    async def load(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        committed: Callable[[], None],
    ) -> None:
        """Bring the leading ``keys`` memory lacks and the tier holds into the store,
        verified, within ``budget`` s; ``committed`` runs on the loop each time some
        were committed, while they are still pinned for it. A miss, a refused
        reservation or the budget spent: fewer, or none."""

    # --- write behind (the chain is the store's listener) ---
    @abc.abstractmethod
    def write_behind(self, chunk: Chunk) -> None:
        """``chunk`` was committed above this tier (a Store, or a load from a tier
        below): queue its write, or skip and count it. Never waits."""

    def evicted(self, chunk: Chunk) -> None:  # noqa: B027 - most tiers keep no evictions
        """Memory is about to reuse ``chunk``'s bytes (a tier that keeps evictions
        copies them now)."""

    async def durable(self, keys: list[ChunkKey], budget: float) -> None:  # noqa: B027
        """Return once the writes of ``keys`` are durable, or ``budget`` s passed
        (a tier whose Stores reply only once written: --disk-sync through)."""

    # --- a namespace dropped ---
    @abc.abstractmethod
    async def drop(self, namespace: str, budget: float, result: pb.DropNamespaceResult) -> None:
        """Forget every chunk of ``namespace`` (announced removed), and say what in
        this tier's fields of ``result``."""
