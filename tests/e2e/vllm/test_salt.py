"""Cache salt namespaces (issue 32 item 5) with the connector's halves driven
directly (direct.py) against a real `kvsvc serve`: with ``salt_namespaces``, the
scheduler plans a salted request's stores and loads in its salt's namespace, the
namespace travels in the connector metadata, the worker stores and loads there
(the mapping stays the deployment's), an unsalted request with the same block
hashes misses, and DropNamespace deletes the salt's chunks at once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.distributed", reason="the vLLM connector tests run in .venv-vllm")

import torch
from direct import (
    BLOCK,
    KV_CACHE_CONFIG,
    hashes,
    make_worker,
    matched,
    run_step,
    settle,
    vllm_config,
)
from driver import KvsvcProcess
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_helpers import free_port

from kvsvc.client import KVCacheClient
from kvsvc.integrations.vllm.common import chunk_key
from kvsvc.integrations.vllm.config import salt_namespace
from kvsvc.integrations.vllm.connector import KvsvcConnector

N = 4


def salted(req_id: str, block_hashes: list[bytes], salt: str | None) -> Any:
    tokens = len(block_hashes) * BLOCK + 1
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=block_hashes,
        num_tokens=tokens,
        num_prompt_tokens=tokens,
        num_computed_tokens=0,
        cache_salt=salt,
    )


def step(new: list[tuple[str, list[int]]], scheduled: dict[str, int]) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=()),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=None,
    )


def blocks_of(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


@pytest.fixture
def server(tmp_path: Path):
    s = KvsvcProcess(free_port(), "", str(tmp_path))
    yield s
    s.kill()


def test_a_salted_request_stores_and_loads_in_its_salts_namespace(server, monkeypatch) -> None:
    port = int(server.address.rsplit(":", 1)[1])
    cfg = vllm_config(port, tp=1, salt_namespaces=True, presence=False)
    w, caches = make_worker(monkeypatch, cfg, 0)
    sched = KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
    base = sched.sched.namespace
    ns = salt_namespace(base, "alice")
    hs = hashes(N, b"salted")
    for layer in caches:
        layer[:N].normal_()
    want = [layer[:N].clone() for layer in caches]

    # The scheduler plans the prompt's stores in the salt's namespace.
    req = salted("s", hs, "alice")
    assert matched(sched, req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks_of(list(range(N + 1))), 0)
    meta = sched.build_connector_meta(step([("s", list(range(N + 1)))], {"s": req.num_tokens}))
    assert [(op.req_id, op.namespace, len(op.chunks)) for op in meta.stores] == [("s", ns, N)]
    run_step(w, meta, load=False)
    settle(w, "s", recv=False)
    keys = [chunk_key(0, h) for h in hs]
    with KVCacheClient(server.address) as c:
        assert c.lookup(keys, namespace=ns, timeout=10) == N
        assert c.lookup(keys, namespace=base, timeout=10) == 0

    # The same salt hits (a Lookup: the index follows the deployment's namespace)
    # and loads from there; without the salt, the same hashes miss.
    assert matched(sched, salted("x", hs, None), 0) == (0, False)
    again = salted("r", hs, "alice")
    assert matched(sched, again, 0) == (N * BLOCK, True)
    dst = list(range(20, 20 + N + 1))
    sched.update_state_after_alloc(again, blocks_of(dst), N * BLOCK)
    meta = sched.build_connector_meta(step([], {}))
    assert [(op.req_id, op.namespace) for op in meta.loads] == [("r", ns)]
    run_step(w, meta, load=True)
    r = settle(w, "r", recv=True)
    assert not r.failed_recving and not w.get_block_ids_with_load_errors()
    for layer, expected in zip(caches, want, strict=True):
        assert torch.equal(layer[20 : 20 + N], expected)

    # A user deleted: one call drops the salt's chunks.
    with KVCacheClient(server.address) as c:
        assert c.drop_namespace(ns, timeout=10).dropped_chunks == N
        assert c.lookup(keys, namespace=ns, timeout=10) == 0
    assert matched(sched, salted("y", hs, "alice"), 0) == (0, False)
    w.shutdown()
    sched.shutdown()
