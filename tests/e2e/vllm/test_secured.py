"""The connector against a server started as docker/compose.yaml starts it: a tenant
file made by ``kvsvc init-auth`` (every call needs its token), a socket directory
(the fd socket the engine reaches, as another container mounts it), a plaintext
health-only port, and TLS on the gRPC port. Both halves are driven directly
(direct.py), with the connector's token_file, tls_* and fd_socket keys."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm.distributed", reason="the vLLM connector tests run in .venv-vllm")

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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import kvsvc.integrations.vllm.worker as worker
from kvsvc.integrations.vllm.common import KvsvcConnectorMetadata, Op
from kvsvc.integrations.vllm.connector import KvsvcConnector


def scheduler(port: int, keys: dict[str, str]) -> Any:
    return KvsvcConnector(
        vllm_config(port, tp=1, **keys), KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG
    )


def test_connector_with_token_tls_and_fd_socket(secured, monkeypatch) -> None:
    port, keys = secured["port"], secured["keys"]
    cfg = vllm_config(port, tp=1, **keys)
    w, caches = make_worker(monkeypatch, cfg, 0)  # mapped: token, TLS and fd socket held
    sched = scheduler(port, keys)
    hs = hashes(3, b"secured")
    for layer in caches:
        layer[:3].normal_()
    run_step(
        w, KvsvcConnectorMetadata(stores=[Op("s", [(h, [i]) for i, h in enumerate(hs)])]), False
    )
    settle(w, "s", recv=False)
    assert w.worker.counters.get("stored_blocks") == 3
    deadline = time.monotonic() + 10
    while matched(sched, request("a", hs), 0) != (3 * BLOCK, True):
        assert time.monotonic() < deadline, sched.counters
        time.sleep(0.1)
    assert not sched.counters.get("lookup_errors")
    sched.shutdown()
    w.shutdown()


def test_without_the_token_or_with_another_fd_socket_it_is_misses_not_errors(
    secured, monkeypatch
) -> None:
    port, keys = secured["port"], secured["keys"]
    no_token = {k: v for k, v in keys.items() if k != "token_file"}
    sched = KvsvcConnector(
        vllm_config(port, tp=1, **no_token), KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG
    )
    assert matched(sched, request("a", hashes(2)), 0) == (0, False)
    assert sched.counters.get("lookup_errors") == 1
    sched.shutdown()

    # The fd socket the connector names is used (not the server's own word for it):
    # one that does not exist leaves the worker unmapped, its loads failed blocks.
    monkeypatch.setattr(worker, "tp_rank", lambda: 0)
    wrong = {**keys, "fd_socket": keys["fd_socket"] + ".missing", "reconnect_interval_s": 0.5}
    w = KvsvcConnector(vllm_config(port, tp=1, **wrong), KVConnectorRole.WORKER, KV_CACHE_CONFIG)
    w.register_kv_caches(vllm_like_kv_caches())
    time.sleep(2)
    assert w.worker.mapping is None
    run_step(w, KvsvcConnectorMetadata(loads=[Op("l", [(b"h", [3])])]), load=True)
    assert "l" in w.get_transfer_results(set()).finished_recving
    assert w.get_block_ids_with_load_errors() == {3}
    w.shutdown()

    unreadable = {**keys, "token_file": keys["token_file"] + ".missing"}
    sched = KvsvcConnector(
        vllm_config(port, tp=1, **unreadable), KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG
    )
    assert matched(sched, request("b", hashes(2)), 0) == (0, False)
    assert sched.counters.get("lookups_skipped_down") == 1
    sched.shutdown()
