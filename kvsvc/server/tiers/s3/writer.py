"""The S3 tier's write-behind: a committed chunk is read-pinned and queued
(bounded in bytes; a full queue skips the write and counts it, so a Store's
reply never waits for S3); writer threads PUT one object per chunk (header +
bytes) and unpin the chunks on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import Any

from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.tiers.s3.client import log
from kvsvc.server.tiers.s3.endpoint import WRITERS, Endpoint, Missing, Skipped
from kvsvc.server.tiers.s3.objects import header, object_name
from kvsvc.v1 import kv_cache_service_pb2 as pb


class Writer:
    """The queue and WRITERS threads that drain it."""

    def __init__(
        self, endpoint: Endpoint, store: ChunkStore, loop: asyncio.AbstractEventLoop, limit: int
    ) -> None:
        self.endpoint = endpoint
        self.store = store
        self.loop = loop
        # Pinned chunks block eviction: at most a quarter of the store waits for S3.
        self.limit = min(limit, store.capacity // 4)
        self.queued_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[Chunk | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._loop, name=f"kvsvc-s3-write-{i}", daemon=True)
            for i in range(WRITERS)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout: float) -> None:
        """Each writer ends after its PUT (queued writes are skipped and counted)."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(timeout)

    def put(self, chunk: Chunk) -> None:
        """On the loop: pin and queue ``chunk``, or skip and count it. Never waits."""
        e = self.endpoint
        with self._lock:
            take = not e.closed and self.queued_bytes + chunk.size <= self.limit
            if take:
                self.queued_bytes += chunk.size
        if not take:
            self._skip(chunk, "closing" if e.closed else "queue")
            return
        chunk.readers += 1  # the store frees nothing a writer still reads
        # What the bucket holds is the old version until the new one lands.
        e.forget(chunk.key, pb.REMOVAL_REASON_OVERWRITTEN)
        self._queue.put(chunk)

    def _skip(self, chunk: Chunk, why: str) -> None:
        self.endpoint.count(self.endpoint.skipped, why)
        self._on_loop(self.endpoint.doubt, chunk.key)

    def _loop(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                return
            try:
                self._write(chunk)
            except Exception:  # noqa: BLE001 - a writer never dies: the write is skipped, counted
                log.exception("s3 tier: a write failed")
                self._skip(chunk, "other")
            finally:
                with self._lock:
                    self.queued_bytes -= chunk.size
                self._on_loop(self.store.release, [chunk])

    def _write(self, chunk: Chunk) -> None:
        e = self.endpoint
        if e.closed:
            self._skip(chunk, "closing")
            return
        # A chunk dropped since it was queued (DropNamespace, a failed check) is not
        # written: the drop's listing may already have passed its name.
        if chunk.discarded:
            return
        namespace, key, layout = chunk.key
        name = object_name(e.prefix, namespace, layout, key)
        buf = self.store.buffer(chunk)
        body = b"".join((header(name, layout, chunk.size, chunk.digests), buf.view))

        def send(client: Any) -> None:
            client.put_object(Bucket=e.bucket, Key=name, Body=body)

        try:
            e.call(send)
        except (Skipped, Missing) as exc:
            self._skip(chunk, "unavailable" if isinstance(exc, Skipped) else "bucket")
            return
        e.add(writes=1, bytes_written=chunk.size)
        if chunk.discarded:  # dropped while it was sent: the drop's listing may have missed it
            with contextlib.suppress(Skipped, Missing):
                e.call(lambda client: client.delete_object(Bucket=e.bucket, Key=name))
            return
        self._on_loop(e.remember, chunk.key, chunk.size)

    def _on_loop(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            self.loop.call_soon_threadsafe(fn, *args)
