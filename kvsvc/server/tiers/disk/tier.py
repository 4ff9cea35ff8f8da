"""DiskTier, the disk tier behind the tier interface (kvsvc.server.tiers.base):
it writes chunks to disk (every committed one with --disk-write through, behind
the reply; those memory evicts with ``evict``, copied out in the eviction itself,
before the store can reuse their bytes), Lookup's and Retrieve's view of what
the disk holds, the files evicted for room (kvsvc.server.tiers.disk.capacity
chooses them), and its life: the directory checked at start (unwritable: a
ConfigError naming it, exit 2), the index rebuilt on a thread (health held
NOT_SERVING meanwhile with --disk-wait-index), the queue drained at stop.

Best-effort like every tier: a full disk, an I/O error, a file deleted or
truncated under the server are a skipped write or a miss (counted), never a
failed call. Only the event loop touches the index and the counters.

A replaced version is never served again, across restarts: a Store of other
bytes under a key removes the old file before it replies; if the disk refuses
(read-only, EIO, EACCES), the file leaves the index at once and is owed: its
name recorded off the disk before the reply (kvsvc.server.tiers.disk.owed), its
removal retried ahead of any new write once the disk takes writes and at stop,
and done by the next start before it indexes (a file it still cannot remove is
not indexed). The record's limit (a tmpfs shm dir emptied by a host reboot before
the disk was seen writable again) is the one way back, told in ``owed``."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from kvsvc.server.config import ConfigError, ServerConfig, check_disk_dir
from kvsvc.server.data.store import Chunk, ChunkKey, ChunkStore
from kvsvc.server.tiers.base import Tier
from kvsvc.server.tiers.disk.capacity import Capacity
from kvsvc.server.tiers.disk.format import encode_header, file_name, fingerprint
from kvsvc.server.tiers.disk.heal import DOWN_REASONS, WriteHealth
from kvsvc.server.tiers.disk.index import Entry, Index, Rebuilt, prepare, quarantine, rebuild
from kvsvc.server.tiers.disk.loads import Loads
from kvsvc.server.tiers.disk.owed import OwedRecord
from kvsvc.server.tiers.disk.reader import Reader
from kvsvc.server.tiers.disk.stats import DiskStats
from kvsvc.server.tiers.disk.writer import Write, Writer, failure
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger("kvsvc.server.tiers.disk")

#: a full disk is logged at most this often (it is counted every time)
FULL_LOG_EVERY_S = 60.0


class EventSink(Protocol):
    """The events stream's publishing side (kvsvc.server.events.EventLog)."""

    def stored(
        self, namespace: str, keys: Sequence[bytes], layout: str, nbytes: int, tier: int
    ) -> None: ...

    def removed(
        self, namespace: str, keys: Sequence[bytes], layout: str, reason: int, tier: int
    ) -> None: ...

    def list_tier(
        self, tier: int, contents: Callable[[], Iterator[tuple[ChunkKey, int]]]
    ) -> None: ...


