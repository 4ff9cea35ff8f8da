"""vLLM's real offloading tiers, driven as its OffloadingConnector's scheduler half
drives them: a ``TieringOffloadingSpec`` built from an ``OffloadingConfig`` whose
``secondary_tiers`` names KvsvcTier by type and module path (vLLM's factory loads
it), its CPU primary tier over a real /dev/shm offload file. What the GPU worker
would copy into the primary tier is written here with random bytes."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

ROW = 8192  # bytes of one offloaded chunk (one block of one worker)
CHUNKS = 32  # the primary tier's chunks


def offload_config(
    engine_id: str,
    tier: dict[str, Any],
    chunks: int = CHUNKS,
    kv_events: bool = False,
    row: int = ROW,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=row,
        enable_kv_cache_events=kv_events,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": chunks * row,
            "secondary_tiers": [
                {"type": "KvsvcTier", "module_path": "kvsvc.integrations.vllm.tier", **tier}
            ],
        },
        engine_id=engine_id,
        model=OffloadingModelConfig(name="tiny-test-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def new_keys(n: int) -> list[OffloadKey]:
    return [make_offload_key(os.urandom(16), 0) for _ in range(n)]


class Engine:
    """One engine's scheduler-side offloading: vLLM's TieringOffloadingManager with
    KvsvcTier below its CPU tier."""

    def __init__(
        self, kv_events: bool = False, row: int = ROW, chunks: int = CHUNKS, **tier: Any
    ) -> None:
        """``kv_events``: vLLM's KV events on (its manager's take_events drained);
        ``row``: bytes of one chunk, ``chunks``: the primary tier's chunks."""
        tier.setdefault("reconnect_interval_s", 0.5)
        engine_id = f"kvsvc-{uuid.uuid4().hex[:12]}"
        self.spec = TieringOffloadingSpec(
            offload_config(engine_id, tier, chunks, kv_events=kv_events, row=row)
        )
        self.manager: Any = self.spec.get_manager()
        self.tier: Any = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())
        self.reqs = 0

    def ctx(self) -> ReqContext:
        self.reqs += 1
        ctx = ReqContext(req_id=f"r{self.reqs}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def offload(self, keys: list[OffloadKey], seed: int) -> dict[OffloadKey, bytes]:
        """What vLLM does when a request's blocks are offloaded: the primary tier
        takes them (written here), then cascades them to the tiers below."""
        ctx = self.ctx()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "the primary tier has no room"
        rng = np.random.default_rng(seed)
        data = {}
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[chunk] = rng.integers(0, 256, self.rows.shape[1], dtype=np.uint8)
            data[key] = self.rows[chunk].tobytes()
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        return data

    def settle(self, timeout: float = 60) -> None:
        """Step until no tier job is pending (bounded)."""
        end = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < end, f"tier jobs still pending: {dict(self.tier.counters)}"
            self.step()
            time.sleep(0.01)

    def fetch(self, keys: list[OffloadKey], timeout: float = 30) -> dict[OffloadKey, Any]:
        """Look each key up as vLLM's scheduler does (a HIT_PENDING or RETRY is asked
        again on a later step) until every answer is final: HIT or MISS."""
        ctx = self.ctx()
        end = time.monotonic() + timeout
        final: dict[OffloadKey, LookupResult] = {}
        while len(final) < len(keys):
            assert time.monotonic() < end, f"lookups not final: {final}, {dict(self.tier.counters)}"
            for key in keys:
                if key not in final:
                    r = self.manager.lookup(key, ctx)
                    if r in (LookupResult.HIT, LookupResult.MISS):
                        final[key] = r
            self.step()
            time.sleep(0.005)
        hits = [k for k in keys if final[k] is LookupResult.HIT]
        out: dict[OffloadKey, Any] = dict(final)
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            for key, chunk in zip(hits, spec.chunk_ids, strict=True):
                out[key] = self.rows[chunk].tobytes()
            self.manager.complete_load(hits, ctx)
        self.manager.on_request_finished(ctx)
        return out

    def wait_index(self, timeout: float = 30) -> None:
        """Until the tier's presence index is open and fresh (bounded)."""
        end = time.monotonic() + timeout
        while not (self.tier.hints.index is not None and self.tier.hints.index.fresh):
            assert time.monotonic() < end, "the tier's presence index did not open"
            time.sleep(0.02)

    def close(self) -> None:
        del self.rows  # an exported view would keep vLLM from closing its mmap
        self.manager.shutdown()
