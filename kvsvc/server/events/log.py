"""EventLog: where server code publishes what became present or stopped being so,
and the store listener that turns the chunk store's commits and removals into it.

Publishing runs on the event loop and never blocks: an event is appended to the
pending one when it is the same kind, namespace, layout, tier and reason (a Store's
chunks, committed one by one in one turn of the loop, become one event), and the
pending event goes into the ring at the end of the loop's turn, waking every
watcher with one future. Watchers read the ring at their own pace
(kvsvc.server.events.stream); nothing here waits for them."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.events.ring import CLEARED, REMOVED, STORED, Event, EventRing
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: The store's removal reasons (data/store.py's StoreListener) as the contract's.
REMOVAL_REASONS = {
    "evicted": pb.REMOVAL_REASON_EVICTED,
    "check_failed": pb.REMOVAL_REASON_CHECK_FAILED,
    "overwritten": pb.REMOVAL_REASON_OVERWRITTEN,
    "unmapped": pb.REMOVAL_REASON_UNMAPPED,
    "cleared": pb.REMOVAL_REASON_UNSPECIFIED,
    "tier_dropped": pb.REMOVAL_REASON_TIER_DROPPED,
    "dropped": pb.REMOVAL_REASON_DROPPED,
}
#: Most keys one published event gathers (a bigger Store becomes several events).
MAX_EVENT_KEYS = 1024

RemoteKey = tuple[str, bytes, str]  # (namespace, key, layout) in the remote tier
#: a tier below memory as a snapshot lists it: (tier, [(key, bytes), ...])
Below = tuple[int, list[tuple[RemoteKey, int]]]


class _Pending:
    """The event being gathered in this turn of the loop."""

    __slots__ = ("keys", "kind", "layout", "namespace", "tier", "value")

    def __init__(
        self, kind: int, namespace: str, keys: list[bytes], layout: str, value: int, tier: int
    ) -> None:
        self.kind, self.namespace, self.keys = kind, namespace, keys
        self.layout, self.value, self.tier = layout, value, tier

    def takes(self, kind: int, namespace: str, layout: str, value: int, tier: int) -> bool:
        return (
            kind != CLEARED
            and kind == self.kind
            and namespace == self.namespace
            and layout == self.layout
            and tier == self.tier
            and (kind == STORED or value == self.value)
            and len(self.keys) < MAX_EVENT_KEYS
        )


class EventLog:
    """The server's events of one incarnation (``incarnation``: its start id),
    numbered from 1; the first is cleared(START)."""

    def __init__(
        self,
        incarnation: str,
        store: ChunkStore,
        loop: asyncio.AbstractEventLoop,
        *,
        ring_events: int,
        ring_bytes: int,
        remote_keys: int,
    ) -> None:
        self.incarnation = incarnation
        self.store = store
        self.loop = loop
        self.ring = EventRing(ring_events, ring_bytes)
        self._pending: _Pending | None = None
        self._flush_scheduled = False
        self._wake: asyncio.Future[None] = loop.create_future()
        #: remote-tier keys this server announced as stored (oldest first), with bytes:
        #: what a snapshot says of the remote tier; bounded, the oldest forgotten loudly
        self.remote: OrderedDict[RemoteKey, int] = OrderedDict()
        self.remote_keys = remote_keys
        #: the listings of tiers that keep one here (list_tier), by tier: a snapshot
        #: names what they hold, so a warm restart's contents reach the indexes
        self.listings: dict[int, Callable[[], Iterable[tuple[RemoteKey, int]]]] = {}
        self.published = 0  # events that reached the ring
        self.resyncs = 0  # lost batches sent
        self.watching = 0  # open WatchEvents streams
        self.ended: Exception | None = None  # set once: every stream ends with it
        #: called once when the log ends (Watchers: streams stuck in a write are cut)
        self.on_end: list[Callable[[], None]] = []
        self.cleared(pb.CLEAR_REASON_START)

    # --- publishing (on the loop; O(1) each) ---
    def stored(
        self, namespace: str, keys: Sequence[bytes], layout: str, nbytes: int, tier: int
    ) -> None:
        if tier == pb.TIER_REDIS:
            keys = self._announce(namespace, keys, layout, nbytes)
            if not keys:
                return
        self._add(STORED, namespace, keys, layout, nbytes, tier)

    def removed(
        self, namespace: str, keys: Sequence[bytes], layout: str, reason: int, tier: int
    ) -> None:
        if tier == pb.TIER_REDIS:  # only what was announced leaves
            keys = [k for k in keys if self.remote.pop((namespace, k, layout), None) is not None]
            if not keys:
                return
        self._add(REMOVED, namespace, keys, layout, reason, tier)

    def withdraw(self, tier: int) -> None:
        """Every key announced in ``tier`` (the remote one) is removed: this server
        can no longer vouch for any of them (Redis restarted or stopped answering)."""
        assert tier == pb.TIER_REDIS
        gone, self.remote = self.remote, OrderedDict()
        for namespace, key, layout in gone:
            self._add(REMOVED, namespace, (key,), layout, pb.REMOVAL_REASON_TIER_DROPPED, tier)

    def cleared(self, reason: int) -> None:
        self.remote.clear()
        self._add(CLEARED, "", (), "", reason, pb.TIER_UNSPECIFIED)

    def _announce(
        self, namespace: str, keys: Sequence[bytes], layout: str, nbytes: int
    ) -> list[bytes]:
        """Remember remote keys announced; the ones already announced are not news."""
        fresh = [k for k in keys if (namespace, k, layout) not in self.remote]
        each = nbytes // max(1, len(keys))
        for k in fresh:
            self.remote[(namespace, k, layout)] = each
        while len(self.remote) > self.remote_keys:
            (ns, key, lay), _ = self.remote.popitem(last=False)
            # Forgotten: the index must not keep a hit this server no longer vouches for.
            self._add(REMOVED, ns, (key,), lay, pb.REMOVAL_REASON_TIER_DROPPED, pb.TIER_REDIS)
        return fresh

    def _add(
        self, kind: int, namespace: str, keys: Sequence[bytes], layout: str, value: int, tier: int
    ) -> None:
        p = self._pending
        if p is not None and p.takes(kind, namespace, layout, value, tier):
            p.keys.extend(keys)
            if kind == STORED:
                p.value += value
            return
        self.flush()
        self._pending = _Pending(kind, namespace, list(keys), layout, value, tier)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Move the pending event into the ring and wake the watchers (at the end of
        the loop's turn, or before a snapshot point is taken)."""
        self._flush_scheduled = False
        p = self._pending
        if p is None:
            return
        self._pending = None
        seq = self.ring.last + 1
        self.ring.append(Event(seq, p.kind, p.namespace, tuple(p.keys), p.layout, p.value, p.tier))
        self.published += 1
        self.wake()

    def wake(self) -> None:
        if not self._wake.done():
            self._wake.set_result(None)

    def changed(self) -> asyncio.Future[None]:
        """Done once something was published (or the log ended) after this call."""
        if self._wake.done():
            self._wake = self.loop.create_future()
        return self._wake

    def end(self, exc: Exception) -> None:
        """Every stream ends with ``exc`` (a fatal failure, a shutdown); the first wins."""
        first = self.ended is None
        if first:
            self.ended = exc
        self.flush()
        self.wake()
        if first:
            for hook in self.on_end:
                hook()

    def list_tier(self, tier: int, contents: Callable[[], Iterable[tuple[RemoteKey, int]]]) -> None:
        """``contents`` lists what ``tier`` holds, for every snapshot from now on."""
        self.listings[tier] = contents

    # --- the snapshot point ---
    def snapshot(self) -> tuple[int, list[Chunk], list[Below]]:
        """(S, chunks present at S, what each tier below memory holds at S), taken at
        once on the loop: events after S are exactly what changed since. Costs one
        reference per present chunk and one tuple per key below (no key bytes copied)."""
        self.flush()
        below: list[Below] = []
        for tier, contents in self.listings.items():
            below.append((tier, list(contents())))
        below.append((pb.TIER_REDIS, list(self.remote.items())))
        return self.ring.last, self.store.chunks(), below


class StoreEvents:
    """The chunk store's listener: commits and removals become memory-tier events."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def stored(self, chunk: Chunk) -> None:
        namespace, key, layout = chunk.key
        self.log.stored(namespace, (key,), layout, chunk.size, pb.TIER_MEMORY)

    def removed(self, chunk: Chunk, reason: str) -> None:
        namespace, key, layout = chunk.key
        code = REMOVAL_REASONS.get(reason, pb.REMOVAL_REASON_UNSPECIFIED)
        self.log.removed(namespace, (key,), layout, code, pb.TIER_MEMORY)