class DiskTier(Tier):
    """One per server, when --disk-dir is set."""

    name = "disk"

    def __init__(
        self,
        config: ServerConfig,
        store: ChunkStore,
        loop: asyncio.AbstractEventLoop,
        events: EventSink | None = None,
    ) -> None:
        t = config.tiers
        self.root = os.path.abspath(t.disk_dir)
        self.mode = t.disk_write
        self.sync = t.disk_sync
        self.store, self.loop = store, loop
        self.index = Index()
        self.ready = False
        self.stats = DiskStats()
        #: the events stream, when the server has one (announces TIER_DISK changes;
        #: a snapshot lists what the disk holds, so a warm restart reaches indexes)
        self.events = events
        if events is not None:
            events.list_tier(pb.TIER_DISK, self.contents)
        self.wait_ready = t.disk_wait_index
        #: --disk-capacity: the index's files and the writes not yet landed
        self.space = Capacity(t.disk_capacity, store)
        self.capacity = self.space.limit
        self._writing: dict[ChunkKey, Write] = {}  # the latest write of each key
        self._unlinking: dict[str, int] = {}  # files the writer is yet to remove
        self._full_logged = 0.0
        #: namespaces dropped before the index was rebuilt: their files are dropped then
        self._dropped_early: set[str] = set()
        self.writer = Writer(
            self.root,
            store,
            loop,
            self.sync,
            min(t.disk_queue_bytes, store.capacity // 4),
            self._written,
            self._unlinked,
            self._probed,
        )
        #: whether writes land; the probes and removals owed while they do not
        self.health = WriteHealth(self.root, loop, self.writer.probe, self._unlink_owed)
        #: the removals owed, where a restart finds them (kvsvc.server.tiers.disk.owed)
        self.owed_record = OwedRecord(self.root, config.data.shm_dir)
        self.reader = Reader(self.root, store, loop)
        self.loads = Loads(store, loop, self.reader, self.stats, self._touch, self._drop)

    # --- life ---
    def start(self, ready: Callable[[], None]) -> None:
        """Check the directory now (ConfigError if unusable), rebuild the index on a
        thread; ``ready`` runs on the loop once it is in place."""
        check_disk_dir(self.root)  # what cannot be a writable directory, named
        try:
            prepare(self.root)
        except OSError as exc:
            raise ConfigError(
                f"--disk-dir {self.root}: not a writable directory ({exc.strerror or exc})"
            ) from None
        # the files an earlier process owed: removed now, or never indexed and retried
        self.health.owe(self.owed_record.pay())
        self.writer.start()
        threading.Thread(
            target=self._rebuild, args=(ready,), name="kvsvc-disk-index", daemon=True
        ).start()

    def _rebuild(self, on_ready: Callable[[], None]) -> None:
        try:
            rebuilt: Rebuilt | None = rebuild(self.root)
        except OSError:
            log.exception("disk tier: the index of %s could not be read: starting empty", self.root)
            rebuilt = None
        try:
            self.loop.call_soon_threadsafe(self._indexed, rebuilt, on_ready)
        except RuntimeError:  # the loop closed meanwhile: the server is gone
            return

    def _indexed(self, rebuilt: Rebuilt | None, on_ready: Callable[[], None]) -> None:
        """On the loop: the rebuilt index, with what was written meanwhile on top."""
        if rebuilt is not None:
            owed = self.health.owed  # on disk still, never to be served
            for key, entry in list(rebuilt.index.entries.items()) if owed else ():
                if entry.name in owed:
                    rebuilt.index.remove(key)
            live = self.index
            self.index = rebuilt.index
            for key, entry in live.entries.items():
                self.index.add(key, entry)
            self.stats.index_seconds = rebuilt.seconds
            for kind, n in rebuilt.refused.items():
                self.stats.refused[kind] = self.stats.refused.get(kind, 0) + n
            log.info(
                "disk tier: %d chunks (%d bytes) in %s indexed in %.2f s; refused %s, %d "
                "interrupted writes removed",
                len(rebuilt.index),
                self.index.used_bytes,
                self.root,
                rebuilt.seconds,
                rebuilt.refused or "none",
                rebuilt.temporaries,
            )
        self.stats.indexed_chunks = len(self.index)
        self.ready = True
        early, self._dropped_early = self._dropped_early, set()
        for namespace in early:
            self.drop_namespace(namespace)
        self._make_room(0)
        if self.events is not None:
            for (namespace, chunk_key, layout), entry in self.index.entries.items():
                self.events.stored(namespace, [chunk_key], layout, entry.size, pb.TIER_DISK)
        on_ready()

    # --- what metrics read (kvsvc.server.ops.tier_metrics.DiskView) ---
    @property
    def pending_bytes(self) -> int:
        return self.space.pending_bytes

    @property
    def files(self) -> int:
        return len(self.index)

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def queued_bytes(self) -> int:
        return self.writer.queued_bytes

    def contents(self) -> Iterator[tuple[ChunkKey, int]]:
        """(chunk, bytes) of every chunk on disk (the events stream's snapshot)."""
        for key, entry in self.index.entries.items():
            yield key, entry.size

    def close(self, timeout: float) -> None:
        """Finish the queued writes (up to ``timeout`` s), then stop."""
        self.writer.close(timeout)
        self.reader.close()

    async def aclose(self, timeout: float) -> None:
        self.health.retry_owed()  # the disk may take them now: queued before the stop
        self.health.close()
        await self.loop.run_in_executor(None, self.close, timeout)

    @property
    def writing(self) -> bool:
        return self.health.writing

    def describe(self, out: pb.TierStats) -> None:
        s = self.stats
        out.writing, out.ready = self.writing, self.ready
        out.capacity_bytes, out.used_bytes, out.chunks = self.capacity, self.used_bytes, self.files
        out.read_bytes = s.bytes_read
        out.written_chunks, out.written_bytes = s.writes, s.bytes_written
        out.queued_bytes = self.queued_bytes
        out.removed_chunks["evicted"] = s.evicted
        skipped = {"full": s.skipped_full, "queue": s.skipped_queue}
        skipped |= {"capacity": s.skipped_capacity, "replaced": s.replaced}
        skipped |= dict(self.health.skipped)
        out.skipped_writes.update(skipped)

    def collector(self) -> Any:
        from kvsvc.server.ops.tier_metrics import DiskCollector

        return DiskCollector(self)

    # --- writes (the tiers' chain follows the store) ---
    def write_behind(self, chunk: Chunk) -> None:
        self._replace(chunk)
        if self.mode == "through" and not self._known(chunk.key):
            self._enqueue(chunk, None, bounded=not self.sync)

    def _replace(self, chunk: Chunk) -> None:
        """A Store of other bytes than the disk holds (or is writing) for this key
        drops the old version now, before the reply: after a crash the key is the
        new bytes or a miss, never a version a later Store replaced. So does a file
        the writer is yet to remove (evicted), and, before the index is rebuilt, the
        file in place (unknown: a rare extra write)."""
        key, version = chunk.key, fingerprint(chunk.size, chunk.digests)
        entry = self.index.get(key)
        if entry is not None and entry.version != version:
            self.index.remove(key)
            self.stats.replaced += 1
            self._announce_removed(key, pb.REMOVAL_REASON_OVERWRITTEN)
            self._unlink_now(entry.name)
        elif entry is None and key not in self._writing and (self._unlinking or not self.ready):
            name = file_name(key[0], key[2], key[1])
            if not self.ready or name in self._unlinking:  # not on disk for long: gone now
                self._unlink_now(name)
        w = self._writing.get(key)
        if w is not None and w.version != version:
            del self._writing[key]
            self.stats.replaced += 1
            self._supersede(w)

    def _supersede(self, w: Write) -> None:
        reason = self.writer.supersede(w)
        if reason is not None:
            self._owe(w.name, reason)

    def _unlink_now(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.root, name))
        except FileNotFoundError:
            return
        except OSError as exc:
            self._owe(name, failure(exc))

    def _owe(self, name: str, reason: str) -> None:
        """``name`` holds a version that must not come back and could not be removed:
        out of the index already, recorded for a restart (before the reply: this runs
        in the Store's own turn of the loop; kvsvc.server.tiers.disk.owed), its
        removal retried once the disk takes writes (kvsvc.server.tiers.disk.heal). A
        retried removal refused again leaves the tier as it is: the probe that
        brought it back proved writes land."""
        self.stats.write_errors += 1
        if name in self.health.owed:
            return
        self.health.owe([name])
        self.owed_record.add([name])
        self.health.failed(reason if reason in DOWN_REASONS else "io", "removal")

    def _paid(self, names: Iterable[str]) -> None:
        """``names`` no longer hold what was owed (removed, or renamed over)."""
        owed = self.health.owed
        gone = [name for name in names if name in owed]
        if gone:
            self.health.settle(gone)
            self.owed_record.write(owed)

    def _unlink_owed(self, names: list[str]) -> None:
        self._remove_later(names)

    def _remove_later(self, names: list[str]) -> None:
        """Queue the removal of ``names`` behind the writes queued now (until it is
        done, a Store of the same key removes the file itself: see _replace)."""
        for name in names:
            self._unlinking[name] = self._unlinking.get(name, 0) + 1
        self.writer.unlink(names)

    def _probed(self, outcome: str | None) -> None:
        self.health.probed(outcome if outcome in DOWN_REASONS or outcome is None else "io")

    def evicted(self, chunk: Chunk) -> None:
        if self.mode != "evict" or self._known(chunk.key) or self.health.skip():
            return
        if not self.writer.has_room(chunk.size):
            self.stats.skipped_queue += 1
            return
        # Copied now: once the store's reserve returns, these bytes are reused.
        self._enqueue(chunk, bytes(self.store.buffer(chunk).view), bounded=True)

    def _known(self, key: ChunkKey) -> bool:
        """On disk or being written (a touch keeps it recent)."""
        if key in self._writing:
            return True
        if self.index.get(key) is not None:
            self.index.touch(key)
            return True
        return False

    def _enqueue(self, chunk: Chunk, data: bytes | None, *, bounded: bool) -> None:
        namespace, key, layout = chunk.key
        w = Write(
            chunk.key,
            file_name(namespace, layout, key),
            encode_header(namespace, layout, key, chunk.owner, chunk.size, chunk.digests),
            chunk.size,
            chunk.owner,
            chunk=chunk if data is None else None,
            data=data,
            version=fingerprint(chunk.size, chunk.digests),
        )
        if w.file_bytes > self.space.limit:
            self.stats.skipped_capacity += 1
            return
        if self.health.skip():  # the disk refuses writes: skipped (counted) until it heals
            return
        if bounded and not self.writer.has_room(w.size):
            self.stats.skipped_queue += 1
            return
        # Removals are queued before this write. What cannot be made room for is
        # held by writes still landing: skipped, as the capacity holds.
        if not self._make_room(w.file_bytes, w.owner):
            self.stats.skipped_capacity += 1
            return
        self.writer.put(w, bounded=False)
        self._writing[w.key] = w
        self.space.reserve(w.file_bytes)

    def _make_room(self, need: int, owner: str = "") -> bool:
        """Forget (and queue the removal of) files until ``need`` more bytes fit the
        capacity (kvsvc.server.tiers.disk.capacity says which go). False when they
        do not fit even so."""
        gone, fits = self.space.evict(self.index, need, owner)
        for key, _ in gone:
            self.stats.evicted += 1
            self._announce_removed(key, pb.REMOVAL_REASON_EVICTED)
        self._remove_later([entry.name for _, entry in gone])
        return fits

    async def drop(self, namespace: str, budget: float, result: pb.DropNamespaceResult) -> None:
        result.disk_chunks, result.disk_bytes = self.drop_namespace(namespace)

    def drop_namespace(self, namespace: str) -> tuple[int, int]:
        """On the loop: forget every file of ``namespace`` (announced removed, reason
        DROPPED) and queue their removal behind the writes queued now; its writes not
        yet landed never will. Returns (files, bytes of their chunks). Before the index
        is rebuilt at start, the files it will find are dropped once it is."""
        if not self.ready:
            self._dropped_early.add(namespace)
        for key in [k for k in self._writing if k[0] == namespace]:
            self._supersede(self._writing.pop(key))
        keys = [k for k in self.index.entries if k[0] == namespace]
        names: list[str] = []
        nbytes = 0
        for key in keys:
            entry = self.index.remove(key)
            assert entry is not None
            names.append(entry.name)
            nbytes += entry.size
            self._announce_removed(key, pb.REMOVAL_REASON_DROPPED)
        self._remove_later(names)
        return len(names), nbytes

    def _unlinked(self, names: list[str], failed: list[tuple[str, str]]) -> None:
        for name in names:
            left = self._unlinking.pop(name) - 1
            if left:
                self._unlinking[name] = left
        kept = {name for name, _ in failed}
        self._paid(n for n in names if n not in kept)
        for name, reason in failed:
            self._owe(name, reason)

    def _written(self, w: Write, outcome: str) -> None:
        """On the loop, after the writer thread is done with ``w``."""
        self.space.release(w.file_bytes)
        if self._writing.get(w.key) is w:
            del self._writing[w.key]
        if outcome == "written" and not w.superseded:  # a superseded one: see _replace
            self._paid([w.name])  # the rename replaced an owed file in place
            self.index.add(w.key, Entry(w.name, w.size, w.file_bytes, w.owner, w.version))
            self.stats.writes += 1
            self.stats.bytes_written += w.size
            if self.events is not None:
                self.events.stored(w.key[0], [w.key[1]], w.key[2], w.size, pb.TIER_DISK)
        elif outcome == "full":
            self.stats.skipped_full += 1
            now = time.monotonic()
            if now - self._full_logged > FULL_LOG_EVERY_S:
                self._full_logged = now
                log.warning(
                    "disk tier: %s is full; writes are skipped (memory keeps serving), %d so far",
                    self.root,
                    self.stats.skipped_full,
                )
        elif outcome in DOWN_REASONS:  # the disk refuses writes: skipped until it heals
            self.health.failed(outcome, "write")
        if w.waiter is not None and not w.waiter.done():
            w.waiter.set_result(outcome == "written")

    async def durable(self, keys: Sequence[ChunkKey], budget: float) -> None:
        """Wait (up to ``budget`` s) until the writes of ``keys`` now queued are done:
        a Store with --disk-write through --disk-sync replies once its chunks are
        durable. A skipped or failed write ends the wait too (the reply is the same:
        the chunks are in memory), and so does the budget (counted: durable_late)."""
        if not self.waits_for_writes:
            return
        waits = []
        for key in keys:
            w = self._writing.get(key)
            if w is not None:
                if w.waiter is None:
                    w.waiter = self.loop.create_future()
                waits.append(w.waiter)
        if waits:
            _, late = await asyncio.wait(waits, timeout=max(budget, 0.0))
            self.stats.durable_late += len(late)

    @property
    def waits_for_writes(self) -> bool:
        return self.mode == "through" and self.sync

    # --- Lookup and Retrieve ---
    def holds(self, namespace: str, key: bytes, layout: str | None) -> bool:
        return self.index.has(namespace, key, layout)

    async def load(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        committed: Callable[[], None],
    ) -> None:
        loaded = await self.load_pinned(namespace, layout, keys, budget)
        if loaded:
            try:
                committed()  # the caller pins its prefix while these are pinned here
            finally:
                self.store.release(loaded)

    async def load_pinned(
        self, namespace: str, layout: str, keys: list[bytes], budget: float
    ) -> list[Chunk]:
        """Bring the leading ``keys`` memory lacks and the disk holds into the store,
        within ``budget`` s: the chunks committed, read-pinned (the caller releases
        them once it pinned its prefix). A miss, a refused reservation or the budget
        spent: fewer (or none); a load that ends late still commits, unpinned."""
        todo: list[tuple[bytes, Entry]] = []
        for key in keys:
            if self.store.get(namespace, key, layout) is not None:
                continue
            entry = self.index.get((namespace, key, layout))
            if entry is None:
                break
            todo.append((key, entry))
        if not todo:
            return []
        return await self.loads.pinned(namespace, layout, todo, budget)

    def _touch(self, key: ChunkKey) -> None:
        """A chunk loaded back: its file is the most recently used."""
        self.index.touch(key)

    def _drop(self, key: ChunkKey, entry: Entry, kind: str) -> None:
        """A file that could not be read back: a miss, forgotten; quarantined unless
        it is already gone."""
        self.stats.misses += 1
        self.stats.refused[kind] = self.stats.refused.get(kind, 0) + 1
        if self.stats.refused[kind] == 1:
            log.warning("disk tier: %s refused on load (%s): a miss; logged once", entry.name, kind)
        if self.index.get(key) is entry:
            self.index.remove(key)
            gone = kind == "gone"
            self._announce_removed(
                key, pb.REMOVAL_REASON_TIER_DROPPED if gone else pb.REMOVAL_REASON_CHECK_FAILED
            )
        if kind != "gone" and key not in self._writing:
            self.reader.run(quarantine, self.root, entry.name)

    def _announce_removed(self, key: ChunkKey, reason: int) -> None:
        if self.events is not None:
            self.events.removed(key[0], [key[1]], key[2], reason, pb.TIER_DISK)
