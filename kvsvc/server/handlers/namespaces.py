"""DropNamespace: one of the caller's namespaces dropped at once, in every tier the
server has (a user deleted; one cache salt's namespace, docs/vllm.md).

Memory: every committed chunk is unlisted at once (a chunk being read is freed by
its last reader, never under it: ChunkStore.discard), and chunks being written
into the namespace now are not kept when their copy ends. Disk: the files are
forgotten at once and removed behind the writes already queued. Redis: its keys
are scanned and unlinked within the call's deadline (``redis_complete`` says
whether the scan ended). Every removal is announced on WatchEvents with
REMOVAL_REASON_DROPPED."""

from __future__ import annotations

import logging

from kvsvc.server.data.engine import reply_budget
from kvsvc.server.data.store import ChunkStore
from kvsvc.server.events import EventLog
from kvsvc.server.handlers.requests import check_namespace
from kvsvc.server.rpc.wrapper import LOGGER, Call
from kvsvc.server.tiers.disk import DiskTier
from kvsvc.server.tiers.redis import RemoteTier
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(LOGGER)


class Namespaces:
    """The DropNamespace handler."""

    def __init__(
        self,
        store: ChunkStore,
        events: EventLog,
        disk: DiskTier | None,
        remote: RemoteTier | None,
        start_id: str,
    ) -> None:
        self.store = store
        self.events = events
        self.disk = disk
        self.remote = remote
        self.start_id = start_id

    async def DropNamespace(
        self, request: pb.DropNamespaceRequest, call: Call
    ) -> pb.DropNamespaceResult:
        namespace = check_namespace(request.namespace, call)  # granted to the caller
        result = pb.DropNamespaceResult(server_start_id=self.start_id)
        result.dropped_chunks, result.dropped_bytes = self.store.drop_namespace(namespace)
        if self.disk is not None:
            result.disk_chunks, result.disk_bytes = self.disk.drop_namespace(namespace)
        result.redis_complete = True
        if self.remote is not None:
            # Announced keys leave the events' table first: a write that lands during
            # the scan is unlinked by it or was never announced.
            announced = [k for k in self.events.remote if k[0] == namespace]
            for ns, key, layout in announced:
                self.events.removed(ns, (key,), layout, pb.REMOVAL_REASON_DROPPED, pb.TIER_REDIS)
            keys, complete = await self.remote.drop_namespace(
                namespace, reply_budget(call.deadline) * 0.8
            )
            result.redis_keys, result.redis_complete = keys, complete
        log.info(
            "namespace %r dropped by tenant %s: %d chunks in memory, %d on disk, %d Redis keys%s",
            request.namespace[:256],
            call.tenant.name,
            result.dropped_chunks,
            result.disk_chunks,
            result.redis_keys,
            "" if result.redis_complete else " (Redis scan not finished)",
        )
        return result
