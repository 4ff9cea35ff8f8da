"""Retrieve's reads: one pipelined GET round trip per request for the keys missing
locally, within the call's deadline, on a reader thread (sync redis-py was faster
for large values, and parsing megabytes on the loop would stall every other call;
docs/benchmarks.md section 7). Verified values are copied into the local store
as a Store would reserve and commit them, so the copy into the engine's blocks is
the usual one. The replies go to that copy (native, without the GIL) in groups as
they are read, so copying one group overlaps reading the next; commits follow
key order and stop at the first value that fails (the prefix)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from kvsvc.errors import CapacityExhausted
from kvsvc.server.config import REMOTE_FETCH_GROUP_BYTES, REMOTE_FETCHERS, ServerConfig
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.tiers.redis.connection import UNCONFIRMED_MAX, Connections
from kvsvc.server.tiers.redis.health import Skipped, consume, log, warn
from kvsvc.server.tiers.redis.values import (
    BAD_HEADER,
    MISSING_PART,
    Rejected,
    Value,
    load_into,
    parse_head,
    redis_keys,
)
from kvsvc.v1 import kv_cache_service_pb2 as pb


class Fetches(Connections):
    """Retrieve's reads on REMOTE_FETCHERS reader threads."""

    def __init__(
        self, config: ServerConfig, store: ChunkStore, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(config, store, loop)
        self._fetching = 0
        self._fetchers = concurrent.futures.ThreadPoolExecutor(
            REMOTE_FETCHERS, thread_name_prefix="kvsvc-remote-read"
        )

    async def fetch(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        on_commit: Callable[[], None] | None = None,
    ) -> int:
        """Bring ``keys`` missing from the local store, verified, from Redis into it up
        to the first miss (reserved as a Store reserves; a refused reservation is a
        miss). Returns how many were loaded. One pipelined GET round trip (and one
        more for the parts of values split above --remote-value-bytes); the replies
        are copied in by groups of about REMOTE_FETCH_GROUP_BYTES as they arrive, so
        the copy of one group overlaps the reading of the next. ``on_commit`` is
        called on the loop each time more leading keys were committed (a Retrieve
        starts copying them into the engine's blocks then)."""
        keys = [k for k in keys if self.store.get(namespace, k, layout) is None]
        if not keys:
            return 0
        started = time.monotonic()
        epoch = self.run_epoch  # a run lost meanwhile: what it gave is announced after a recheck
        rkeys = redis_keys(self.prefix, namespace, layout, keys)
        run = _Fetch(self, namespace, layout, keys, on_commit)
        fut = self._submit(lambda r: self._stream(r, rkeys, layout, run.deliver, run.stop))
        if fut is None:
            self.misses += len(keys)
            return 0
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(budget, 0.0))
        except asyncio.TimeoutError:  # what arrived in time is kept; the rest is not read
            self._count(self.errors, "budget")
            fut.add_done_callback(consume)
        except Skipped:  # failed (counted): what arrived before the failure is kept
            pass
        finally:
            run.close()
        read = time.monotonic()
        good = await run.settled()
        self.misses += len(keys) - good
        self.hits += good
        self.bytes_read += run.loaded_bytes
        if self.events is not None:  # what this server now knows of the tier
            if run.found and self.doubted(epoch):
                if len(self.unconfirmed) < UNCONFIRMED_MAX:
                    self.unconfirmed += [(namespace, k, layout, n) for k, n in run.found]
            elif run.found:
                found = [k for k, _ in run.found]
                nbytes = sum(n for _, n in run.found)
                self.events.stored(namespace, found, layout, nbytes, pb.TIER_REDIS)
            if good < len(keys):  # no longer vouched for (a miss, a failure, the budget)
                self.events.removed(
                    namespace, keys[good:], layout, pb.REMOVAL_REASON_TIER_DROPPED, pb.TIER_REDIS
                )
        log.debug(
            "remote tier: %d chunks fetched in %.1f ms (replies read in %.1f ms)",
            good,
            1e3 * (time.monotonic() - started),
            1e3 * (read - started),
        )
        return good

    def _submit(self, fn: Callable[[Any], Any]) -> asyncio.Future[Any] | None:
        """Run an exchange on a reader thread; None (busy, counted) when every reader
        is still waiting on Redis, so a stuck Redis never queues up requests."""
        if self._turned_away(self._fetching):
            return None

        def run() -> Any:
            try:
                return self._call(fn)
            finally:
                self.loop.call_soon_threadsafe(self._done_fetching)

        self._fetching += 1
        try:
            return asyncio.wrap_future(self._fetchers.submit(run), loop=self.loop)
        except RuntimeError:  # shut down
            self._fetching -= 1
            return None

    def _done_fetching(self) -> None:
        self._fetching -= 1

    def _stop_fetchers(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)

    def _copy_in(self, pairs: list[tuple[Chunk, Value]]) -> list[bool]:
        """Copy and verify each fetched value into its reserved chunk: whether it
        matched; stops at the first that does not (the prefix ends there)."""
        out = []
        for chunk, value in pairs:
            try:
                buf = self.store.buffer(chunk)
                load_into(buf.view, value.parts, value.digests, buf.addr)
                out.append(True)
            except Rejected as exc:
                self._count(self.rejected, exc.kind)
                break
        return out

    def _stream(
        self,
        r: Any,
        rkeys: list[bytes],
        layout: str,
        deliver: Callable[[list[Value]], None],
        stop: threading.Event,
    ) -> None:
        """On a reader thread: one pipelined GET of every key; each group of about
        REMOTE_FETCH_GROUP_BYTES of leading values whose header matches goes to
        ``deliver`` as soon as its replies are read. Stops at the first miss or
        refused value, or when ``stop`` is set (the caller's budget is spent); a
        connection left with replies unread is closed, never reused mid-reply.
        Redis Cluster (keys on every shard) and split values: redis-py pipelines,
        then one group."""
        if self.cluster:
            deliver(self._get_values(r, rkeys, layout))
            return
        pool = r.connection_pool
        conn = pool.get_connection()
        read = 0
        group: list[Value] = []
        size = 0
        split: list[Any] = []  # from the first split value on: the replies, unparsed
        try:
            conn.send_packed_command(conn.pack_commands([("GET", k) for k in rkeys]))
            for rkey in rkeys:
                if stop.is_set():
                    break
                raw = conn.read_response()
                read += 1
                if raw is None:
                    break
                try:
                    nparts, digests, first, n = parse_head(rkey, layout, raw)
                except Rejected as exc:
                    self._count(self.rejected, exc.kind)
                    break
                if nparts > 1:  # the rest as before: parts in one more round trip
                    split = [raw] + [conn.read_response() for _ in rkeys[read:]]
                    read = len(rkeys)
                    break
                if len(first) != n:
                    self._count(self.rejected, BAD_HEADER)
                    break
                group.append(Value([first], n, digests))
                size += n
                if size >= REMOTE_FETCH_GROUP_BYTES:
                    deliver(group)
                    group, size = [], 0
        finally:
            if read < len(rkeys):
                conn.disconnect()
            pool.release(conn)
        deliver(group)
        if split and not stop.is_set():
            deliver(self._values(r, rkeys[len(rkeys) - len(split) :], split, layout))

    def _get_values(self, r: Any, rkeys: list[bytes], layout: str) -> list[Value]:
        """GET the first key of each value (pipelined), then the parts of split ones."""
        pipe = r.pipeline(transaction=False)
        for k in rkeys:
            pipe.get(k)
        return self._values(r, rkeys, pipe.execute(), layout)

    def _values(self, r: Any, rkeys: list[bytes], raws: list[Any], layout: str) -> list[Value]:
        """The leading values of ``raws`` (replies to GET ``rkeys``) whose header
        matches and whose parts are all there, the parts fetched in one pipelined
        round trip (their checksums are checked as they are copied in)."""
        heads: list[tuple[int, list[int], memoryview, int]] = []
        for rkey, raw in zip(rkeys, raws, strict=True):
            if raw is None:
                break
            try:
                heads.append(parse_head(rkey, layout, raw))
            except Rejected as exc:
                self._count(self.rejected, exc.kind)
                break
        extra = [(i, p) for i, h in enumerate(heads) for p in range(1, h[0])]
        more: dict[tuple[int, int], Any] = {}
        if extra:
            pipe = r.pipeline(transaction=False)
            for i, p in extra:
                pipe.get(rkeys[i] + b":%d" % p)
            more = dict(zip(extra, pipe.execute(), strict=True))
        out: list[Value] = []
        for i, (nparts, digests, first, n) in enumerate(heads):
            parts = [first] + [more[(i, p)] for p in range(1, nparts)]
            if any(p is None for p in parts):
                self._count(self.rejected, MISSING_PART)
                break
            views = [memoryview(p) for p in parts]
            if sum(len(v) for v in views) != n:
                self._count(self.rejected, BAD_HEADER)
                break
            out.append(Value(views, n, digests))
        return out


