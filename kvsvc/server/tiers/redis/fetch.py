"""Retrieve's reads: one pipelined GET round trip per request for the keys missing
locally, within the call's deadline, on a reader thread (sync redis-py was faster
for large values, and parsing megabytes on the loop would stall every other call;
docs/benchmarks.md section 7). Verified values are loaded into the local store
as a Store would reserve and commit them, so the copy into the engine's blocks is
the usual one. The replies are read off the socket without hiredis
(connection.Replies): a value of DIRECT_MIN_BYTES or more goes straight from the
socket into a chunk reserved for it when its header arrives, each piece
CRC-checked as it lands (no copy but the kernel's); smaller ones are read into
buffers and copied in (native, without the GIL) by groups, so copying one group
overlaps reading the next. Commits follow key order and stop at the first value
that fails (the prefix)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsvc.errors import CapacityExhausted
from kvsvc.server.config import REMOTE_FETCH_GROUP_BYTES, REMOTE_FETCHERS, ServerConfig
from kvsvc.server.data.copies import SEGMENT_BYTES, ChunkBuffer
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.tiers.redis.connection import UNCONFIRMED_MAX, Connections, Replies, Stopped
from kvsvc.server.tiers.redis.health import Skipped, consume, log, warn
from kvsvc.server.tiers.redis.values import (
    BAD_CHECKSUM,
    BAD_HEADER,
    HEAD_FIXED_BYTES,
    MISSING_PART,
    Rejected,
    Value,
    header_length,
    load_into,
    parse_head,
    receive_into,
    redis_keys,
)
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: Values of at least this many bytes are read off the socket straight into their
#: chunk (reserved when their header arrives: one hand-off to the loop each);
#: smaller ones into buffers, then copied in by groups (the hand-off would cost
#: more than the copy it saves).
DIRECT_MIN_BYTES = SEGMENT_BYTES
#: How long past the fetch's budget the reader waits for the loop to reserve a
#: chunk before it stops (a loop that does not answer is not Redis' failure).
CLAIM_GRACE_S = 0.5
#: claim's answer for a value committed meanwhile by another call
_PRESENT = object()


@dataclass
class _Landed(Value):
    """A value read into the chunk claimed for it (``index``: its key's position),
    and whether every segment matched its checksum."""

    index: int = 0
    ok: bool = False


def _bulk(replies: Replies, length: int) -> memoryview:
    """A whole bulk string of ``length`` bytes, read into a buffer of its own."""
    out = np.empty(length, dtype=np.uint8).data
    replies.into(out)
    replies.end()
    return out


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
        more for the parts of values split above --remote-value-bytes); a large
        value is read straight into its chunk, smaller ones are copied in by groups
        of about REMOTE_FETCH_GROUP_BYTES as they arrive, so the copy of one group
        overlaps the reading of the next (``_stream``). ``on_commit`` is
        called on the loop each time more leading keys were committed (a Retrieve
        starts copying them into the engine's blocks then)."""
        keys = [k for k in keys if self.store.get(namespace, k, layout) is None]
        if not keys:
            return 0
        started = time.monotonic()
        epoch = self.run_epoch  # a run lost meanwhile: what it gave is announced after a recheck
        rkeys = redis_keys(self.prefix, namespace, layout, keys)
        run = _Fetch(self, namespace, layout, keys, on_commit, started + max(budget, 0.0))
        fut = self._submit(lambda r: self._stream(r, rkeys, layout, run))
        if fut is None:
            self.misses += len(keys)
            return 0
        fut.add_done_callback(lambda _: run.reader_done())
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(budget, 0.0))
        except TimeoutError:  # what arrived in time is kept; the rest is not read
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

    def _stream(self, r: Any, rkeys: list[bytes], layout: str, run: _Fetch) -> None:
        """On a reader thread: one pipelined GET of every key, its replies read off
        the socket by ``Replies`` (not hiredis). A value of DIRECT_MIN_BYTES or more
        whose header matches is read straight into a chunk the loop reserves for it
        (``run.claim``), each piece CRC-checked as it lands, then handed to
        ``run.deliver`` (already loaded); smaller ones are read into buffers and
        handed over by groups of about REMOTE_FETCH_GROUP_BYTES, to be copied in.
        Stops at the first miss or refused value, or when ``run.stop`` is set (the
        caller's budget is spent); a connection left with replies unread is closed,
        never reused mid-reply. Redis Cluster (keys on every shard) and split
        values: redis-py pipelines, then one group."""
        if self.cluster:
            run.deliver(self._get_values(r, rkeys, layout))
            return
        pool = r.connection_pool
        conn = pool.get_connection()
        replies = Replies(conn._sock, run.stop)
        read = 0  # replies read whole
        group: list[Value] = []
        size = 0
        split: list[Any] = []  # from the first split value on: the replies, unparsed
        try:
            conn.send_packed_command(conn.pack_commands([("GET", k) for k in rkeys]))
            for index, rkey in enumerate(rkeys):
                if run.stop.is_set():
                    break
                length = replies.length()
                if length is None:
                    read += 1
                    break
                if length >= DIRECT_MIN_BYTES:
                    if group:  # in key order: the values before this one first
                        run.deliver(group)
                        group, size = [], 0
                    landed = self._land(replies, rkey, layout, length, index, run)
                    if landed is None:  # refused (counted), no room, or stopped
                        break
                    if isinstance(landed, list):  # a split value: the rest as below
                        split = landed
                    else:
                        read += 1
                        continue
                else:
                    raw = _bulk(replies, length)
                    read += 1
                    try:
                        nparts, digests, first, n = parse_head(rkey, layout, raw)
                    except Rejected as exc:
                        self._count(self.rejected, exc.kind)
                        break
                    if nparts == 1 and len(first) != n:
                        self._count(self.rejected, BAD_HEADER)
                        break
                    if nparts == 1:
                        group.append(Value([first], n, digests))
                        size += n
                        if size >= REMOTE_FETCH_GROUP_BYTES:
                            run.deliver(group)
                            group, size = [], 0
                        continue
                    split = [raw]
                # a split value: the rest as before, its parts in one more round trip
                for _ in rkeys[index + 1 :]:
                    more = replies.length()
                    split.append(None if more is None else _bulk(replies, more))
                read = len(rkeys)
                break
        except Stopped:  # the caller's budget is spent: what was handed over stands
            pass
        finally:
            if read < len(rkeys) or not replies.clean:
                conn.disconnect()
            pool.release(conn)
        run.deliver(group)
        if split and not run.stop.is_set():
            run.deliver(self._values(r, rkeys[len(rkeys) - len(split) :], split, layout))

    def _land(
        self, replies: Replies, rkey: bytes, layout: str, length: int, index: int, run: _Fetch
    ) -> _Landed | list[Any] | None:
        """Read the value of ``length`` bytes replying to GET ``rkey`` (the
        ``index``-th key) straight into a chunk reserved for it, checked as it
        lands, and hand it to ``run.deliver`` (loaded, or not if it failed its
        check). Returns it; [the whole reply] for a split value (read into a
        buffer, not loaded); None when the prefix ends here (a refused header or
        checksum, counted; no room; the loop did not answer in time)."""
        try:
            head = header_length(replies.peek(HEAD_FIXED_BYTES))
            if head > length:
                raise Rejected(BAD_HEADER)
            nparts, digests, _, n = parse_head(rkey, layout, replies.peek(head))
            if nparts > 1:
                return [_bulk(replies, length)]
            if length - head != n:
                raise Rejected(BAD_HEADER)
        except Rejected as exc:
            self._count(self.rejected, exc.kind)
            return None
        replies.skip(head)
        landed = _Landed([], n, digests, index)
        where = run.claim(landed)
        if where is None:
            return None
        if not isinstance(where, ChunkBuffer):  # _PRESENT: committed meanwhile, kept
            replies.skip(n)
            replies.end()
            return landed
        landed.ok = receive_into(replies.some, where.view, where.addr, digests)
        run.deliver([landed])
        if not landed.ok:  # the rest of this value and the later ones stay unread
            self._count(self.rejected, BAD_CHECKSUM)
            return None
        replies.end()
        return landed

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
    """One fetch's values, on the loop, in key order: a group of small values is
    reserved and copied in (on the default executor) as it arrives; a large value
    gets its chunk reserved when the reader asks (``claim``) and arrives loaded.
    Chunks are committed in key order up to the first value that fails (the
    prefix) and the rest freed, whatever the caller does meanwhile; a chunk the
    reader may still be writing is freed only once the reader is done
    (``reader_done``). Committed chunks stay read-pinned until the fetch ends, so
    a later reservation cannot evict an earlier one."""

    def __init__(
        self,
        tier: Fetches,
        namespace: str,
        layout: str,
        keys: list[bytes],
        on_commit: Callable[[], None] | None = None,
        deadline: float = float("inf"),
    ) -> None:
        self.tier, self.namespace, self.layout, self.keys = tier, namespace, layout, keys
        self.on_commit = on_commit
        self.deadline = deadline  # time.monotonic(): the reader waits for a claim until then
        self.stop = threading.Event()  # set: the reader reads no more replies
        self.good = 0  # leading keys loaded (or committed meanwhile by another call)
        self.loaded_bytes = 0
        self.found: list[tuple[bytes, int]] = []  # (key, bytes) read from the tier, verified
        self._arrived = 0  # values delivered (or claimed) so far
        # (values, indexes of those to copy, their (chunk, value), the copy)
        self._groups: list[
            tuple[int, list[int], list[tuple[Chunk, Value]], asyncio.Future[Any]]
        ] = []
        # claimed chunks by key index: the chunk, and its "copy" (set once it landed)
        self._landing: dict[int, tuple[Chunk, asyncio.Future[Any]]] = {}
        self._writing: dict[int, Chunk] = {}  # id -> chunk the reader may write into
        self._orphans: list[Chunk] = []  # given up while the reader may write: freed after
        self._reading = True  # the reader thread has not ended
        self._pinned: list[Chunk] = []
        self._ended = False  # the prefix ended: later values are dropped
        self._closed = False  # the exchange is over (or the caller stopped waiting)
        self._done: asyncio.Future[int] = tier.loop.create_future()

    def deliver(self, values: list[Value]) -> None:
        """From the reader thread: the next values, in key order (or a value read
        into its claimed chunk: ``_Landed``)."""
        if values:
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing to load into
                self.tier.loop.call_soon_threadsafe(self._arrive, values)

    def claim(self, value: _Landed) -> ChunkBuffer | object | None:
        """From the reader thread: a chunk for the next value (``value.index``) to
        be read into; _PRESENT if it was committed meanwhile (skip its bytes), None
        if the prefix ends here (no room, the fetch is over, or the loop did not
        answer by the deadline)."""
        answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            self.tier.loop.call_soon_threadsafe(self._claim, value, answer)
        except RuntimeError:  # a closed loop
            return None
        try:
            return answer.result(max(0.0, self.deadline - time.monotonic()) + CLAIM_GRACE_S)
        except concurrent.futures.TimeoutError:  # a late answer's chunk: freed by reader_done
            return None

    def _claim(self, value: _Landed, answer: concurrent.futures.Future[Any]) -> None:
        index = self._arrived
        self._arrived += 1
        if self._ended or self._closed or index != value.index:
            answer.set_result(None)
            return
        store = self.tier.store
        key = self.keys[index]
        if store.get(self.namespace, key, self.layout) is not None:
            present = self.tier.loop.create_future()
            present.set_result([])
            self._groups.append((1, [], [], present))
            present.add_done_callback(lambda _: self._settle())
            answer.set_result(_PRESENT)
            return
        try:
            chunks, _ = store.reserve(
                self.namespace, [(key, value.size)], self.layout, origin="redis"
            )
        except CapacityExhausted as exc:  # no room now: the prefix ends here
            self.tier._count(self.tier.errors, "capacity")
            warn.warning("remote tier: no room in the local store for fetched chunks: %s", exc)
            self._end()
            answer.set_result(None)
            return
        chunk = chunks[0]
        landing = self.tier.loop.create_future()
        self._landing[index] = (chunk, landing)
        self._writing[id(chunk)] = chunk
        self._groups.append((1, [0], [(chunk, value)], landing))
        landing.add_done_callback(lambda _: self._settle())
        answer.set_result(store.buffer(chunk))

    def _landed(self, values: list[_Landed]) -> None:
        """Values read into their claimed chunks (the reader writes them no more)."""
        for value in values:
            chunk, landing = self._landing.pop(value.index, (None, None))
            if chunk is None or landing is None:
                continue
            if landing.done():  # given up meanwhile (close): freed by reader_done
                continue
            self._writing.pop(id(chunk), None)
            landing.set_result([value.ok])

    def reader_done(self) -> None:
        """The reader thread ended: the chunks it may have been writing are free to
        go; those still waiting to land never will."""
        self._reading = False
        self._writing.clear()
        store = self.tier.store
        for chunk in self._orphans:
            store.abort(chunk)
        self._orphans.clear()
        for _, landing in self._landing.values():
            if not landing.done():
                landing.set_result([])
        self._landing.clear()

    def _free(self, chunk: Chunk) -> None:
        """Free a reserved chunk that will not be committed, once nothing writes it."""
        if id(chunk) in self._writing:
            self._orphans.append(chunk)
        else:
            self.tier.store.abort(chunk)

    def _arrive(self, values: list[Value]) -> None:
        if isinstance(values[0], _Landed):
            self._landed(values)  # type: ignore[arg-type]
            return
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
                    self._free(chunk)
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
        """The exchange is over: no more values are taken (a value still landing is
        not loaded; its chunk is freed once the reader is done with it)."""
        self._closed = True
        self.stop.set()
        for _, landing in self._landing.values():
            if not landing.done():
                landing.set_result([])
        self._finish_if_over()

    async def settled(self) -> int:
        """Leading keys loaded, once every group is committed or freed."""
        return await asyncio.shield(self._done)
