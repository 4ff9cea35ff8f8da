"""The Mooncake tier's write-behind: a committed chunk is read-pinned and queued
(bounded in bytes; a full queue skips the write and counts it, so a Store's
reply never waits for Mooncake); a writer thread puts what is queued, up to
BATCH chunks a call, each value from two registered buffers (its header in a
slot, the chunk's own bytes in the store), into this server's own segment first;
the chunks are unpinned on the event loop.

Mooncake keeps the first value put under a key: a chunk this server wrote
before with other bytes (a Store that replaced it) is removed first, and a key
whose newest version failed to land is never loaded from Mooncake here."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import queue
import threading
from typing import Any

from kvsvc.server.data.store import Chunk, ChunkKey, ChunkStore
from kvsvc.server.events import EventLog
from kvsvc.server.tiers.mooncake.client import (
    CLOSING,
    FAILURES,
    HEADER_SLOT_BYTES,
    Failed,
    code_kind,
    log,
)
from kvsvc.server.tiers.mooncake.gate import Gate
from kvsvc.server.tiers.mooncake.values import header, key_name
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: chunks one put call carries at most
BATCH = 16
#: a header larger than a registered slot (a layout name of kilobytes): not written
TOO_LARGE = "too_large"
#: keys this server remembers Mooncake holding (its writes and reads), and keys
#: whose newest version it failed to write; beyond, the oldest are forgotten
KNOWN_MAX = 1 << 20


def version(chunk: Chunk) -> int:
    """Which bytes a chunk holds, as far as its size and checksums tell."""
    return hash((chunk.size, tuple(chunk.digests)))


class Known:
    """What Mooncake holds as far as this server knows (on the loop): a hint,
    since Mooncake evicts on its own. Each key joining or leaving it is a
    TIER_MOONCAKE stored/removed event (WatchEvents, the presence index)."""

    def __init__(self, events: EventLog | None) -> None:
        #: key -> (version, the chunk's bytes)
        self.versions: collections.OrderedDict[ChunkKey, tuple[int, int]] = (
            collections.OrderedDict()
        )
        self.stale: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self.events = events
        if events is not None:
            events.list_tier(
                pb.TIER_MOONCAKE, lambda: ((k, v[1]) for k, v in self.versions.items())
            )

    def remember(self, key: ChunkKey, v: int, nbytes: int) -> None:
        self.stale.pop(key, None)
        fresh = key not in self.versions
        self.versions[key] = (v, nbytes)
        self.versions.move_to_end(key)
        if fresh and self.events is not None:
            self.events.stored(key[0], (key[1],), key[2], nbytes, pb.TIER_MOONCAKE)
        if len(self.versions) > KNOWN_MAX:
            old, _ = self.versions.popitem(last=False)
            self._removed(old, pb.REMOVAL_REASON_TIER_DROPPED)

    def forget(self, key: ChunkKey, reason: int) -> int | None:
        """``key`` no longer vouched for (``reason``: a RemovalReason); its version."""
        known = self.versions.pop(key, None)
        if known is None:
            return None
        self._removed(key, reason)
        return known[0]

    def doubt(self, key: ChunkKey) -> None:
        """``key``'s newest version did not reach Mooncake: never load it from there."""
        self.forget(key, pb.REMOVAL_REASON_TIER_DROPPED)
        self.stale[key] = None
        if len(self.stale) > KNOWN_MAX:
            self.stale.popitem(last=False)

    def forget_namespace(self, namespace: str) -> None:
        for key in [k for k in self.versions if k[0] == namespace]:
            self.forget(key, pb.REMOVAL_REASON_DROPPED)
        for key in [k for k in self.stale if k[0] == namespace]:
            del self.stale[key]

    def _removed(self, key: ChunkKey, reason: int) -> None:
        if self.events is not None:
            self.events.removed(key[0], (key[1],), key[2], reason, pb.TIER_MOONCAKE)


