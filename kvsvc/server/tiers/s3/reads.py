"""Retrieve's reads from S3: one GET per missing chunk, READERS at a time on
their own threads, within the call's budget. Each object's header is read and
checked first; the loop then reserves the chunk, and the body is read straight
into it, each store segment CRC-checked as it lands (no copy but the kernel's).
Chunks are committed in key order up to the first that failed (the prefix), each
run as soon as it is read, so a Retrieve copies it out while later ones are
still read; a read still running when the budget is spent is left to end by
itself (bounded by --s3-timeout) and its chunk freed then."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvsvc.errors import CapacityExhausted
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.tiers.s3.client import BUSY, warn
from kvsvc.server.tiers.s3.endpoint import READERS, Endpoint, Missing, Skipped
from kvsvc.server.tiers.s3.objects import (
    HEAD_FIXED_BYTES,
    TRUNCATED,
    Rejected,
    header_length,
    object_name,
    parse_header,
    receive_into,
)
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: How long past its budget a reader waits for the loop to reserve its chunk.
CLAIM_GRACE_S = 0.5
#: reads queued or running at once beyond which a new load is a miss at once (a
#: stuck endpoint never queues up requests; a read queued past its load's
#: deadline ends without asking S3)
READS_MAX = READERS * 4


@dataclass
class _Job:
    """One chunk's GET: what it was asked, and how it ended."""

    namespace: str
    key: bytes
    layout: str
    deadline: float
    chunk: Chunk | None = None
    digests: list[int] | None = None
    present: bool = False  # committed meanwhile by another call
    abandoned: bool = False  # the load is over: a chunk it reserved is freed
    done: asyncio.Future[None] | None = None  # None: nothing to read


