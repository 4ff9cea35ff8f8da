"""KvsvcConnector held to what vLLM's tests assert of vLLM's own connectors, with
the connector's halves driven directly (direct.py) against a real `kvsvc serve`:

- the KV memory: the worker maps what vLLM allocated without moving it (every
  pointer into the cache stays valid; the server sees vLLM's writes and vLLM the
  server's), and a cache that cannot be mapped over still transfers, bit-exact,
  through a mirror;
- ``get_num_new_matched_tokens`` never waits on kvsvc: with no index answer, or
  for a salted request, it answers ``None`` (vLLM's "ask again next step") at once
  and the Lookup's answer later;
- ``handle_preemptions`` returns within a bound even while kvsvc does not answer;
- KV events in vLLM's form (tests/v1/kv_connector/unit/offloading_connector/
  test_events.py: ``medium`` ``CPU``, ``locality`` ``LOCAL``, placeholder stores
  with ``block_size`` 0, removals with their medium and group), announcing only
  the chunks this engine stored, and again after an eviction and a new store."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.distributed", reason="the vLLM connector tests run in .venv-vllm")

import direct
import torch
from direct import (
    BLOCK,
    KV_CACHE_CONFIG,
    NUM_BLOCKS,
    hashes,
    make_worker,
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
from kvsvc.integrations.vllm.common import KvsvcConnectorMetadata, Op, chunk_key
from kvsvc.integrations.vllm.connector import KvsvcConnector
from kvsvc.integrations.vllm.region import describe_kv_caches


def until(what: str, ok: Callable[[], Any], limit: float = 20) -> Any:
    deadline = time.monotonic() + limit
    while not (got := ok()):
        assert time.monotonic() < deadline, f"{what}: not within {limit} s"
        time.sleep(0.02)
    return got


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KvsvcProcess]:
    s = KvsvcProcess(free_port(), "", str(tmp_path), store_bytes="2M")
    yield s
    s.kill()


def port_of(s: KvsvcProcess) -> int:
    return int(s.address.rsplit(":", 1)[1])


def big_kv_caches(layer_bytes: int = 32 << 20) -> dict[str, torch.Tensor]:
    """As vLLM allocates on CPU (one zeroed int8 buffer, bf16 views per layer), at
    a size the allocator serves from a mapping of its own, as vLLM's real cache
    (GiBs) always is."""
    buf = torch.zeros(2 * layer_bytes, dtype=torch.int8)
    per_block = layer_bytes // NUM_BLOCKS // 2  # bf16 elements of one block
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * layer_bytes : (i + 1) * layer_bytes]
        .view(torch.bfloat16)
        .view(NUM_BLOCKS, 2, BLOCK, per_block // (2 * BLOCK))
        for i in range(2)
    }


# --- (a) vLLM's KV memory: mapped where it is, never moved ---


def test_kv_cache_is_mapped_where_vllm_allocated_it() -> None:
    caches = big_kv_caches()
    layers = list(caches.values())
    ptrs = [t.data_ptr() for t in layers]
    kv = describe_kv_caches(caches, NUM_BLOCKS, 0, 1)
    # Every pointer vLLM (and its kernels, and its other views) holds is still valid.
    assert [t.data_ptr() for t in layers] == ptrs, "vLLM's KV memory was moved"
    assert getattr(kv, "staging", None) is None, "a cache of its own mapping is mapped in place"
    size = os.fstat(kv.fd).st_size
    assert size % mmap.PAGESIZE == 0
    server_view = torch.frombuffer(mmap.mmap(kv.fd, size, flags=mmap.MAP_SHARED), dtype=torch.uint8)
    t = kv.region.tensors[1]
    block_bytes = layers[1][0].numel() * 2
    at = t.offset_bytes + 5 * block_bytes
    layers[1][5].fill_(1.5)  # vLLM writes a block: the server reads it
    assert torch.equal(server_view[at : at + block_bytes], layers[1][5].view(-1).view(torch.uint8))
    server_view[at : at + block_bytes].zero_()  # the server loads a block: vLLM reads it
    assert not layers[1][5].any()


def test_a_cache_that_cannot_be_mapped_in_place_still_transfers_bit_exact(
    server: KvsvcProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvsvc.integrations.vllm.region as region

    def refuse(*a: Any) -> None:
        raise OSError("not its own mapping")

    monkeypatch.setattr(region, "check_anonymous", refuse)
    cfg = vllm_config(port_of(server), tp=1)
    w, layers = make_worker(monkeypatch, cfg, 0)
    assert w.worker.staging is not None
    hs = hashes(3, b"mirror")
    for t in layers:
        t[:3].normal_()
    want = [t[:3].clone() for t in layers]
    run_step(
        w, KvsvcConnectorMetadata(stores=[Op("s", [(h, [i]) for i, h in enumerate(hs)])]), False
    )
    settle(w, "s", recv=False)
    for t in layers:
        t[:3].zero_()  # vLLM reuses the blocks meanwhile: the stored bytes stay right
    run_step(
        w, KvsvcConnectorMetadata(loads=[Op("l", [(h, [10 + i]) for i, h in enumerate(hs)])]), True
    )
    settle(w, "l", recv=True)
    assert not w.get_block_ids_with_load_errors()
    for t, old in zip(layers, want, strict=True):
        assert torch.equal(t[10:13], old)
    w.shutdown()


# --- (b) the scheduler's thread never waits on kvsvc ---


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port that accepts connections and never answers (a kvsvc that hangs)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield s.getsockname()[1]
    s.close()


def ask(sched: Any, req: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    got = sched.get_num_new_matched_tokens(req, 0)
    return got, time.perf_counter() - t0


@pytest.mark.parametrize("salted", [False, True], ids=["index-unknown", "salted"])
def test_matched_tokens_never_waits_on_kvsvc(black_hole: int, salted: bool) -> None:
    # presence off: the index never answers (as when it is stale); salted: the
    # index follows the deployment's namespace only.
    extra: dict[str, Any] = {"salt_namespaces": True} if salted else {"presence": False}
    cfg = vllm_config(black_hole, tp=1, lookup_timeout_s=3.0, reconnect_interval_s=60, **extra)
    sched = KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
    req = request("r", hashes(4, b"wait"))
    req.cache_salt = "tenant-a" if salted else None
    first, took = ask(sched, req)
    assert first == (None, False), "not yet: vLLM asks again next step"
    assert took < 0.5, f"the first call waited {took:.2f} s"
    slowest = 0.0
    while (got := ask(sched, req))[0] == (None, False):
        slowest = max(slowest, got[1])
        time.sleep(0.05)
    assert slowest < 0.5, f"a call waited {slowest:.2f} s"
    assert got[0] == (0, False), "a Lookup that timed out is a miss"
    sched.shutdown()


def test_matched_tokens_hits_after_not_yet(
    server: KvsvcProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = vllm_config(port_of(server), tp=1, presence=False)
    w, _layers = make_worker(monkeypatch, cfg, 0)
    sched = KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
    hs = hashes(3, b"hit")
    run_step(
        w, KvsvcConnectorMetadata(stores=[Op("s", [(h, [i]) for i, h in enumerate(hs)])]), False
    )
    settle(w, "s", recv=False)
    req = request("r", hs)
    answers = []
    until(
        "an answer",
        lambda: (
            answers.append(sched.get_num_new_matched_tokens(req, 0)) or answers[-1][0] is not None
        ),
    )
    assert answers[0] == (None, False)
    assert answers[-1] == (3 * BLOCK, True)
    # The plan that follows is the one a direct answer makes.
    sched.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10],)), 3 * BLOCK
    )
    meta = sched.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
            num_scheduled_tokens={},
            preempted_req_ids=None,
        )
    )
    assert meta.loads == [Op("r", [(h, [7 + i]) for i, h in enumerate(hs)])]
    for c in (sched, w):
        c.shutdown()


# --- (c) handle_preemptions is bounded ---


def test_handle_preemptions_returns_while_kvsvc_hangs(
    server: KvsvcProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = vllm_config(port_of(server), tp=1, store_timeout_s=8.0)
    # In place (a store reads vLLM's blocks): the case where preemption matters.
    monkeypatch.setattr(direct, "vllm_like_kv_caches", big_kv_caches)
    w, _layers = make_worker(monkeypatch, cfg, 0)
    assert getattr(w.worker, "staging", None) is None
    os.killpg(server.proc.pid, signal.SIGSTOP)  # kvsvc hangs mid-store
    try:
        run_step(w, KvsvcConnectorMetadata(stores=[Op("p", [(hashes(1, b"p")[0], [3])])]), False)
        meta = KvsvcConnectorMetadata(preempted={"p"})
        t0 = time.monotonic()
        w.handle_preemptions(meta)
        took = time.monotonic() - t0
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
    assert took < 0.5, f"handle_preemptions waited {took:.2f} s"
    assert w.counters.get("preempted_running_stores") == 1
    w.shutdown()


# --- (d) KV events: vLLM's form, only what this engine can load ---


class Events:
    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.all: list[Any] = []

    def poll(self) -> Events:
        self.all.extend(self.conn.take_events())
        return self

    def hashes(self, kind: type) -> set[int]:
        return {h for e in self.all if isinstance(e, kind) for h in e.block_hashes}


def ext(hs: list[bytes]) -> set[int]:
    return {maybe_convert_block_hash(h) for h in hs}


def test_kv_events_in_vllm_form_only_for_blocks_this_engine_stored(
    server: KvsvcProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = vllm_config(port_of(server), tp=1, kv_events=True, reconnect_interval_s=0.5)
    w, _layers = make_worker(monkeypatch, cfg, 0)
    sched = KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
    events = Events(sched)
    until("the index", lambda: sched.sched.hints.fresh)
    # Another engine of the deployment stores its chunks: not this engine's to announce.
    theirs = hashes(3, b"theirs")
    run_step(
        w, KvsvcConnectorMetadata(stores=[Op("t", [(h, [i]) for i, h in enumerate(theirs)])]), False
    )
    settle(w, "t", recv=False)
    mine = hashes(2, b"mine")
    store_planned(sched.sched, w, "m", mine)
    until(
        "BlockStored of this engine's chunks",
        lambda: events.poll().hashes(BlockStored) >= ext(mine),
    )
    time.sleep(1.0)
    events.poll()
    assert events.hashes(BlockStored) == ext(mine), "only the chunks this engine stored"
    for e in events.all:  # vLLM's form for a secondary tier's blocks
        assert isinstance(e, BlockStored)
        assert (e.medium, e.locality, e.ownership, e.group_idx) == ("CPU", "LOCAL", "kvsvc", 0)
        assert (e.block_size, e.token_ids, e.parent_block_hash) == (0, [], None)
        assert len(e.block_hashes) == 1

    # Evicted: removed, in the same form; stored again by this engine: announced again.
    ns = sched.sched.namespace
    with KVCacheClient(server.address) as c:
        for i in range(128):
            c.put("other", [(b"o%d" % i, bytes(64 * 1024))], timeout=10)
            if c.lookup([chunk_key(0, mine[0])], namespace=ns, timeout=5) == 0:
                break
    until(
        "BlockRemoved",
        lambda: events.poll().hashes(BlockRemoved) >= {maybe_convert_block_hash(mine[0])},
    )
    removed = [e for e in events.all if isinstance(e, BlockRemoved)]
    assert all(
        (e.medium, e.locality, e.ownership, e.group_idx) == ("CPU", "LOCAL", "kvsvc", 0)
        for e in removed
    )
    assert not events.hashes(BlockRemoved) & ext(theirs), "never announced, never removed"
    n_stored = sum(isinstance(e, BlockStored) for e in events.all)
    store_planned(sched.sched, w, "m2", mine)
    until(
        "BlockStored again",
        lambda: sum(isinstance(e, BlockStored) for e in events.poll().all) > n_stored,
    )
    for c in (sched, w):
        c.shutdown()


def test_kv_events_medium_is_one_of_vllms() -> None:
    cfg = vllm_config(1, tp=1, kv_events_medium="kvsvc")
    with pytest.raises(ValueError, match="kv_events_medium"):
        KvsvcConnector(cfg, KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
