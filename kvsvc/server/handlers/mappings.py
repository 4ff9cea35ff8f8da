"""Map and Unmap, and the mappings they keep: engine memory mapped into this
server, one engine's ranks all or none (a failing rank named by its tp/pp rank
and group), each mapping its tenant's alone. Unmap, a stale mapping found by a
Map, and the reaper (the mapping's engine is gone) all release the same way:
fence running copies, synchronize the device, close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from time import monotonic

from kvsvc.errors import (
    UNKNOWN,
    DeadlineExceeded,
    InvalidRequest,
    KVServiceError,
    MappingLost,
    RegionUnavailable,
)
from kvsvc.layout import rank_label, rank_metadata
from kvsvc.server.config import MAPPING_REAP_INTERVAL_S, ServerConfig
from kvsvc.server.data import fdbroker
from kvsvc.server.data.engine import TransferEngine, reply_budget
from kvsvc.server.data.regions import Mapping, RankMapping, open_rank
from kvsvc.server.handlers.requests import check_namespace, quota_exceeded
from kvsvc.server.ops import failpoints
from kvsvc.server.rpc.wrapper import LOGGER, Call
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(LOGGER)
#: How long Map waits before it opens a region that was not ready again.
MAP_RETRY_S = 0.02


class Mapper:
    """The server's mappings, by id (``mappings``, written only here), and what makes
    and releases them: the Map and Unmap handlers (called through the servicer's
    wrapper) and the reaper."""

    def __init__(
        self,
        config: ServerConfig,
        engine: TransferEngine,
        fds: fdbroker.FdBroker | None,
        shm_owners: frozenset[int] | None,
        start_id: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.config = config
        self.engine = engine
        self.fds = fds
        #: whose files Map opens by name (--shm-uids; regions.open_trusted)
        self.shm_owners = shm_owners
        self.start_id = start_id
        self.loop = loop
        self.mappings: dict[str, Mapping] = {}
        self._reap_wake = asyncio.Event()
        #: set by stop_reaping: a cancel alone can be lost inside wait_for (Python
        #: 3.11, when the wake-up comes at the same moment) and the stop waits forever
        self._reaping_stopped = False
        if fds is not None:
            fds.on_lease_end = self._lease_ended

    def get(self, mapping_id: str, call: Call) -> Mapping:
        """The caller's mapping; another tenant's is as unknown as one never made."""
        mapping = self.mappings.get(mapping_id)
        if mapping is None or mapping.tenant != call.tenant.name:
            raise MappingLost(
                f"mapping {mapping_id!r} is not known to server start {self.start_id}: "
                "the server restarted or the mapping was unmapped; map again",
                metadata={"mappingId": mapping_id, "serverStartId": self.start_id},
            )
        if mapping.closing:
            raise InvalidRequest(
                f"mapping {mapping_id} is being unmapped",
                reason="MAPPING_CLOSING",
                metadata={"mappingId": mapping_id},
            )
        return mapping

    def _admit(self, call: Call, request: pb.MapRequest) -> None:
        """A Map within its tenant's mapping and fd quotas, before anything is opened."""
        tenant, quota = call.tenant, call.tenant.quota
        if not (quota.max_mappings or quota.max_fds):
            return
        mine = [m for m in self.mappings.values() if m.tenant == tenant.name]
        if quota.max_mappings and len(mine) >= quota.max_mappings:
            raise quota_exceeded(tenant, "max_mappings", len(mine), quota.max_mappings)
        if quota.max_fds:
            held = sum(m.memfds for m in mine)
            asked = len(
                {
                    t.handle.sealed_memfd.token
                    for r in request.ranks
                    for t in r.tensors
                    if t.handle.WhichOneof("kind") == "sealed_memfd"
                }
            )
            if held + asked > quota.max_fds:
                raise quota_exceeded(tenant, "max_fds", held, quota.max_fds)

    async def Map(self, request: pb.MapRequest, call: Call) -> pb.MapResult:
        namespace = check_namespace(request.namespace, call)
        if not request.ranks:
            raise InvalidRequest("at least one rank is required", metadata={"field": "ranks"})
        self._admit(call, request)
        descriptor = _ranks_descriptor(request)
        for existing in list(self.mappings.values()):
            if existing.closing:
                continue
            current = await asyncio.to_thread(existing.is_current)
            # Idempotent re-map: the same ranks over the same memory, same mapping
            # (and the same tenant: another's Map never learns this mapping's id).
            mine = existing.tenant == call.tenant.name
            if current and mine and existing.descriptor == descriptor:
                return self._result(existing)
            # A mapping whose files were deleted or replaced (its client restarted)
            # is stale: release it once no copy uses it.
            if not current and not any(
                t.mapping_id == existing.mapping_id for t in self.engine.inflight.values()
            ):
                await self._release(existing, call.deadline, "released: its memory is gone")
        ranks: list[RankMapping] = []
        try:
            for index, rank in enumerate(request.ranks):
                failpoints.hit("map.rank", index)
                ranks.append(await self._open_rank(rank, index, call))
        except BaseException as exc:
            for opened in ranks:
                opened.close()
            if isinstance(exc, KVServiceError) and "rankIndex" not in exc.metadata:
                index = len(ranks)
                ctx = request.ranks[index].context
                exc.message = f"{rank_label(ctx, index)}: {exc.message}"
                exc.args = (exc.message,)
                exc.metadata.update({k: str(v) for k, v in rank_metadata(ctx, index).items()})
            elif isinstance(exc, Exception) and not isinstance(exc, KVServiceError):
                index = len(ranks)
                ctx = request.ranks[index].context
                raise RegionUnavailable(
                    f"{rank_label(ctx, index)}: map failed: {type(exc).__name__}: {exc}",
                    reason="MAP_FAILED",
                    metadata={**rank_metadata(ctx, index), "error": type(exc).__name__},
                ) from exc
            raise
        try:
            # 128 random bits: a mapping id cannot be guessed from another.
            mapping = Mapping.of(secrets.token_hex(16), namespace, descriptor, ranks)
            mapping.tenant = call.tenant.name
        except BaseException:
            for opened in ranks:
                opened.close()
            raise
        # Make the mapping visible on the device before the reply.
        await asyncio.to_thread(mapping.synchronize)
        self.mappings[mapping.mapping_id] = mapping
        log.info(
            "mapped %s: %d ranks, %d blocks of %d bytes, layout %s",
            mapping.mapping_id,
            len(ranks),
            mapping.num_blocks,
            mapping.block_bytes,
            mapping.fingerprint,
        )
        return self._result(mapping)

    def _result(self, mapping: Mapping) -> pb.MapResult:
        return pb.MapResult(
            mapping_id=mapping.mapping_id,
            server_start_id=self.start_id,
            num_blocks=mapping.num_blocks,
            block_bytes=mapping.block_bytes,
            layout_fingerprint=mapping.fingerprint,
        )

    async def _open_rank(self, rank: pb.RankRegion, index: int, call: Call) -> RankMapping:
        """Open one rank, retrying a region that is not ready until the deadline."""
        while True:
            attempt = time.monotonic()
            try:
                owners = call.tenant.shm_uids
                return await asyncio.to_thread(
                    open_rank,
                    rank,
                    index,
                    self.config.data.shm_dir,
                    self.fds,
                    self.shm_owners if owners is None else owners,
                )
            except (FileNotFoundError, RegionUnavailable) as exc:
                last = exc
                if isinstance(exc, RegionUnavailable) and exc.reason == "DEVICE_NOT_FOUND":
                    raise
            # Another attempt must fit too: on a loaded host one can take long
            # enough to push the error reply past the client's deadline.
            if reply_budget(call.deadline) <= MAP_RETRY_S + 2 * (time.monotonic() - attempt):
                cause = last.message if isinstance(last, KVServiceError) else str(last)
                raise DeadlineExceeded(
                    f"region not ready before the deadline; last error: {cause}",
                    reason="REGION_NOT_READY",
                    metadata={"lastError": cause},
                ) from last
            await asyncio.sleep(MAP_RETRY_S)

    async def Unmap(self, request: pb.UnmapRequest, call: Call) -> pb.UnmapResult:
        waited = await self._release(self.get(request.mapping_id, call), call.deadline, "unmapped")
        return pb.UnmapResult(fenced_transfers=waited, server_start_id=self.start_id)

    def _lease_ended(self, lease: fdbroker.Lease) -> None:
        """From the fd socket's thread: wake the reaper (unless the server is gone)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._reap_wake.set)

    def stop_reaping(self) -> None:
        self._reaping_stopped = True
        self._reap_wake.set()

    async def reap(self) -> None:
        """Release, without waiting for a Map, every mapping whose engine is gone: at
        once when its lease connection ends, else within MAPPING_REAP_INTERVAL_S
        (a one-shot pass's pid exited). Runs until cancelled."""
        while not self._reaping_stopped:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reap_wake.wait(), MAPPING_REAP_INTERVAL_S)
            self._reap_wake.clear()
            if self._reaping_stopped:
                return
            for mapping in list(self.mappings.values()):
                if mapping.closing or not mapping.owner_gone():
                    continue
                deadline = monotonic() + self.config.limits.stall_timeout
                try:
                    await self._release(mapping, deadline, "released: its engine is gone")
                except KVServiceError as exc:  # copies still run: the next round retries
                    log.warning("mapping %s not released yet: %s", mapping.mapping_id, exc)
                except Exception:
                    log.exception("releasing mapping %s failed", mapping.mapping_id)

    async def _release(self, mapping: Mapping, deadline: float, why: str) -> int:
        """Refuse new copies, fence running ones, synchronize, release. If copies are
        still running at the deadline the mapping stays: no copy loses its memory."""
        mapping.closing = True
        waited, _, still = await self.engine.fence(mapping.mapping_id, (), deadline)
        if still:
            mapping.closing = False
            raise DeadlineExceeded(
                f"mapping {mapping.mapping_id}: {len(still)} copies still running at the "
                "deadline; the mapping stays so that no copy loses its memory",
                reason="UNMAP_FENCE_TIMEOUT",
                metadata={"mappingId": mapping.mapping_id, "running": ",".join(still)},
                transfer_state=UNKNOWN,
            )
        del self.mappings[mapping.mapping_id]
        await asyncio.to_thread(mapping.close)  # synchronizes the device first
        log.info("mapping %s %s (%d copies fenced)", mapping.mapping_id, why, waited)
        return waited


def _ranks_descriptor(request: pb.MapRequest) -> bytes:
    """What makes two Maps the same ranks (an idempotent re-map's test)."""
    key = pb.MapRequest(namespace=request.namespace, ranks=request.ranks)
    return key.SerializeToString(deterministic=True)