class Reads:
    """The readers' threads and the loads in flight."""

    def __init__(
        self, endpoint: Endpoint, store: ChunkStore, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.endpoint = endpoint
        self.store = store
        self.loop = loop
        self.inflight = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            READERS, thread_name_prefix="kvsvc-s3-read"
        )

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def load(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        committed: Callable[[], None],
    ) -> None:
        """Bring the leading ``keys`` memory lacks into it, verified, within
        ``budget`` s. Each run of chunks read in key order is committed as soon as
        it is (``committed`` runs while they are pinned here), so a Retrieve
        copies them out while later ones are still read."""
        e = self.endpoint
        deadline = time.monotonic() + max(budget, 0.0)
        if self.inflight >= READS_MAX:  # earlier loads still wait on S3: a miss at once
            e.count(e.errors, BUSY)
            return
        jobs: list[_Job] = []
        for key in keys:
            if self.store.get(namespace, key, layout) is not None:
                jobs.append(_Job(namespace, key, layout, deadline, present=True))
                continue
            if (namespace, key, layout) in e.stale:  # its newest version never landed
                e.count(e.rejected, "stale")
                break
            job = _Job(namespace, key, layout, deadline, done=self.loop.create_future())
            self._submit(job)
            jobs.append(job)
        settled = 0
        while settled < len(jobs):
            done = jobs[settled].done
            left = deadline - time.monotonic()
            if done is not None and not done.done() and left > 0:
                await asyncio.wait([done], timeout=left)
            n = self._commit_ready(jobs, settled, committed)
            if n == 0:  # jobs[settled] failed, or the budget is spent
                break
            settled += n
        self._abandon(jobs[settled:])

    def _submit(self, job: _Job) -> None:
        done = job.done
        assert done is not None
        self.inflight += 1

        def ended(_: Any) -> None:
            self.inflight -= 1
            if job.abandoned and job.chunk is not None:
                self.store.abort(job.chunk)
                job.chunk = None
            if not done.done():
                done.set_result(None)

        try:
            fut = self._pool.submit(self._read, job)
        except RuntimeError:  # shut down: a miss
            self.inflight -= 1
            done.set_result(None)
            return
        fut.add_done_callback(lambda f: self._soon(ended, f))

    def _soon(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the store goes with it
            self.loop.call_soon_threadsafe(fn, *args)

    def _commit_ready(self, jobs: list[_Job], first: int, committed: Callable[[], None]) -> int:
        """Commit the run of chunks read from ``jobs[first]`` on, in key order, up
        to the first not read (yet); ``committed`` once for the run. How many jobs
        it took (0: ``jobs[first]`` is not read)."""
        e = self.endpoint
        pinned: list[Chunk] = []
        n = 0
        for job in jobs[first:]:
            if job.present:
                n += 1
                continue
            if job.done is None or not job.done.done() or job.digests is None:
                break
            chunk = job.chunk
            assert chunk is not None
            job.chunk = None
            n += 1
            if self.store.commit(chunk, job.digests):  # else: another call's is there
                e.add(hits=1, bytes_read=chunk.size)
                e.remember(chunk.key, chunk.size)
                chunk.readers += 1
                pinned.append(chunk)
        if pinned:
            try:
                committed()  # the caller pins its prefix while these are pinned here
            finally:
                self.store.release(pinned)
        return n

    def _abandon(self, jobs: list[_Job]) -> None:
        """The jobs after the prefix: misses; their chunks freed (those still
        reading: once they end)."""
        e = self.endpoint
        for job in jobs:
            if job.present:
                continue
            e.add(misses=1)
            job.abandoned = True
            if job.done is not None and job.done.done() and job.chunk is not None:
                self.store.abort(job.chunk)
                job.chunk = None

    # --- on a reader thread ---
    def _read(self, job: _Job) -> None:
        """GET the object, check its header, have the loop reserve its chunk, read
        the body into it checking each segment; job.digests set when it matched."""
        e = self.endpoint
        name = object_name(e.prefix, job.namespace, job.layout, job.key)
        ck = (job.namespace, job.key, job.layout)
        if job.abandoned or time.monotonic() > job.deadline:
            return

        def get(client: Any) -> list[int] | None:
            reply = client.get_object(Bucket=e.bucket, Key=name)
            body = reply["Body"]
            try:
                return self._receive(job, name, int(reply["ContentLength"]), body)
            finally:
                body.close()

        try:
            job.digests = e.call(get)
        except Rejected as exc:
            e.count(e.rejected, exc.kind)
            warn.warning("s3 tier: object %s refused (%s): a miss", name, exc.kind)
            self._soon(e.forget, ck, pb.REMOVAL_REASON_CHECK_FAILED)
        except Missing:
            self._soon(e.forget, ck, pb.REMOVAL_REASON_TIER_DROPPED)
        except Skipped:
            pass

    def _receive(self, job: _Job, name: str, length: int, body: Any) -> list[int] | None:
        fixed = _read_exact(body, HEAD_FIXED_BYTES)
        head_len = header_length(fixed)
        if head_len > length:
            raise Rejected(TRUNCATED)
        n, digests = parse_header(
            name, job.layout, fixed + _read_exact(body, head_len - len(fixed))
        )
        if length != head_len + n:
            raise Rejected(TRUNCATED)
        chunk = self._claim(job, n)
        if chunk is None:
            return None
        buf = self.store.buffer(chunk)
        receive_into(body.readinto, buf.view, buf.addr, digests)
        return digests

    def _claim(self, job: _Job, size: int) -> Chunk | None:
        """The loop reserves ``size`` bytes for the job's chunk (None: no room, the
        load is over, or it was committed meanwhile)."""
        answer: concurrent.futures.Future[Chunk | None] = concurrent.futures.Future()

        def reserve() -> None:
            if job.abandoned:
                answer.set_result(None)
            elif self.store.get(job.namespace, job.key, job.layout) is not None:
                job.present = True
                answer.set_result(None)
            else:
                try:
                    chunks, _ = self.store.reserve(
                        job.namespace, [(job.key, size)], job.layout, origin="s3"
                    )
                except CapacityExhausted as exc:
                    self.endpoint.count(self.endpoint.errors, "capacity")
                    warn.warning("s3 tier: no room in the local store for read chunks: %s", exc)
                    answer.set_result(None)
                    return
                job.chunk = chunks[0]
                answer.set_result(job.chunk)

        self._soon(reserve)
        try:
            return answer.result(max(0.0, job.deadline - time.monotonic()) + CLAIM_GRACE_S)
        except concurrent.futures.TimeoutError:  # a late reservation is freed once it ends
            return None


def _read_exact(body: Any, n: int) -> bytes:
    """``n`` bytes of ``body``; Rejected (truncated) if it ends first."""
    out = b""
    while len(out) < n:
        got = body.read(n - len(out))
        if not got:
            raise Rejected(TRUNCATED)
        out += got
    return out
