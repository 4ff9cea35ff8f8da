"""Store, Retrieve and Fence: the RPCs that move bytes. A handler checks the
chunks, picks each one's engine side (kvsvc.server.data.copies), reserves or pins
them in the store and hands the copy to the transfer engine
(kvsvc.server.data.engine), which checks every chunk in the pass that copies it;
a Retrieve's loaded prefix ends before the first chunk that failed, whose stored
copy is dropped. Fence proves that copies have ended. Keys of a Retrieve memory
lacks come from the tiers below it (kvsvc.server.handlers.tiered); what a Store
commits, the tiers' chain writes behind (it follows the store)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvsvc.errors import NOT_STARTED, UNKNOWN, DeadlineExceeded, InvalidRequest, KVServiceError
from kvsvc.server.config import ServerConfig
from kvsvc.server.data.copies import (
    Blocks,
    Digest,
    Inline,
    Piece,
    Side,
    segment_count,
    tasks,
)
from kvsvc.server.data.engine import TransferEngine, reply_budget
from kvsvc.server.data.store import INLINE_LAYOUT, ChunkStore
from kvsvc.server.handlers.mappings import Mapper
from kvsvc.server.handlers.requests import check_keys, check_namespace, oneof, quota_exceeded
from kvsvc.server.handlers.tiered import TieredRetrieve, drop_failed
from kvsvc.server.ops import failpoints
from kvsvc.server.ops.metrics import Metrics
from kvsvc.server.ops.stats import Counts
from kvsvc.server.rpc.wrapper import LOGGER, Call
from kvsvc.server.tiers.chain import TierChain
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(LOGGER)


class Transfers:
    """The transfer RPCs' handlers (each method named for an RPC is its handler,
    called through the servicer's wrapper) and the tenant quota that admits a
    transfer."""

    def __init__(
        self,
        config: ServerConfig,
        store: ChunkStore,
        engine: TransferEngine,
        tiers: TierChain,
        mapper: Mapper,
        metrics: Metrics,
        start_id: str,
        counts: Counts,
    ) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.tiers = tiers
        self.mapper = mapper
        self.metrics = metrics
        self.start_id = start_id
        self.counts = counts

    def admit(self, call: Call) -> None:
        """A transfer within its tenant's quota (kvsvc.server.security.auth.Quota), else
        RESOURCE_EXHAUSTED before anything is reserved; keeps the store's view of
        the tenant's share current (a reloaded tenant file takes effect here)."""
        tenant = call.tenant
        quota = tenant.quota
        share = int(self.store.capacity * quota.store_share)
        if quota.store_share < 1:
            self.store.shares[tenant.name] = share
        else:
            self.store.shares.pop(tenant.name, None)
        per_namespace = quota.namespace_share
        if per_namespace is None:
            per_namespace = self.config.data.namespace_share
        if per_namespace < 1:
            self.store.namespace_shares[tenant.name] = int(share * per_namespace)
        else:
            self.store.namespace_shares.pop(tenant.name, None)
        if quota.max_inflight:
            prefix = tenant.scoped("")
            running = sum(1 for tid in self.engine.inflight if tid.startswith(prefix))
            if running >= quota.max_inflight:
                raise quota_exceeded(tenant, "max_inflight", running, quota.max_inflight)

    def _sides(
        self, request: Any, group: str, call: Call
    ) -> tuple[str, str, str, list[tuple[bytes, Side]]]:
        """(namespace, layout, mapping id, [(key, engine side)]) of a Store's source or
        a Retrieve's target: the one place that tells blocks from inline bytes."""
        if oneof(request, group) == "blocks":  # the same BlockChunks in both
            blocks = request.blocks
            mapping = self.mapper.get(blocks.mapping_id, call)
            sides: list[tuple[bytes, Side]] = [
                (c.key, Blocks(mapping, list(c.block_ids), i)) for i, c in enumerate(blocks.chunks)
            ]
            check_keys([k for k, _ in sides])
            # Another of the caller's namespaces (a cache salt's), in the mapping's layout.
            namespace = (
                check_namespace(blocks.namespace, call) if blocks.namespace else mapping.namespace
            )
            return namespace, mapping.fingerprint, mapping.mapping_id, sides
        inline = request.inline
        namespace = check_namespace(inline.namespace, call)
        if group == "source":
            sides = [(c.key, Inline(c.data)) for c in inline.chunks]
        else:
            sides = [(key, Inline()) for key in inline.keys]
        check_keys([k for k, _ in sides])
        return namespace, INLINE_LAYOUT, "", sides

    async def Store(self, request: pb.StoreRequest, call: Call) -> pb.StoreResponse:
        namespace, layout, mapping_id, sides = self._sides(request, "source", call)
        if failpoints.ENABLED:
            failpoints.hit("store.put")
        present = 0
        wanted: dict[bytes, Side] = {}  # the first of equal keys wins
        for key, side in sides:
            if key in wanted or self.store.get(namespace, key, layout) is not None:
                present += 1
            else:
                wanted[key] = side
        # All or none: a request that cannot be placed evicts nothing.
        reserved, evicted = (
            self.store.reserve(
                namespace, [(k, s.nbytes) for k, s in wanted.items()], layout, call.tenant.name
            )
            if wanted
            else ([], 0)
        )
        todo = list(zip(reserved, wanted.values(), strict=True))
        stored = 0

        def finalize(results: list[list[Digest]] | None, error: BaseException | None) -> None:
            nonlocal stored
            if results is None:
                for chunk, _ in todo:
                    self.store.abort(chunk)
                return
            digests: list[list[int]] = [[0] * segment_count(c.size) for c, _ in todo]
            for ci, si, digest in (d for group in results for d in group):
                digests[ci][si] = digest
            committed = [
                chunk
                for (chunk, _), chunk_digests in zip(todo, digests, strict=True)
                if self.store.commit(chunk, chunk_digests)
            ]
            stored += len(committed)

        if todo:
            pieces = [
                piece
                for ci, (chunk, side) in enumerate(todo)
                for piece in side.pieces(self.store.buffer(chunk), ci, to_store=True)
            ]
            nbytes = sum(c.size for c, _ in todo)
            loop_safe = all(side.loop_safe for _, side in todo)
            await self._transfer(call, "store", mapping_id, nbytes, pieces, finalize, loop_safe)
        if self.tiers and todo:  # a tier may reply only once durable (--disk-sync through)
            await self.tiers.durable([c.key for c, _ in todo], reply_budget(call.deadline))
        if evicted:  # every Store of a full cache evicts: the reply and metrics count it
            log.debug("store %s evicted %d chunks to make room", call.request_id, evicted)
        response = pb.StoreResponse()
        result = response.result  # filled in place: a result passed in would be copied
        result.stored_chunks = stored
        result.present_chunks = present + len(todo) - stored
        result.evicted_chunks = evicted
        result.stored_bytes = sum(c.size for c, _ in todo)
        result.transfer_id = call.request_id
        result.server_start_id = self.start_id
        return response

    async def _transfer(
        self,
        call: Call,
        direction: str,
        mapping_id: str,
        nbytes: int,
        pieces: list[Piece],
        finalize: Callable[[list[list[Digest]] | None, BaseException | None], None],
        loop_safe: bool,
    ) -> list[list[Digest]]:
        """Run the pieces of one copy on the transfer engine (``loop_safe``: see
        TransferEngine.run)."""
        call.started = True
        t0 = time.perf_counter()
        try:
            result = await self.engine.run(
                call.key,
                mapping_id,
                nbytes,
                call.deadline,
                tasks(pieces, nbytes, self.config.data.transfer_threads),
                finalize,
                loop_safe=loop_safe,
            )
        except KVServiceError as exc:
            if exc.transfer_state == NOT_STARTED:
                call.started = False
            raise
        self.metrics.observe_transfer(direction, nbytes, time.perf_counter() - t0)
        return result

    async def Retrieve(self, request: pb.RetrieveRequest, call: Call) -> pb.RetrieveResponse:
        target = self._sides(request, "target", call)
        namespace, layout, mapping_id, sides = target
        keys = [k for k, _ in sides]
        chunks = self.store.acquire_prefix(namespace, keys, layout)
        self.counts.retrieve(len(keys), chunks)
        if self.tiers and len(chunks) < len(keys):
            threads = self.config.data.transfer_threads
            retrieve = TieredRetrieve(self.store, self.engine, self.tiers, threads, call, target)
            return await retrieve.run(chunks, self.metrics, self.start_id)
        try:
            for ci, chunk in enumerate(chunks):
                sides[ci][1].check(chunk.size, ci)
        except BaseException:
            self.store.release(chunks)
            raise
        response = pb.RetrieveResponse()
        result = response.result  # filled in place: a result passed in would be copied
        result.transfer_id = call.request_id
        result.server_start_id = self.start_id
        if not chunks:
            return response
        pieces = [
            piece
            for ci, chunk in enumerate(chunks)
            for piece in sides[ci][1].pieces(self.store.buffer(chunk), ci, to_store=False)
        ]
        nbytes = sum(c.size for c in chunks)
        failed: dict[int, Digest] = {}

        def finalize(results: list[list[Digest]] | None, error: BaseException | None) -> None:
            if results is not None:
                failed.update(drop_failed(self.store, call, chunks, results))
            self.store.release(chunks)

        await self._transfer(
            call,
            "retrieve",
            mapping_id,
            nbytes,
            pieces,
            finalize,
            all(side.loop_safe for _, side in sides[: len(chunks)]),
        )
        loaded = min(failed, default=len(chunks))
        result.loaded_chunks = loaded
        result.loaded_bytes = sum(c.size for c in chunks[:loaded])
        for key, side in sides[:loaded]:
            if isinstance(side, Inline):
                result.chunks.add(key=key, data=bytes(side.out))
        return response

    async def Fence(self, request: pb.FenceRequest, call: Call) -> pb.FenceResult:
        owned = self.mapper.mappings.get(request.mapping_id)
        if request.mapping_id and (owned is None or owned.tenant != call.tenant.name):
            self.mapper.get(request.mapping_id, call)  # raises MappingLost: not the caller's
        if not request.mapping_id and not request.transfer_ids:
            raise InvalidRequest("fence needs a mapping_id or transfer_ids")
        # A tenant waits on and bars only its own transfer ids.
        waited, barred, still = await self.engine.fence(
            request.mapping_id, [call.tenant.scoped(t) for t in request.transfer_ids], call.deadline
        )
        if still:
            raise DeadlineExceeded(
                f"{len(still)} copies still running at the fence deadline",
                reason="FENCE_TIMEOUT",
                metadata={"running": ",".join(still)},
                transfer_state=UNKNOWN,
            )
        return pb.FenceResult(
            waited_transfers=waited, barred_transfers=barred, server_start_id=self.start_id
        )
