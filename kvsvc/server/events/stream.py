"""The WatchEvents stream's server end: a watcher reads the ring from its cursor at
its own pace, and when it cannot (no cursor, another incarnation, a cursor the ring
dropped, or it fell behind while a write waited on a slow client) it gets ``lost``,
a paged snapshot taken at one point S on the loop, then live events from S + 1.

A watcher holds at most one batch being written (gRPC's flow control makes a write
wait while its client does not read): a slow client costs the server that batch and
its snapshot's references, never a queue, and never makes a Store wait."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from time import monotonic
from typing import Any

import grpc

from kvsvc.errors import NO_TRANSFER, KVServiceError, Unparsed, to_remote_error
from kvsvc.ids import new_request_id
from kvsvc.server.data.store import Chunk
from kvsvc.server.events.log import Below, EventLog
from kvsvc.server.events.ring import CLEARED, REMOVED, STORED, Event
from kvsvc.server.handlers.requests import check_namespace
from kvsvc.server.rpc.wrapper import LOGGER, Call, check_envelope_version
from kvsvc.server.security.auth import Tenant, current_tenant
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(LOGGER)
#: A quiet watcher checks the log's state at least this often (no wait is unbounded).
IDLE_WAKE_S = 1.0
#: After this long with only other namespaces' events, a batch with no events tells
#: the watcher how far it is (its cursor stays one the ring can serve).
PROGRESS_S = 0.5
#: Most visible namespace names a watcher remembers (the rest are recomputed).
VIEW_CACHE = 4096
#: Once the log ended, how long a stream may still wait on a write (a client that
#: reads nothing) before it is cancelled: the server's stop never waits on it.
END_WRITE_S = 1.0
#: Live batches kept for watchers that reach the same point (a few turns of the loop).
SHARED_BATCHES = 64


class Watchers:
    """Every WatchEvents stream of one server, fed by ``events``."""

    def __init__(self, events: EventLog, page_keys: int, linger_s: float = 0.0) -> None:
        self.events = events
        self.page_keys = page_keys
        #: --events-linger-ms: a stream's writes are at least this far apart, unless a
        #: page is full (one write then carries what was published meanwhile)
        self.linger_s = linger_s
        self._streams: set[asyncio.Task[object]] = set()
        events.on_end.append(self._ended)
        #: live batches already serialized, by (from, to, view, page): watchers with the
        #: same view at the same point of the ring share one (4 watchers: 1 build)
        self._shared: OrderedDict[tuple[Any, ...], tuple[int, bytes] | None] = OrderedDict()
        #: each stream's position in the ring (-1: resyncing), by its task: positions()
        self._at: dict[object, int] = {}

    def positions(self) -> list[int]:
        """Where each open stream is in the ring (-1: being sent a snapshot): the
        ring's last sequence minus a position is how many events that stream lags."""
        return list(self._at.values())

    def _ended(self) -> None:
        """The log ended: each stream sends what it has and its error batch; those
        still writing after END_WRITE_S (their client reads nothing) are cancelled."""

        def cut() -> None:
            for task in list(self._streams):
                task.cancel()

        self.events.loop.call_later(END_WRITE_S, cut)

    async def serve(
        self, request: pb.WatchEventsRequest | Unparsed, context: grpc.aio.ServicerContext
    ) -> None:
        """Batches until the log ends (fatal failure, shutdown) with an error batch,
        the client goes away, or a request error (bad namespace) is answered."""
        events = self.events
        request_id = request.header.request_id or new_request_id()
        events.watching += 1
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
        try:
            try:
                if isinstance(request, Unparsed):  # its bytes did not parse
                    raise request.error
                check_envelope_version(request.header)
                view, view_key = _view(current_tenant(), request, request_id)
                page = request.snapshot_page_keys or self.page_keys
                page = min(page, self.page_keys * 16)
                await self._follow(request, context, view, (view_key, page))
            except asyncio.CancelledError:
                raise
            except _ClientGone as exc:
                log.info("WatchEvents %s: the client went away (%s)", request_id, exc)
                return
            except Exception as exc:  # answered, never dropped
                if context.done():  # the client went away: nobody reads an answer
                    log.info("WatchEvents %s: the client went away (%r)", request_id, exc)
                    return
                if not isinstance(exc, KVServiceError):
                    log.error("WatchEvents %s failed", request_id, exc_info=exc)
                else:
                    log.info("WatchEvents %s ended: %s", request_id, exc)
                envelope = to_remote_error(exc, request_id, NO_TRANSFER)
                await context.write(pb.WatchEventsResponse(error=envelope))
        finally:
            events.watching -= 1
            if task is not None:
                self._streams.discard(task)
                self._at.pop(task, None)

    async def _follow(
        self,
        request: pb.WatchEventsRequest,
        context: grpc.aio.ServicerContext,
        view: Callable[[str], str | None],
        shape: tuple[Any, int],
    ) -> None:
        """``shape``: (what the view shows, page): streams of one shape see the same."""
        events = self.events
        page = shape[1]
        ring = events.ring
        cursor = request.cursor if request.HasField("cursor") else None
        position = -1  # resync first
        if (
            cursor is not None
            and cursor.incarnation == events.incarnation
            and ring.after(cursor.sequence, 0) is not None
        ):
            position = cursor.sequence
        told = position  # the last sequence the client was sent
        told_at = monotonic()
        me = asyncio.current_task()
        while True:
            self._at[me] = position
            if events.ended is not None and not (position >= 0 and ring.after(position, 1)):
                raise events.ended  # after what it has not sent yet (cleared(FATAL))
            changed = events.changed()  # before reading: no publish is missed
            batch = ring.after(position, page) if position >= 0 else None
            if batch is None:
                position = await self._resync(context, view, page)
                told, told_at = position, monotonic()
                continue
            if not batch:
                if told < position and monotonic() - told_at >= PROGRESS_S:
                    await self._write(context, pb.EventBatch(sequence=position))
                    told, told_at = position, monotonic()
                await asyncio.wait(
                    {changed}, timeout=PROGRESS_S if told < position else IDLE_WAKE_S
                )
                continue
            wait = self._lingering(told_at, len(batch), page)
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            out = self._live(position, batch, view, shape)
            position = batch[-1].seq if out is None else out[0]
            if out is not None:
                await self._write_raw(context, out[1])
                told, told_at = position, monotonic()

    def _lingering(self, told_at: float, events: int, page: int) -> float:
        """Seconds this stream waits before writing ``events`` (its linger)."""
        if not self.linger_s or events >= page:
            return 0.0
        return told_at + self.linger_s - monotonic()

    def _live(
        self,
        position: int,
        batch: list[Event],
        view: Callable[[str], str | None],
        shape: tuple[Any, int],
    ) -> tuple[int, bytes] | None:
        """_live's batch, serialized once for every stream of this shape at this point."""
        key = (position, batch[-1].seq, shape)
        shared = self._shared
        if key in shared:
            return shared[key]
        out = _live(batch, view, shape[1])
        made: tuple[int, bytes] | None = None
        if out is not None:
            out[1].incarnation = self.events.incarnation
            made = (out[0], pb.WatchEventsResponse(batch=out[1]).SerializeToString())
        shared[key] = made
        if len(shared) > SHARED_BATCHES:
            shared.popitem(last=False)
        return made

    async def _resync(
        self, context: grpc.aio.ServicerContext, view: Callable[[str], str | None], page: int
    ) -> int:
        """``lost``, then what is present at S in pages, the last ``snapshot_done``."""
        events = self.events
        events.resyncs += 1
        point, chunks, below = events.snapshot()
        await self._write(context, pb.EventBatch(sequence=point, lost=True))
        pending: pb.EventBatch | None = None
        for pending_next in _pages(point, chunks, below, view, page):
            if pending is not None:
                await self._write(context, pending)
            pending = pending_next
        last = pending or pb.EventBatch(sequence=point, snapshot=True)
        last.snapshot_done = True
        await self._write(context, last)
        return point

    async def _write(self, context: grpc.aio.ServicerContext, batch: pb.EventBatch) -> None:
        batch.incarnation = self.events.incarnation
        await self._write_raw(context, pb.WatchEventsResponse(batch=batch))

    async def _write_raw(
        self, context: grpc.aio.ServicerContext, response: pb.WatchEventsResponse | bytes
    ) -> None:
        """A response, or one already serialized (the method's serializer passes bytes)."""
        try:
            await context.write(response)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # grpc's ExecuteBatchError: the client hung up mid-write
            raise _ClientGone(repr(exc)) from exc