class _Fetch:
    """One fetch's groups of values, on the loop: each group is reserved and copied
    in (on the default executor) as it arrives; chunks are committed in key order
    up to the first value that fails (the prefix) and the rest freed, whatever the
    caller does meanwhile. Committed chunks stay read-pinned until the fetch ends,
    so a later group's reservation cannot evict an earlier one."""

    def __init__(
        self,
        tier: Fetches,
        namespace: str,
        layout: str,
        keys: list[bytes],
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        self.tier, self.namespace, self.layout, self.keys = tier, namespace, layout, keys
        self.on_commit = on_commit
        self.stop = threading.Event()  # set: the reader reads no more replies
        self.good = 0  # leading keys loaded (or committed meanwhile by another call)
        self.loaded_bytes = 0
        self.found: list[tuple[bytes, int]] = []  # (key, bytes) read from the tier, verified
        self._arrived = 0  # values delivered so far
        # (values, indexes of those to copy, their (chunk, value), the copy)
        self._groups: list[
            tuple[int, list[int], list[tuple[Chunk, Value]], asyncio.Future[Any]]
        ] = []
        self._pinned: list[Chunk] = []
        self._ended = False  # the prefix ended: later values are dropped
        self._closed = False  # the exchange is over (or the caller stopped waiting)
        self._done: asyncio.Future[int] = tier.loop.create_future()

    def deliver(self, values: list[Value]) -> None:
        """From the reader thread: the next values, in key order."""
        if values:
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing to load into
                self.tier.loop.call_soon_threadsafe(self._arrive, values)

    def _arrive(self, values: list[Value]) -> None:
        first = self._arrived
        self._arrived += len(values)
        if self._ended or self._closed:
            return
        store = self.tier.store
        keys = self.keys[first : first + len(values)]
        todo = [j for j, k in enumerate(keys) if store.get(self.namespace, k, self.layout) is None]
        try:
            chunks, _ = (
                store.reserve(
                    self.namespace,
                    [(keys[j], values[j].size) for j in todo],
                    self.layout,
                    origin="redis",
                )
                if todo
                else ([], 0)
            )
        except CapacityExhausted as exc:  # no room now: the prefix ends here
            self.tier._count(self.tier.errors, "capacity")
            warn.warning("remote tier: no room in the local store for fetched chunks: %s", exc)
            self._end()
            return
        pairs = [(c, values[j]) for c, j in zip(chunks, todo, strict=True)]
        copy: asyncio.Future[Any]
        if pairs:  # not on the reader threads: they may all be waiting on a slow Redis
            copy = self.tier.loop.run_in_executor(None, self.tier._copy_in, pairs)
        else:
            copy = self.tier.loop.create_future()
            copy.set_result([])
        self._groups.append((len(values), todo, pairs, copy))
        copy.add_done_callback(lambda _: self._settle())

    def _end(self) -> None:
        self._ended = True
        self.stop.set()

    def _settle(self) -> None:
        """Commit (or free) the groups whose copies ended, in key order."""
        store = self.tier.store
        good = self.good
        while self._groups and self._groups[0][3].done():
            count, todo, pairs, copy = self._groups.pop(0)
            verified: list[bool] = []
            if not copy.cancelled():
                if copy.exception() is None:
                    verified = copy.result()
                else:  # a failed copy-in is a miss
                    exc = copy.exception()
                    log.error("remote tier: copying fetched chunks in failed", exc_info=exc)
            slot = {j: pos for pos, j in enumerate(todo)}
            for j in range(count):
                pos = slot.get(j)
                if pos is None:  # committed meanwhile by another call: kept
                    self.good += not self._ended
                    continue
                chunk, value = pairs[pos]
                if self._ended or pos >= len(verified) or not verified[pos]:
                    store.abort(chunk)
                    self._end()
                    continue
                self.found.append((chunk.key[1], value.size))
                if store.commit(chunk, value.digests):
                    chunk.readers += 1
                    self._pinned.append(chunk)
                    self.loaded_bytes += value.size
                self.good += 1
        if self.good > good and self.on_commit is not None:
            self.on_commit()
        self._finish_if_over()

    def _finish_if_over(self) -> None:
        if self._closed and not self._groups and not self._done.done():
            self.tier.store.release(self._pinned)
            self._done.set_result(self.good)

    def close(self) -> None:
        """The exchange is over: no more values are taken."""
        self._closed = True
        self.stop.set()
        self._finish_if_over()

    async def settled(self) -> int:
        """Leading keys loaded, once every group is committed or freed."""
        return await asyncio.shield(self._done)
