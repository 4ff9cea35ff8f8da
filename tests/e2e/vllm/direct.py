"""Helpers of the tests that drive the connector's halves directly against a real
`kvsvc serve` (no engine): vLLM's config, request and KV-cache-config objects
stood in by plain objects holding the fields the connector reads, and KV caches
laid out as vLLM 0.32 allocates them on CPU. Imported after the tests'
``importorskip("vllm.distributed")``."""

from __future__ import annotations

import hashlib
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import kvsvc.integrations.vllm.worker as worker
from kvsvc.integrations.vllm.common import KvsvcConnectorMetadata
from kvsvc.integrations.vllm.connector import KvsvcConnector

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS = 16, 2, 32, 2, 64


def vllm_config(
    port: int, tp: int = 2, model: str = "tiny", kv_events: bool = False, **extra: Any
) -> Any:
    return SimpleNamespace(
        kv_events_config=SimpleNamespace(enable_kv_cache_events=kv_events),
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"target": f"127.0.0.1:{port}", **extra},
            kv_load_failure_policy="recompute",
            is_kv_producer=True,
        ),
        model_config=SimpleNamespace(model=model, revision=None, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
    )


KV_CACHE_CONFIG = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[])


def vllm_like_kv_caches() -> dict[str, torch.Tensor]:
    """As vLLM 0.32's allocate_kv_cache: one zeroed int8 buffer, bf16 views per layer."""
    layer_elems = NUM_BLOCKS * HEADS * BLOCK * 2 * DIM
    buf = torch.zeros(LAYERS * layer_elems * 2, dtype=torch.int8)
    flat = buf.view(torch.bfloat16)
    return {
        f"model.layers.{i}.self_attn.attn": flat[i * layer_elems : (i + 1) * layer_elems].view(
            NUM_BLOCKS, HEADS, BLOCK, 2 * DIM
        )
        for i in range(LAYERS)
    }


def make_worker(monkeypatch: pytest.MonkeyPatch, cfg: Any, rank: int) -> Any:
    monkeypatch.setattr(worker, "tp_rank", lambda: rank)
    conn = KvsvcConnector(cfg, KVConnectorRole.WORKER, KV_CACHE_CONFIG)
    caches = vllm_like_kv_caches()
    conn.register_kv_caches(caches)
    deadline = time.monotonic() + 30
    while conn.worker.mapping is None:
        assert time.monotonic() < deadline, "the worker did not map"
        time.sleep(0.05)
    return conn, list(caches.values())


def hashes(n: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + b"block%d" % i).digest() for i in range(n)]


def request(req_id: str, block_hashes: list[bytes]) -> Any:
    tokens = len(block_hashes) * BLOCK + 1
    return SimpleNamespace(request_id=req_id, block_hashes=block_hashes, num_tokens=tokens)


def run_step(conn: Any, meta: KvsvcConnectorMetadata, load: bool) -> None:
    conn.bind_connector_metadata(meta)
    if load:
        conn.start_load_kv(None)
    conn.wait_for_save()
    conn.clear_connector_metadata()


def settle(conn: Any, req_id: str, *, recv: bool) -> Any:
    """Poll get_transfer_results (as vLLM does each step) until ``req_id`` is done."""
    deadline = time.monotonic() + 30
    while True:
        r = conn.get_transfer_results({req_id})
        if req_id in (r.finished_recving if recv else r.finished_sending):
            return r
        assert time.monotonic() < deadline, f"{req_id} never finished"
        time.sleep(0.02)


def store_planned(sched: Any, w: Any, req_id: str, block_hashes: list[bytes]) -> None:
    """As vLLM drives a new request whose prompt one step computes: the scheduler
    half plans its chunks' stores (into blocks 0..n-1), the worker half stores
    them, and vLLM frees the request once the worker reports the store ended."""
    req = request(req_id, block_hashes)
    req.num_computed_tokens = 0
    req.num_prompt_tokens = req.num_tokens
    req.cache_salt = None
    blocks = list(range(len(block_hashes)))
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(blocks,))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={req_id: req.num_tokens},
        preempted_req_ids=None,
    )
    meta = sched.build_connector_meta(out)
    assert len(meta.stores) == 1, meta
    run_step(w, meta, False)
    assert sched.request_finished(req, blocks) == (True, None), "blocks held for the store"
    settle(w, req_id, recv=False)


def matched(conn: Any, req: Any, computed: int = 0, limit: float = 30) -> Any:
    """``get_num_new_matched_tokens`` asked as vLLM's scheduler asks it: again each
    step while it answers None ("not yet": a Lookup runs off the scheduler's thread)."""
    deadline = time.monotonic() + limit
    while (got := conn.get_num_new_matched_tokens(req, computed))[0] is None:
        assert time.monotonic() < deadline, f"no answer for {req.request_id} within {limit} s"
        time.sleep(0.01)
    return got