class _ClientGone(Exception):
    """A write failed because the watcher went away: nobody is left to answer."""


def _view(
    tenant: Tenant, request: pb.WatchEventsRequest, request_id: str
) -> tuple[Callable[[str], str | None], Any]:
    """The name a store namespace has for this watcher, or None when it must not see
    it (another tenant's, or not among the namespaces asked for); and a key equal
    for every view that shows the same names (the tenant's scope and grants, the
    namespaces asked for)."""
    call = Call(request_id, monotonic() + 1.0, False, tenant)
    wanted = {check_namespace(ns, call) for ns in request.namespaces}
    key = (tenant.name, tenant.default, tenant.namespaces, frozenset(wanted))
    prefix = tenant.scoped("")
    cache: dict[str, str | None] = {}

    def view(namespace: str) -> str | None:
        name = cache.get(namespace, "")
        if name != "":
            return name
        name = None
        if (not wanted or namespace in wanted) and namespace.startswith(prefix):
            own = namespace[len(prefix) :]
            try:
                tenant.check_namespace(own)
                name = own
            except KVServiceError:
                name = None
        if len(cache) >= VIEW_CACHE:
            cache.clear()
        cache[namespace] = name
        return name

    return view, key


def _live(
    batch: list[Event], view: Callable[[str], str | None], page: int
) -> tuple[int, pb.EventBatch] | None:
    """The visible events of ``batch`` (up to about ``page`` keys) as one EventBatch
    and the sequence it ends at; None when none is visible."""
    out = pb.EventBatch()
    keys = 0
    seq = 0
    for event in batch:
        seq = event.seq
        if event.kind == CLEARED:
            out.events.add().cleared.reason = event.value  # type: ignore[assignment]
        else:
            name = view(event.namespace)
            if name is not None:
                item = out.events.add()
                if event.kind == STORED:
                    item.stored.namespace = name
                    item.stored.keys.extend(event.keys)
                    item.stored.layout = event.layout
                    item.stored.bytes = event.value
                    item.stored.tier = event.tier  # type: ignore[assignment]
                elif event.kind == REMOVED:
                    item.removed.namespace = name
                    item.removed.keys.extend(event.keys)
                    item.removed.layout = event.layout
                    item.removed.reason = event.value  # type: ignore[assignment]
                    item.removed.tier = event.tier  # type: ignore[assignment]
                keys += len(event.keys)
        if keys >= page:
            break
    if not out.events:  # only a visible event stops the loop early: all were read
        return None
    out.sequence = seq
    return seq, out


