"""DropNamespace: one of the caller's namespaces dropped at once, in every tier the
server has (a user deleted; one cache salt's namespace, docs/vllm.md).

Memory: every committed chunk is unlisted at once (a chunk being read is freed by
its last reader, never under it: ChunkStore.discard), and chunks being written
into the namespace now are not kept when their copy ends. Disk: the files are
forgotten at once and removed behind the writes already queued. Redis: its keys
are scanned and unlinked within the call's deadline (``redis_complete`` says
whether the scan ended). S3: the objects under the namespace's prefix are listed
and deleted within it (``s3_complete``). Mooncake: one removal by the namespace's
key pattern within it (``mooncake_complete``). Every removal is announced on
WatchEvents with REMOVAL_REASON_DROPPED."""

from __future__ import annotations

import logging

from kvsvc.server.data.store import ChunkStore
from kvsvc.server.handlers.requests import check_namespace
from kvsvc.server.rpc.wrapper import LOGGER, Call
from kvsvc.server.tiers.chain import TierChain
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(LOGGER)


class Namespaces:
    """The DropNamespace handler."""

    def __init__(self, store: ChunkStore, tiers: TierChain, start_id: str) -> None:
        self.store = store
        self.tiers = tiers
        self.start_id = start_id

    async def DropNamespace(
        self, request: pb.DropNamespaceRequest, call: Call
    ) -> pb.DropNamespaceResult:
        namespace = check_namespace(request.namespace, call)  # granted to the caller
        result = pb.DropNamespaceResult(
            server_start_id=self.start_id,
            redis_complete=True,
            s3_complete=True,
            mooncake_complete=True,
        )
        result.dropped_chunks, result.dropped_bytes = self.store.drop_namespace(namespace)
        await self.tiers.drop(namespace, call.deadline, result)
        log.info(
            "namespace %r dropped by tenant %s: %d chunks in memory, %d on disk, %d Redis keys%s, "
            "%d S3 objects%s, %d Mooncake values%s",
            request.namespace[:256],
            call.tenant.name,
            result.dropped_chunks,
            result.disk_chunks,
            result.redis_keys,
            "" if result.redis_complete else " (Redis scan not finished)",
            result.s3_objects,
            "" if result.s3_complete else " (S3 deletes not finished)",
            result.mooncake_values,
            "" if result.mooncake_complete else " (Mooncake removal not finished)",
        )
        return result
