"""Tensor-parallel keys and the all-ranks hit rule, with two worker-side connectors
and a scheduler-side one driven directly against a real `kvsvc serve` (vLLM's CPU
build does not run tensor parallel 2 on these 2-core machines). The KV caches are
laid out as vLLM 0.32 allocates them on CPU (one int8 allocation viewed per layer
as [blocks, kv_heads, block_size, K|V]) and really moved into memfds and mapped;
vLLM's config, request and KV-cache-config objects are stood in by plain objects
holding the fields the connector reads (direct.py)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed", reason="the vLLM connector tests run in .venv-vllm")

import torch
from direct import (
    BLOCK,
    KV_CACHE_CONFIG,
    hashes,
    make_worker,
    matched,
    request,
    run_step,
    settle,
    vllm_config,
    vllm_like_kv_caches,
)
from driver import KvsvcProcess
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_helpers import free_port

import kvsvc.integrations.vllm.common as common
import kvsvc.integrations.vllm.scheduler as scheduler
import kvsvc.integrations.vllm.worker as worker
from kvsvc.integrations.vllm.common import KvsvcConnectorMetadata, Op
from kvsvc.integrations.vllm.connector import KvsvcConnector


@pytest.fixture
def server(tmp_path: Path):
    s = KvsvcProcess(free_port(), "", str(tmp_path))
    yield s
    s.kill()


def test_a_chunk_hits_only_when_every_rank_stored_it(server, monkeypatch) -> None:
    port = int(server.address.rsplit(":", 1)[1])
    cfg = vllm_config(port)
    sched = KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
    (w0, caches0), (w1, caches1) = (make_worker(monkeypatch, cfg, r) for r in (0, 1))
    hs = hashes(4)
    req = request("r1", hs)
    for layer in (*caches0, *caches1):  # each rank's shard of blocks 0-3: its own bytes
        layer[:4].normal_()
    store = KvsvcConnectorMetadata(stores=[Op("r1", [(h, [i]) for i, h in enumerate(hs)])])

    assert matched(sched, req, 0) == (0, False)
    run_step(w0, store, load=False)
    settle(w0, "r1", recv=False)
    assert w0.worker.counters.get("stored_blocks") == 4
    # Rank 1's shards are missing: no chunk is a hit.
    assert matched(sched, req, 0) == (0, False)
    run_step(w1, store, load=False)
    settle(w1, "r1", recv=False)
    assert matched(sched, req, 0) == (4 * BLOCK, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23, 24],))
    sched.update_state_after_alloc(req, blocks, 4 * BLOCK)
    meta = sched.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
            num_scheduled_tokens={},
            preempted_req_ids=None,
        )
    )
    assert meta.loads == [Op("r1", [(h, [20 + i]) for i, h in enumerate(hs)])]
    # Asked again (its load failed, vLLM recomputes): no second load of the request.
    assert matched(sched, req, 0) == (0, False)

    # Each rank loads its own shard (per-rank keys), into other blocks.
    load = KvsvcConnectorMetadata(loads=[Op("r2", [(h, [10 + i]) for i, h in enumerate(hs)])])
    for conn, caches in ((w0, caches0), (w1, caches1)):
        run_step(conn, load, load=True)
        r = settle(conn, "r2", recv=True)
        assert not r.failed_recving and not conn.get_block_ids_with_load_errors()
        for layer in caches:
            assert torch.equal(layer[10:14], layer[0:4])
    assert not torch.equal(caches0[0][10:14], caches1[0][10:14])
    for c in (sched, w0, w1):
        c.shutdown()


def test_other_deployments_never_share(server, monkeypatch) -> None:
    port = int(server.address.rsplit(":", 1)[1])
    cfg = vllm_config(port, tp=1)
    w, _ = make_worker(monkeypatch, cfg, 0)
    hs = hashes(2, b"x")
    run_step(w, KvsvcConnectorMetadata(stores=[Op("s", [(hs[0], [0]), (hs[1], [1])])]), False)
    settle(w, "s", recv=False)
    same = KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
    assert matched(same, request("a", hs), 0) == (2 * BLOCK, True)
    for other in (
        vllm_config(port, tp=1, model="another"),
        vllm_config(port, tp=2),
        vllm_config(port, tp=1, blocks_per_chunk=2),
    ):
        sched = KvsvcConnector(other, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
        assert matched(sched, request("b", hs), 0) == (0, False)
        sched.shutdown()
    same.shutdown()
    w.shutdown()


def test_hooks_never_raise_into_vllm(monkeypatch) -> None:
    """kvsvc unreachable and a malformed request: every hook answers, none raises."""
    cfg = vllm_config(free_port(), tp=1)
    sched = KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
    t0 = time.monotonic()
    assert matched(sched, request("a", hashes(3)), 0) == (0, False)
    assert time.monotonic() - t0 < 5
    assert matched(sched, SimpleNamespace(request_id="bad"), 0) == (0, False)
    assert sched.counters["hook_errors"] == 1
    assert sched.request_finished(SimpleNamespace(request_id="bad"), []) == (False, None)
    monkeypatch.setattr(worker, "tp_rank", lambda: 0)
    w = KvsvcConnector(cfg, KVConnectorRole.WORKER, KV_CACHE_CONFIG)
    w.register_kv_caches(vllm_like_kv_caches())
    # Not mapped (kvsvc down): a load is answered at once, as failed blocks.
    run_step(w, KvsvcConnectorMetadata(loads=[Op("l", [(b"h", [3])])]), load=True)
    r = w.get_transfer_results(set())
    assert "l" in r.finished_recving
    assert w.get_block_ids_with_load_errors() == {3}
    sched.shutdown()
    w.shutdown()


def test_warns_when_vllm_would_reserve_no_core_for_its_engine_loop(monkeypatch) -> None:
    """With a KV connector set, vLLM 0.32 reserves no CPU at all on <= 2 CPUs per worker
    and prefill slows ~1.5-2x (docs/vllm.md): the operator is told the setting that
    avoids it, and not told once it is set."""
    import logging
    import os

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    common.log.addHandler(handler)
    try:
        monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        scheduler.warn_no_reserved_core(vllm_config(1, tp=1))
        small = len(os.sched_getaffinity(0)) <= 2
        told = [r for r in records if "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in r.getMessage()]
        assert len(told) == (1 if small else 0)
        records.clear()
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        scheduler.warn_no_reserved_core(vllm_config(1, tp=1))
        assert records == []
    finally:
        common.log.removeHandler(handler)
