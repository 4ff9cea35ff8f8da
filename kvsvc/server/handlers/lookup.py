"""Lookup: how many of a request's keys, from the first, the cache holds, here
or in the Redis tier. The hot path of the control plane: answered without a
coroutine when nothing has to be asked of Redis."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from kvsvc.limits import MAX_KEY_BYTES
from kvsvc.server.data.store import INLINE_LAYOUT, ChunkStore
from kvsvc.server.handlers.mappings import Mapper
from kvsvc.server.handlers.requests import check_keys, check_namespace, oneof
from kvsvc.server.ops.metrics import Metrics
from kvsvc.server.rpc.wrapper import Call
from kvsvc.server.tiers.disk import DiskTier
from kvsvc.server.tiers.redis import RemoteTier
from kvsvc.v1 import kv_cache_service_pb2 as pb


class Lookups:
    """The Lookup handler (called through the servicer's wrapper)."""

    def __init__(
        self,
        store: ChunkStore,
        remote: RemoteTier | None,
        mapper: Mapper,
        metrics: Metrics,
        start_id: str,
    ) -> None:
        self.store = store
        self.remote = remote
        self.mapper = mapper
        self.metrics = metrics
        self.start_id = start_id
        #: the local disk tier (set by the servicer; None: no --disk-dir)
        self.disk: DiskTier | None = None

    def Lookup(
        self, request: pb.LookupRequest, call: Call
    ) -> pb.LookupResponse | Coroutine[Any, Any, pb.LookupResponse]:
        scope = request.WhichOneof("scope") or oneof(request, "scope")
        keys = list(request.keys)
        if not all(0 < len(k) <= MAX_KEY_BYTES for k in keys):
            check_keys(keys)  # raises for the first bad key
        if scope == "mapping_id":
            mapping = self.mapper.get(request.mapping_id, call)
            namespace, layout = mapping.namespace, mapping.fingerprint
            hits = self.store.lookup(namespace, keys, layout)
        else:
            # Redis is asked about inline chunks only: its keys name one layout.
            namespace, layout = check_namespace(request.namespace, call), INLINE_LAYOUT
            hits = self.store.lookup(namespace, keys, None)
        if self.disk is not None and hits < len(keys):
            hits = self._disk(namespace, layout, keys, hits)
        if self.remote is not None and hits < len(keys):
            return self._remote(namespace, layout, keys, hits)
        return self._response(hits, len(keys))

    def _disk(self, namespace: str, layout: str, keys: list[bytes], hits: int) -> int:
        """The local prefix, continued by the keys here or on disk (no coroutine: the
        disk's index is in memory)."""
        assert self.disk is not None
        local = None if layout == INLINE_LAYOUT else layout  # as the local Lookup counts
        for key in keys[hits:]:
            if not (
                self.disk.has(namespace, key, local) or self.store.lookup(namespace, [key], local)
            ):
                break
            hits += 1
        return hits

    async def _remote(
        self, namespace: str, layout: str, keys: list[bytes], hits: int
    ) -> pb.LookupResponse:
        """The local prefix, continued by the keys here or in Redis (within the budget)."""
        assert self.remote is not None
        rest = keys[hits:]
        remote = await self.remote.present(namespace, layout, rest)
        local = None if layout == INLINE_LAYOUT else layout  # as the local Lookup counts
        for i, key in enumerate(rest):
            if not (
                (i < len(remote) and remote[i])
                or self.store.lookup(namespace, [key], local)
                or (self.disk is not None and self.disk.has(namespace, key, local))
            ):
                break
            hits += 1
        return self._response(hits, len(keys))

    def _response(self, hits: int, asked: int) -> pb.LookupResponse:
        self.metrics.observe_lookup(hits, asked)
        response = pb.LookupResponse()
        result = response.result  # set in place: a LookupResult passed in would be copied
        result.hit_chunks = hits
        result.server_start_id = self.start_id
        return response
