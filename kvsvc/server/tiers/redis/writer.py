"""Write-behind: a committed chunk is read-pinned and queued (bounded in bytes; a
full queue drops the write and counts it, so a Store's reply never waits for
Redis); writer threads build the values in a reused buffer, send them
(pipelined, redis-py's packer that does not copy them again) and unpin the
chunks on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import Any

from kvsvc.server.config import REMOTE_WRITE_BATCH_BYTES, REMOTE_WRITERS, ServerConfig
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.tiers.redis.connection import UNCONFIRMED_MAX, Connections
from kvsvc.server.tiers.redis.health import Skipped
from kvsvc.server.tiers.redis.values import Staging, encode, header_bytes, redis_key
from kvsvc.v1 import kv_cache_service_pb2 as pb


@dataclass
class _Write:
    namespace: str
    key: bytes
    layout: str
    chunk: Chunk


class WriteBehind(Connections):
    """The queue and REMOTE_WRITERS threads that drain it (started by ``_start_writers``)."""

    def __init__(
        self, config: ServerConfig, store: ChunkStore, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(config, store, loop)
        # Pinned chunks block eviction: at most a quarter of the store waits for Redis.
        self.queue_limit = min(config.tiers.remote_queue_bytes, store.capacity // 4)
        self.queued_bytes = 0
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self._queued_lock = threading.Lock()
        self._writers = [
            threading.Thread(target=self._write_loop, name=f"kvsvc-remote-write-{i}", daemon=True)
            for i in range(REMOTE_WRITERS)
        ]

    def write_behind(self, chunk: Chunk) -> None:
        """On the loop, once ``chunk`` is committed here: pin and queue it, or drop
        and count it when the queue is full. Never waits."""
        with self._queued_lock:
            take = not self._closed and self.queued_bytes + chunk.size <= self.queue_limit
            if take:
                self.queued_bytes += chunk.size
        if not take:
            self._drop(1, "closing" if self._closed else "queue")
            return
        chunk.readers += 1  # the store frees nothing a writer still reads
        namespace, key, layout = chunk.key
        self._queue.put(_Write(namespace, key, layout, chunk))

    def _drop(self, n: int, why: str) -> None:
        """Count ``n`` writes never made, and why (GetServerInfo's skipped writes)."""
        with self._stats_lock:
            self.dropped_writes += n
            self.skipped[why] = self.skipped.get(why, 0) + n

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def _start_writers(self) -> None:
        for t in self._writers:
            t.start()

    def _stop_writers(self) -> None:
        """Once the tier is closed: each writer ends after its batch (queued writes
        are dropped and counted)."""
        for _ in self._writers:
            self._queue.put(None)
        for t in self._writers:
            t.join(self.timeout * 4 + 1)

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
            self._drop(len(writes), "closing")
            return
        # A chunk dropped since it was queued (its namespace dropped, a failed check)
        # is not written: DropNamespace's scan may already have passed its key.
        writes = [w for w in writes if not w.chunk.discarded]
        if not writes:
            return
        # Each chunk's first value: header + bytes, at most part_bytes.
        stage.reset(
            sum(
                min(self.part_bytes, header_bytes(w.layout, len(w.chunk.digests)) + w.chunk.size)
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

        epoch = self.run_epoch  # the Redis run this write is sent to, as far as known
        try:
            self._call(send)
        except Skipped:
            self._drop(len(writes), "unavailable")
            return
        self._add(writes=len(writes), bytes_written=sum(w.chunk.size for w in writes))
        if self.events is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody watches
                self.loop.call_soon_threadsafe(self._announce, writes, epoch)

    def _announce(self, writes: list[_Write], epoch: int) -> None:
        """On the loop: the written chunks are now in the tier (EventLog.stored); if
        Redis' run came into doubt meanwhile (it may have been the run that was lost),
        only once the run now serving is seen to hold them (Runs rechecks)."""
        assert self.events is not None
        if self.doubted(epoch):
            if len(self.unconfirmed) < UNCONFIRMED_MAX:  # beyond: never announced
                self.unconfirmed += [(w.namespace, w.key, w.layout, w.chunk.size) for w in writes]
            return
        for w in writes:
            if w.chunk.discarded:  # dropped since (DropNamespace unlinks it): not news
                continue
            self.events.stored(w.namespace, (w.key,), w.layout, w.chunk.size, pb.TIER_REDIS)

    def _unpin(self, chunks: list[Chunk]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the store goes with it
            self.loop.call_soon_threadsafe(self.store.release, chunks)
