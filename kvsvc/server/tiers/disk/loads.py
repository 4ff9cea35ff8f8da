"""Retrieve's loads from the disk tier: the chunks reserved in the store, read and
checked on the reader threads (kvsvc.server.tiers.disk.reader), awaited within
the caller's budget, then committed in key order up to the first failure. A load
that ends after its caller gave up still commits, unpinned. Runs on the loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvsvc.server.data.store import Chunk, ChunkKey, ChunkStore
from kvsvc.server.tiers.disk.index import Entry
from kvsvc.server.tiers.disk.reader import Job, Outcome, Reader
from kvsvc.server.tiers.disk.stats import DiskStats

log = logging.getLogger("kvsvc.server.tiers.disk")


class Loads:
    """The tier's loads into the store; what the tier's index learns of them goes
    back through ``touched`` (a chunk loaded) and ``unreadable`` (a file that
    failed: key, entry, kind)."""

    def __init__(
        self,
        store: ChunkStore,
        loop: asyncio.AbstractEventLoop,
        reader: Reader,
        stats: DiskStats,
        touched: Callable[[ChunkKey], None],
        unreadable: Callable[[ChunkKey, Entry, str], None],
    ) -> None:
        self.store, self.loop, self.reader, self.stats = store, loop, reader, stats
        self._touched = touched
        self._unreadable = unreadable

    async def pinned(
        self, namespace: str, layout: str, todo: list[tuple[bytes, Entry]], budget: float
    ) -> list[Chunk]:
        """Load ``todo`` (keys and their files, in order) within ``budget`` s: the
        chunks committed, read-pinned for the caller; fewer (or none) after a
        failure, a refused reservation or the budget spent."""
        jobs = self.reader.reserve(namespace, layout, todo)
        if jobs is None:
            self.stats.load_refused += 1
            return []
        state = {"waiting": True}
        settled: asyncio.Future[list[Chunk]] = self.loop.create_future()

        def done(read: asyncio.Future[list[Outcome]]) -> None:
            outcomes: list[Outcome] = []
            if read.cancelled():
                pass
            elif read.exception() is not None:
                log.error("disk tier: a load failed", exc_info=read.exception())
            else:
                outcomes = read.result()
            settled.set_result(self._settle(jobs, outcomes, pin=state["waiting"]))

        self.reader.read(jobs).add_done_callback(done)
        try:
            return await asyncio.wait_for(asyncio.shield(settled), max(budget, 0.0))
        except BaseException as exc:
            state["waiting"] = False
            if settled.done():  # pinned for a caller that is gone
                self.store.release(settled.result())
            if isinstance(exc, TimeoutError):
                self.stats.load_late += 1
                return []
            raise

    def _settle(self, jobs: list[Job], outcomes: list[Outcome], *, pin: bool) -> list[Chunk]:
        """Commit the loaded chunks in key order up to the first failure, free the
        rest; forget (and quarantine) the files that failed."""
        committed: list[Chunk] = []
        ok = True
        for i, job in enumerate(jobs):
            chunk = job.chunk
            digests, kind = outcomes[i] if i < len(outcomes) else (None, None)
            if ok and digests is not None:
                if self.store.commit(chunk, digests):  # else: another call's is there
                    self.stats.hits += 1
                    self.stats.bytes_read += chunk.size
                    if pin:
                        chunk.readers += 1
                        committed.append(chunk)
                self._touched(chunk.key)
                continue
            ok = False
            self.store.abort(chunk)
            if kind is not None:
                self._unreadable(chunk.key, job.entry, kind)
        return committed
