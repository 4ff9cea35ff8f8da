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
from collections.abc import Callable, Iterator
from time import monotonic

import grpc

from kvsvc.errors import NO_TRANSFER, KVServiceError, to_remote_error
from kvsvc.ids import new_request_id
from kvsvc.server.auth import Tenant, current_tenant
from kvsvc.server.checks import check_namespace
from kvsvc.server.data.store import Chunk
from kvsvc.server.events.log import EventLog, RemoteKey
from kvsvc.server.events.ring import CLEARED, REMOVED, STORED, Event
from kvsvc.server.rpc import LOGGER, Call
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(LOGGER)
#: A quiet watcher checks the log's state at least this often (no wait is unbounded).
IDLE_WAKE_S = 1.0
#: After this long with only other namespaces' events, a batch with no events tells
#: the watcher how far it is (its cursor stays one the ring can serve).
PROGRESS_S = 0.5
#: Most visible namespace names a watcher remembers (the rest are recomputed).
VIEW_CACHE = 4096


class Watchers:
    """Every WatchEvents stream of one server, fed by ``events``."""

    def __init__(self, events: EventLog, page_keys: int) -> None:
        self.events = events
        self.page_keys = page_keys

    async def serve(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Batches until the log ends (fatal failure, shutdown) with an error batch,
        the client goes away, or a request error (bad namespace) is answered."""
        events = self.events
        request_id = request.header.request_id or new_request_id()
        events.watching += 1
        try:
            try:
                view = _view(current_tenant(), request, request_id)
                page = request.snapshot_page_keys or self.page_keys
                page = min(page, self.page_keys * 16)
                await self._follow(request, context, view, page)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # answered, never dropped
                if not isinstance(exc, KVServiceError):
                    log.error("WatchEvents %s failed", request_id, exc_info=exc)
                else:
                    log.info("WatchEvents %s ended: %s", request_id, exc)
                envelope = to_remote_error(exc, request_id, NO_TRANSFER)
                await context.write(pb.WatchEventsResponse(error=envelope))
        finally:
            events.watching -= 1

    async def _follow(
        self,
        request: pb.WatchEventsRequest,
        context: grpc.aio.ServicerContext,
        view: Callable[[str], str | None],
        page: int,
    ) -> None:
        events = self.events
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
        while True:
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
            out = _live(batch, view, page)
            position = batch[-1].seq if out is None else out[0]
            if out is not None:
                await self._write(context, out[1])
                told, told_at = position, monotonic()

    async def _resync(
        self, context: grpc.aio.ServicerContext, view: Callable[[str], str | None], page: int
    ) -> int:
        """``lost``, then what is present at S in pages, the last ``snapshot_done``."""
        events = self.events
        events.resyncs += 1
        point, chunks, remote = events.snapshot()
        await self._write(context, pb.EventBatch(sequence=point, lost=True))
        pending: pb.EventBatch | None = None
        for pending_next in _pages(point, chunks, remote, view, page):
            if pending is not None:
                await self._write(context, pending)
            pending = pending_next
        last = pending or pb.EventBatch(sequence=point, snapshot=True)
        last.snapshot_done = True
        await self._write(context, last)
        return point

    async def _write(self, context: grpc.aio.ServicerContext, batch: pb.EventBatch) -> None:
        batch.incarnation = self.events.incarnation
        await context.write(pb.WatchEventsResponse(batch=batch))


def _view(
    tenant: Tenant, request: pb.WatchEventsRequest, request_id: str
) -> Callable[[str], str | None]:
    """The name a store namespace has for this watcher, or None when it must not see
    it (another tenant's, or not among the namespaces asked for)."""
    call = Call(request_id, monotonic() + 1.0, False, tenant)
    wanted = {check_namespace(ns, call) for ns in request.namespaces}
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

    return view


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
    remote: list[tuple[RemoteKey, int]],
    view: Callable[[str], str | None],
    page: int,
) -> Iterator[pb.EventBatch]:
    """Snapshot batches of at most ``page`` keys: runs of one namespace and layout
    become one stored event. Built one page at a time (the list of references is
    the snapshot's only copy)."""
    out = pb.EventBatch(sequence=point, snapshot=True)
    keys = 0
    run: pb.StoredEvent | None = None
    run_of: tuple[str, str, int] = ("", "", 0)
    sources: Iterator[tuple[str, bytes, str, int, int]] = _present(chunks, remote)
    for namespace, key, layout, size, tier in sources:
        name = view(namespace)
        if name is None:
            continue
        if run is None or run_of != (namespace, layout, tier):
            run = out.events.add().stored
            run.namespace, run.layout, run.tier = name, layout, tier  # type: ignore[assignment]
            run_of = (namespace, layout, tier)
        run.keys.append(key)
        run.bytes += size
        keys += 1
        if keys >= page:
            yield out
            out = pb.EventBatch(sequence=point, snapshot=True)
            keys, run = 0, None
    if out.events:
        yield out


def _present(
    chunks: list[Chunk], remote: list[tuple[RemoteKey, int]]
) -> Iterator[tuple[str, bytes, str, int, int]]:
    for chunk in chunks:
        namespace, key, layout = chunk.key
        yield namespace, key, layout, chunk.size, pb.TIER_MEMORY
    for (namespace, key, layout), size in remote:
        yield namespace, key, layout, size, pb.TIER_REDIS