class Writer:
    """The queue and the writer thread that drains it."""

    def __init__(
        self,
        gate: Gate,
        store: ChunkStore,
        loop: asyncio.AbstractEventLoop,
        known: Known,
        prefix: str,
        limit: int,
    ) -> None:
        self.gate = gate
        self.store = store
        self.loop = loop
        self.known = known
        self.prefix = prefix
        # Pinned chunks block eviction: at most a quarter of the store waits for Mooncake.
        self.limit = min(limit, store.capacity // 4)
        self.queued_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Chunk, bool] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvsvc-mooncake-write", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """The writer ends after its put (queued writes are skipped and counted)."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def put(self, chunk: Chunk) -> None:
        """On the loop: pin and queue ``chunk``, or skip and count it. Never waits."""
        g = self.gate
        with self._lock:
            take = not g.closed and self.queued_bytes + chunk.size <= self.limit
            if take:
                self.queued_bytes += chunk.size
        if not take:
            self._skip([chunk], CLOSING if g.closed else "queue")
            return
        chunk.readers += 1  # the store frees nothing a writer still reads
        # What Mooncake holds is the old version until the new one lands.
        before = self.known.forget(chunk.key, pb.REMOVAL_REASON_OVERWRITTEN)
        self._queue.put((chunk, before is not None and before != version(chunk)))

    def _skip(self, chunks: list[Chunk], why: str) -> None:
        self.gate.count(self.gate.skipped, why, len(chunks))
        for chunk in chunks:
            self._on_loop(self.known.doubt, chunk.key)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            with contextlib.suppress(queue.Empty):
                while len(batch) < BATCH:
                    more = self._queue.get_nowait()
                    if more is None:
                        self._queue.put(None)  # stop once this batch is written
                        break
                    batch.append(more)
            chunks = [c for c, _ in batch]
            try:
                self._write(chunks, [c.key for c, replaced in batch if replaced])
            except Exception:  # noqa: BLE001 - the writer never dies: skipped, counted
                log.exception("mooncake tier: a write failed")
                self._skip(chunks, "other")
            finally:
                with self._lock:
                    self.queued_bytes -= sum(c.size for c in chunks)
                self._on_loop(self.store.release, chunks)

    def _write(self, chunks: list[Chunk], replaced: list[ChunkKey]) -> None:
        g = self.gate
        if g.closed:
            self._skip(chunks, CLOSING)
            return
        # A chunk dropped since it was queued (DropNamespace) is not written.
        chunks = [c for c in chunks if not c.discarded]
        if not chunks:
            return
        headers = g.connection.headers
        slots = headers.take(len(chunks))
        if slots is None:
            self._skip(chunks, "busy")
            return
        try:
            self._put(chunks, replaced, slots)
        except Failed as exc:  # Mooncake failing or refused (breaker): "unavailable"
            self._skip(chunks, exc.kind if exc.kind in (CLOSING, TOO_LARGE) else "unavailable")
        finally:
            headers.give(slots)

    def _put(self, chunks: list[Chunk], replaced: list[ChunkKey], slots: list[int]) -> None:
        g = self.gate
        headers = g.connection.headers
        names, ptrs, sizes = [], [], []
        for chunk, slot in zip(chunks, slots, strict=True):
            namespace, key, layout = chunk.key
            name = key_name(self.prefix, namespace, layout, key)
            head = header(name, layout, chunk.size, chunk.digests)
            if len(head) > HEADER_SLOT_BYTES:
                raise Failed(TOO_LARGE)
            headers.slot(slot, len(head))[:] = head
            names.append(name)
            ptrs.append([headers.addr(slot), self.store.base + chunk.offset])
            sizes.append([len(head), chunk.size])
        gone = [key_name(self.prefix, k[0], k[2], k[1]) for k in replaced]

        def send(client: Any) -> list[int]:
            if gone:  # Mooncake keeps the first value put: the old bytes go first
                client.batch_remove(gone, True)
            codes = list(
                client.batch_put_from_multi_buffers(names, ptrs, sizes, g.connection.replicate)
            )
            kinds = {code_kind(rc) for rc in codes if rc < 0}
            if all(rc < 0 for rc in codes):
                failed = next((k for k in kinds if k in FAILURES), None)
                if failed is not None:  # nothing landed: Mooncake is failing
                    raise Failed(failed)
            return codes

        codes = g.call_now(send)
        for chunk, name, rc in zip(chunks, names, codes, strict=True):
            if rc < 0 and code_kind(rc) != "exists":  # exists: another server put it
                kind = code_kind(rc)
                g.count(g.errors, kind)
                self._skip([chunk], kind)
                continue
            g.add(writes=1, bytes_written=chunk.size)
            if chunk.discarded:  # dropped while it was sent: the drop may have missed it
                with contextlib.suppress(Failed):
                    g.call_now(functools.partial(_remove, name=name))
                continue
            self._on_loop(self.known.remember, chunk.key, version(chunk), chunk.size)

    def _on_loop(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            self.loop.call_soon_threadsafe(fn, *args)


def _remove(client: Any, name: str) -> int:
    return int(client.remove(name, True))
