"""The scheduler's lookups from the presence index and kvsvc's blocks as vLLM KV
events, with the connector's halves driven directly (direct.py) against a real
`kvsvc serve` with a small store (so other writes evict): the index answers with
no Lookup RPC, a hint whose chunks are evicted before the Retrieve ends as failed
blocks that vLLM recomputes, and when the server dies the index turns unknown,
lookups fall back to the RPC, and the announced blocks are withdrawn."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
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
    store_planned,
    vllm_config,
)
from driver import KvsvcProcess
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm_helpers import free_port

from kvsvc.client import KVCacheClient
from kvsvc.integrations.vllm.common import Op, chunk_key
from kvsvc.integrations.vllm.connector import KvsvcConnector


def until(what: str, ok: Callable[[], Any], limit: float = 15) -> Any:
    deadline = time.monotonic() + limit
    while not (got := ok()):
        assert time.monotonic() < deadline, f"{what}: not within {limit} s"
        time.sleep(0.05)
    return got


def step_output() -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
        num_scheduled_tokens={},
        preempted_req_ids=None,
    )


class Events:
    """What take_events published, step after step (as vLLM's scheduler calls it)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.stored: set[int] = set()
        self.removed: set[int] = set()

    def poll(self) -> Events:
        for e in self.conn.take_events():
            assert (e.medium, e.locality, e.ownership) == ("CPU", "LOCAL", "kvsvc")
            if isinstance(e, BlockStored):
                self.stored.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.removed.update(e.block_hashes)
        return self


def ext(hs: list[bytes]) -> set[int]:
    return {maybe_convert_block_hash(h) for h in hs}


@pytest.fixture
def server(tmp_path: Path):
    s = KvsvcProcess(free_port(), "", str(tmp_path), store_bytes="1M")
    yield s
    s.kill()


def test_index_hints_stale_hits_and_kv_events(server, monkeypatch) -> None:
    port = int(server.address.rsplit(":", 1)[1])
    cfg = vllm_config(port, tp=1, kv_events=True, reconnect_interval_s=0.5)
    w, caches = make_worker(monkeypatch, cfg, 0)
    sched = KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
    events = Events(sched)
    hs = hashes(4, b"presence")
    for layer in caches:
        layer[:4].normal_()
    store_planned(sched.sched, w, "s", hs)

    # The index answers (no Lookup RPC), and the stored chunks are announced.
    req = request("r", hs)
    until("a hint of 4 chunks", lambda: matched(sched, req, 0) == (4 * BLOCK, True))
    assert sched.counters.get("lookups_from_index", 0) >= 1
    assert not sched.counters.get("lookups_rpc")
    until("4 BlockStored", lambda: events.poll().stored >= ext(hs))
    assert events.stored == ext(hs) and not events.removed

    # Evicted after the hint: other writes fill the 1 MiB store.
    ns = sched.sched.namespace
    with KVCacheClient(server.address) as c:
        for i in range(64):
            c.put("other", [(b"o%d" % i, bytes(64 * 1024))], timeout=10)
            if c.lookup([chunk_key(0, h) for h in hs], namespace=ns, timeout=5) == 0:
                break
        assert c.lookup([chunk_key(0, hs[0])], namespace=ns, timeout=5) == 0, "not evicted"
    blocks = SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23, 24],))
    sched.update_state_after_alloc(req, blocks, 4 * BLOCK)
    meta = sched.build_connector_meta(step_output())
    assert meta.loads == [Op("r", [(h, [20 + i]) for i, h in enumerate(hs)])]
    run_step(w, meta, load=True)
    r = settle(w, "r", recv=True)
    assert not r.failed_recving
    # vLLM recomputes exactly the blocks the stale hint promised.
    assert w.get_block_ids_with_load_errors() == {20, 21, 22, 23}
    until("4 BlockRemoved", lambda: events.poll().removed >= ext(hs))

    # A chunk announced, then the server dies: unknown, Lookup RPCs, withdrawn.
    more = hashes(2, b"more")
    store_planned(sched.sched, w, "m", more)
    until("2 more BlockStored", lambda: events.poll().stored >= ext(more))
    server.kill()
    until("the index unknown", lambda: not sched.sched.hints.fresh, limit=5)
    x = request("x", more)
    # A Lookup off the scheduler's thread ("not yet" meanwhile), which fails: a miss.
    assert matched(sched, x, 0) == (0, False)
    assert sched.counters.get("lookup_errors", 0) + sched.counters.get("lookups_skipped_down", 0)
    until("withdrawn", lambda: events.poll().removed >= ext(more), limit=5)
    for c in (sched, w):
        c.shutdown()
