"""The kvsvc.v1 servicer, the composition root: builds the server's parts once from
its configuration (the store, the events log, the tiers' chain, the transfer
engine, the fd socket, metrics), each given what it uses through its
constructor, and names each
RPC's response type and handler, every one run through the one wrapper
(kvsvc.server.rpc.wrapper). Where each RPC is handled: Map and Unmap in
kvsvc.server.handlers.mappings; Store, Retrieve and Fence in kvsvc.server.handlers.transfers;
Lookup in kvsvc.server.handlers.lookup; DropNamespace in kvsvc.server.handlers.namespaces; the
Session stream in kvsvc.server.rpc.session; the WatchEvents stream in
kvsvc.server.events; GetServerInfo here (its FULL view's stats in
kvsvc.server.ops.stats). Start, signals and stop:
kvsvc.server.ops.lifecycle."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import torch
from google.protobuf import timestamp_pb2

from kvsvc import __version__
from kvsvc.errors import ENVELOPE_VERSION, KVServiceError, ServiceNotServing
from kvsvc.server.config import ConfigError, ServerConfig, shm_owner_uids, socket_gid
from kvsvc.server.data import fdbroker, fdsocket
from kvsvc.server.data.budget import InlineBudget
from kvsvc.server.data.engine import TransferEngine
from kvsvc.server.data.store import ChunkStore
from kvsvc.server.events import EventLog, StoreEvents, Watchers
from kvsvc.server.handlers.lookup import Lookups
from kvsvc.server.handlers.mappings import Mapper
from kvsvc.server.handlers.namespaces import Namespaces
from kvsvc.server.handlers.transfers import Transfers
from kvsvc.server.ops.health import Health
from kvsvc.server.ops.metrics import Metrics
from kvsvc.server.ops.stats import Counts, Stats
from kvsvc.server.rpc.session import Sessions
from kvsvc.server.rpc.wrapper import LOGGER, Call, rpc
from kvsvc.server.tiers import chain
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

log = logging.getLogger(LOGGER)


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    """The server's parts, and the RPC table: each RPC's wrapper (its response type,
    whether it is a transfer) and the handler it calls."""

    def __init__(self, config: ServerConfig, health: Health) -> None:
        self.config = config
        self.health = health
        self.start_id = uuid.uuid4().hex
        self.start_time = time.time()
        cuda = config.data.device == "cuda" or (
            config.data.device == "auto" and torch.cuda.is_available()
        )
        self.device = "cuda" if cuda else "cpu"
        self.store = ChunkStore(config.data.store_bytes, pin_memory=cuda)
        self.loop = asyncio.get_running_loop()
        #: what became present or left, for WatchEvents (kvsvc.server.events)
        self.events = EventLog(
            self.start_id,
            self.store,
            self.loop,
            ring_events=config.limits.events_ring,
            ring_bytes=config.limits.events_ring_bytes,
            remote_keys=config.limits.events_remote_keys,
        )
        self.store.listeners.append(StoreEvents(self.events))
        self.watchers = Watchers(
            self.events,
            config.limits.events_snapshot_page,
            config.limits.events_linger_ms / 1000,
        )
        #: the tiers below memory, in order (disk, Redis); each checks its settings now
        self.tiers = chain.build(config, self.store, self.loop, self.events)
        self.tiers.start(hold=health.hold, release=health.release)
        self.engine = TransferEngine(config.data.transfer_threads, config.data.inline_copy_bytes)
        self.engine.on_fatal = self.fatal_threadsafe
        self.fds = self._fd_broker(config)
        #: whose files Map opens by name (--shm-uids; regions.open_trusted)
        self.shm_owners = shm_owner_uids(config.security.shm_uids)
        self.mapper = Mapper(
            config, self.engine, self.fds, self.shm_owners, self.start_id, self.loop
        )
        self.mappings = self.mapper.mappings  # by id: read here, by metrics and by tests
        self.metrics = Metrics(
            store=self.store,
            health=health,
            transfers=lambda: self.engine.inflight.values(),
            mappings=self.mappings,
            fds=self.fds,
            events=self.events,
            tiers=self.tiers.tiers,
            version=__version__,
        )
        #: what only GetServerInfo's stats count (hits, removals by reason, refusals)
        self.counts = Counts()
        self.store.listeners.append(self.counts)
        self.metrics.watch_hits(self.counts, self.tiers, [t.name for t in self.tiers.tiers])
        self.transfers = Transfers(
            config,
            self.store,
            self.engine,
            self.tiers,
            self.mapper,
            self.metrics,
            self.start_id,
            self.counts,
        )
        self.lookups = Lookups(
            self.store, self.tiers, self.mapper, self.metrics, self.start_id, self.counts
        )
        self.namespaces = Namespaces(self.store, self.tiers, self.start_id)
        #: what large requests may hold at once (kvsvc.server.data.budget)
        self.budget = InlineBudget(config.data.inline_budget_bytes, lambda: self.store.capacity)
        self.sessions = Sessions(self, self.loop, self.budget)
        self.stats = Stats(
            config=config,
            store=self.store,
            counts=self.counts,
            tiers=self.tiers,
            events=self.events,
            watchers=self.watchers,
            inflight=lambda: self.engine.inflight,
            mappings=self.mappings,
        )

    def _fd_broker(self, config: ServerConfig) -> fdbroker.FdBroker | None:
        """The fd socket; with 'auto' and no socket dir, a place where none can be
        made (read-only shm dir) only turns memfd regions off, loudly; a path or a
        socket dir the operator chose must work."""
        path = fdsocket.socket_path(
            config.data.fd_socket, config.data.shm_dir, self.start_id, config.network.socket_dir
        )
        if path is None:
            return None
        try:
            return fdbroker.FdBroker(path, gid=socket_gid(config))
        except OSError as exc:
            if config.network.socket_dir and config.data.fd_socket == "auto":
                raise ConfigError(f"--socket-dir {config.network.socket_dir}: {exc}") from exc
            if config.data.fd_socket != "auto":
                raise
            log.warning("no fd socket at %s (%s): sealed memfd regions are off", path, exc)
            return None

    def fatal(self, exc: KVServiceError) -> None:
        """Stop serving (on the loop): health NOT_SERVING at once, queued copies fail
        fast, callers of running copies get TransferUnprovable now."""
        self.health.fatal_now(exc.reason, exc.message)
        self.engine.fail(exc)
        if self.events.ended is None:  # nothing held can be trusted: watchers drop it all
            self.events.cleared(pb.CLEAR_REASON_FATAL)
            self.events.end(
                ServiceNotServing(
                    f"this instance stopped serving after a fatal failure ({exc.reason}); "
                    "restart it or use another",
                    metadata={"failureReason": exc.reason},
                )
            )

    def fatal_threadsafe(self, exc: KVServiceError) -> None:
        """From any thread: queued copies stop starting at once, the loop does the rest."""
        self.engine.mark_failed(exc)
        self.loop.call_soon_threadsafe(self.fatal, exc)

    def admit(self, call: Call) -> None:
        """The wrapper's check of a transfer against its tenant's quota."""
        self.transfers.admit(call)

    # --- for lifecycle ---
    async def reap(self) -> None:
        """Release mappings whose engine is gone, until stop_reaping (Mapper.reap)."""
        await self.mapper.reap()

    def stop_reaping(self) -> None:
        self.mapper.stop_reaping()

    @property
    def sessions_open(self) -> int:
        """Session and WatchEvents streams still open."""
        return self.sessions.open + self.events.watching

    def end_sessions(self) -> None:
        """At shutdown, once copies are drained: every Session stream ends (Sessions.end),
        and every WatchEvents stream with a SERVICE_NOT_SERVING error batch."""
        self.sessions.end()
        self.events.end(
            ServiceNotServing(
                "this instance is shutting down", metadata={"failureReason": "SHUTTING_DOWN"}
            )
        )

    # --- RPCs: the wrapper, then the handler ---
    @rpc(pb.MapResponse)
    async def Map(self, request: pb.MapRequest, call: Call) -> pb.MapResult:
        return await self.mapper.Map(request, call)

    @rpc(pb.UnmapResponse)
    async def Unmap(self, request: pb.UnmapRequest, call: Call) -> pb.UnmapResult:
        return await self.mapper.Unmap(request, call)

    @rpc(pb.StoreResponse, transfer=True)
    async def Store(self, request: pb.StoreRequest, call: Call) -> pb.StoreResponse:
        return await self.transfers.Store(request, call)

    @rpc(pb.RetrieveResponse, transfer=True)
    async def Retrieve(self, request: pb.RetrieveRequest, call: Call) -> pb.RetrieveResponse:
        return await self.transfers.Retrieve(request, call)

    @rpc(pb.FenceResponse)
    async def Fence(self, request: pb.FenceRequest, call: Call) -> pb.FenceResult:
        return await self.transfers.Fence(request, call)

    @rpc(pb.LookupResponse)
    def Lookup(
        self, request: pb.LookupRequest, call: Call
    ) -> pb.LookupResponse | Coroutine[Any, Any, pb.LookupResponse]:
        return self.lookups.Lookup(request, call)  # plain: no coroutine when nothing waits

    @rpc(pb.DropNamespaceResponse)
    async def DropNamespace(
        self, request: pb.DropNamespaceRequest, call: Call
    ) -> pb.DropNamespaceResult:
        return await self.namespaces.DropNamespace(request, call)

    async def Session(  # type: ignore[override]  # answers by context.write, not by yield
        self, requests: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Many calls on one stream, each through its RPC's wrapper (kvsvc.server.rpc.session)."""
        await self.sessions.serve(requests, context)

    async def WatchEvents(  # type: ignore[override]  # answers by context.write
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Ordered batches of what became present or left (kvsvc.server.events)."""
        await self.watchers.serve(request, context)

    @rpc(pb.GetServerInfoResponse)
    def GetServerInfo(self, request: pb.GetServerInfoRequest, call: Call) -> pb.GetServerInfoResult:
        result = pb.GetServerInfoResult(
            version=__version__,
            envelope_version=ENVELOPE_VERSION,
            server_start_id=self.start_id,
            capacity_bytes=self.store.capacity,
            used_bytes=self.store.used_bytes,
            stored_chunks=len(self.store),
            evicted_chunks=self.store.evicted_total,
            mappings=len(self.mappings),
            inflight_transfers=len(self.engine.inflight),
            serving=self.health.serving,
            failure_reason=self.health.failure_reason,
            start_time=_timestamp(self.start_time),
            device=self.device,
            fd_socket=self.fds.path if self.fds is not None else "",
        )
        if self.health.failure_time:
            result.failure_time.CopyFrom(_timestamp(self.health.failure_time))
        if request.view == pb.SERVER_INFO_VIEW_FULL:
            self.stats.fill(result.stats, call.tenant)
        return result


def _timestamp(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts
