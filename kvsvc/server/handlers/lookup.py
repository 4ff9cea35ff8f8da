"""Lookup: how many of a request's keys, from the first, the cache holds, in
memory or a tier below it. The hot path of the control plane: answered without a
coroutine when no tier has to be asked (kvsvc.server.tiers.chain.TierChain.prefix)."""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine
from typing import Any

from kvsvc.limits import MAX_KEY_BYTES
from kvsvc.server.data.store import INLINE_LAYOUT, ChunkStore
from kvsvc.server.handlers.mappings import Mapper
from kvsvc.server.handlers.requests import check_keys, check_namespace, oneof
from kvsvc.server.ops.metrics import Metrics
from kvsvc.server.ops.stats import Counts
from kvsvc.server.rpc.wrapper import Call
from kvsvc.server.tiers.chain import TierChain
from kvsvc.v1 import kv_cache_service_pb2 as pb


class Lookups:
    """The Lookup handler (called through the servicer's wrapper)."""

    def __init__(
        self,
        store: ChunkStore,
        tiers: TierChain,
        mapper: Mapper,
        metrics: Metrics,
        start_id: str,
        counts: Counts,
    ) -> None:
        self.store = store
        self.tiers = tiers
        self.mapper = mapper
        self.metrics = metrics
        self.start_id = start_id
        self.counts = counts

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
            # Tiers are asked about inline chunks in their one layout.
            namespace, layout = check_namespace(request.namespace, call), INLINE_LAYOUT
            hits = self.store.lookup(namespace, keys, None)
        memory = hits  # memory's leading run; the chain counts the holders past it
        if self.tiers and hits < len(keys):
            counted = self.tiers.prefix(namespace, layout, keys, hits)
            if not isinstance(counted, int):
                return self._asked(counted, len(keys), memory)
            hits = counted
        return self._response(hits, len(keys), memory)

    async def _asked(self, counted: Awaitable[int], asked: int, memory: int) -> pb.LookupResponse:
        return self._response(await counted, asked, memory)

    def _response(self, hits: int, asked: int, memory: int) -> pb.LookupResponse:
        self.metrics.observe_lookup(hits, asked)
        self.counts.lookup(asked, hits, memory)
        response = pb.LookupResponse()
        result = response.result  # set in place: a LookupResult passed in would be copied
        result.hit_chunks = hits
        result.server_start_id = self.start_id
        return response