def _pages(
    point: int,
    chunks: list[Chunk],
    below: list[Below],
    view: Callable[[str], str | None],
    page: int,
) -> Iterator[pb.EventBatch]:
    """Snapshot batches of at most ``page`` keys: runs of one namespace and layout
    become one stored event. Built one page at a time from slices of the snapshot's
    list of references (its only copy), the keys of a run added to the message in
    one call: a key costs a few tenths of a microsecond here."""
    out = pb.EventBatch(sequence=point, snapshot=True)
    room = page
    sources: list[tuple[int, list[Any]]] = [(pb.TIER_MEMORY, chunks), *below]
    for tier, items in sources:
        for start in range(0, len(items), page):
            part = items[start : start + page]
            if tier == pb.TIER_MEMORY:
                ids = [c.key for c in part]
                sizes = [c.size for c in part]
            else:
                ids = [k for k, _ in part]
                sizes = [n for _, n in part]
            for namespace, layout, lo, hi in _runs(ids):
                name = view(namespace)
                if name is None:
                    continue
                while lo < hi:
                    take = min(room, hi - lo)
                    event = out.events.add().stored
                    event.namespace, event.layout = name, layout
                    event.tier = tier  # type: ignore[assignment]
                    event.keys.extend([k[1] for k in ids[lo : lo + take]])
                    event.bytes = sum(sizes[lo : lo + take])
                    lo += take
                    room -= take
                    if room == 0:
                        yield out
                        out = pb.EventBatch(sequence=point, snapshot=True)
                        room = page
    if out.events:
        yield out


def _runs(ids: list[tuple[str, bytes, str]]) -> Iterator[tuple[str, str, int, int]]:
    """(namespace, layout, lo, hi) of each run of ``ids`` in one namespace and layout."""
    lo = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i][0] != ids[lo][0] or ids[i][2] != ids[lo][2]:
            yield ids[lo][0], ids[lo][2], lo, i
            lo = i
