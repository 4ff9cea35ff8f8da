"""KvsvcTier held to what vLLM's own tier tests assert of its file-system and
object-store tiers (vllm-project/vllm tests/v1/kv_offload/tiering/test_fs_tier.py,
test_obj_tier.py), against a real `kvsvc serve`: the tier built as those tests
build theirs (a spec holding an OffloadingConfig, a private torch tensor as the
primary view, rows of float32 so a row's elements are not its bytes) and driven by
hand in vLLM's call order (submit, drain_jobs, get_finished_jobs, lookup asked
again while RETRY, on_request_finished).

- JobResult rules: one result per job, exactly once; a store reported successful
  only when every key was stored; a load of keys kvsvc lacks fails; a batched load
  that stops at a missing key reports the keys before it as ``successful_keys``
  (None when the first one failed); rows out of the primary view's range fail the
  job; an empty job succeeds.
- Lookup: MISS on an empty tier, HIT once a store is finished, the keys loaded
  bit-exact into other chunk ids; a load that failed makes those keys a MISS for
  the same request (no promotion re-issued every step) until it finishes.
- Locality: validated at construction (``"local"``, ``""`` refused with vLLM's
  ``Locality`` error), reported as configured (None when unset), through vLLM's
  factory and in the tier's KV events.
- Cross-TP: a replicated layout written at TP2 is read at TP4 (rank 3), bit-exact;
  without a shareable layout the two TP sizes never share (a miss).
- shutdown with jobs queued answers them and stops the threads; twice is fine."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering", reason="the vLLM tests run in .venv-vllm")

import torch
from driver import KvsvcProcess
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm_helpers import free_port

from kvsvc.integrations.vllm.tier import KvsvcTier

CHUNKS = 8
ROW_FLOATS = 4096  # 16 KiB rows of float32
MODULE = "kvsvc.integrations.vllm.tier"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvsvcProcess]:
    proc = KvsvcProcess(free_port(), "", str(tmp_path_factory.mktemp("contract")))
    yield proc
    proc.kill()


def spec(
    *,
    tp: int = 1,
    rank: int = 0,
    replicated: bool = False,
    events: bool = False,
    model: str = "contract-model",
) -> SimpleNamespace:
    """What a tier reads of vLLM's spec: its OffloadingConfig and KV-events flag."""
    config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id=f"contract-{os.urandom(4).hex()}",
        model=OffloadingModelConfig(name=model, dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=replicated,
    )
    kv_events = OffloadingKVEventsConfig(
        enable_kv_cache_events=events, self_describing_kv_events=False
    )
    return SimpleNamespace(config=config, kv_events_config=kv_events, blocks_per_chunk=1)


def private_tensor(chunks: int = CHUNKS) -> torch.Tensor:
    """The primary view as vLLM's tier tests make it: a tensor of this process."""
    return torch.zeros((chunks, ROW_FLOATS), dtype=torch.float32)


def make_tier(
    server: KvsvcProcess, tensor: torch.Tensor, s: SimpleNamespace | None = None, **keys: Any
) -> KvsvcTier:
    keys.setdefault("reconnect_interval_s", 0.5)
    return KvsvcTier(
        offloading_spec=s or spec(),
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="KvsvcTier",
        target=server.address,
        **keys,
    )


def new_keys(n: int) -> list[OffloadKey]:
    return [make_offload_key(os.urandom(8), 0) for _ in range(n)]


def job(job_id: int, keys: list[OffloadKey], chunks: list[int], req: str = "r") -> TransferJob:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunks, dtype=np.int64),
        is_promotion=False,
        req_context=ReqContext(req_id=req),
    )


def drain(tier: KvsvcTier) -> list[JobResult]:
    """vLLM's order at a reset or shutdown: drain_jobs, then every result is ready."""
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup(tier: KvsvcTier, keys: list[OffloadKey], req: str = "r", timeout: float = 30):
    """Each key asked as vLLM's manager asks: again on a later step while RETRY."""
    ctx = ReqContext(req_id=req)
    end = time.monotonic() + timeout
    while True:
        got = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in got:
            return got
        assert time.monotonic() < end, got
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.01)


def wait_index(tier: KvsvcTier, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not (tier.hints.index is not None and tier.hints.index.fresh):
        assert time.monotonic() < end, "the tier's presence index did not open"
        time.sleep(0.02)


@pytest.fixture
def tier(server: KvsvcProcess) -> Iterator[tuple[KvsvcTier, torch.Tensor]]:
    tensor = private_tensor()
    t = make_tier(server, tensor)
    yield t, tensor
    t.shutdown()


# --- a private tensor as the primary view ---
@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_a_private_tensor_view_stores_and_loads_bit_exact(tier, n) -> None:
    """As vLLM's data-integrity test: rows stored from chunks [0, n), the tensor
    zeroed, loaded into chunks [CHUNKS - n, CHUNKS): every row back bit-exact (an
    empty job too). vLLM's own tests hand a tier exactly this kind of view."""
    t, tensor = tier
    tensor[:] = torch.rand(CHUNKS, ROW_FLOATS)
    expected = tensor[:n].clone()
    keys = new_keys(n)
    t.submit_store(job(1, keys, list(range(n))))
    (stored,) = drain(t)
    assert stored.job_id == 1 and stored.success, t.counters
    if n:
        assert lookup(t, keys) == [LookupResult.HIT] * n
    tensor[:] = 0.0
    t.submit_load(job(2, keys, list(range(CHUNKS - n, CHUNKS))))
    (loaded,) = drain(t)
    assert loaded.job_id == 2 and loaded.success and loaded.successful_keys is None
    assert torch.equal(tensor[CHUNKS - n :], expected)
    assert not t.counters["hook_errors"]


def test_a_view_kvsvc_cannot_map_is_staged_not_dropped(server) -> None:
    """vLLM 0.32's real view (its offload file) and this one both go through the
    tier's own staging memfd: the tensor's memory is never named to kvsvc, and no
    store is dropped for it."""
    tensor = private_tensor()
    t = make_tier(server, tensor)
    try:
        tensor[:] = torch.rand(CHUNKS, ROW_FLOATS)
        keys = new_keys(CHUNKS)
        t.submit_store(job(1, keys, list(range(CHUNKS))))
        assert [r.success for r in drain(t)] == [True]
        assert t.counters["stored_chunks"] == CHUNKS and not t.counters["stores_dropped"]
    finally:
        t.shutdown()


# --- JobResult rules ---
def test_each_job_is_answered_once_and_independently(tier) -> None:
    t, _ = tier
    a, b = new_keys(1), new_keys(1)
    t.submit_store(job(1, a, [0]))
    t.submit_store(job(2, b, [1]))
    results = drain(t)
    assert sorted(r.job_id for r in results) == [1, 2] and all(r.success for r in results)
    assert list(t.get_finished_jobs()) == []
    assert lookup(t, a + b) == [LookupResult.HIT] * 2


def test_loads_of_absent_keys_fail_with_the_leading_keys_reported(tier) -> None:
    """Missing key: the job fails. A batch stopped at a missing key: the keys
    before it are ``successful_keys`` (their rows loaded); the first key missing:
    ``successful_keys`` is None."""
    t, tensor = tier
    tensor[:] = torch.rand(CHUNKS, ROW_FLOATS)
    stored = new_keys(2)
    rows = tensor[:2].clone()
    t.submit_store(job(1, stored, [0, 1]))
    assert all(r.success for r in drain(t))
    (absent,) = new_keys(1)

    t.submit_load(job(2, [absent], [2]))
    (r,) = drain(t)
    assert r.job_id == 2 and not r.success and r.successful_keys is None

    tensor[4:7] = 0.0
    t.submit_load(job(3, [*stored, absent], [4, 5, 6]))
    (r,) = drain(t)
    assert r.job_id == 3 and not r.success
    assert tuple(r.successful_keys) == tuple(stored)
    assert torch.equal(tensor[4:6], rows)

    t.submit_load(job(4, [absent, *stored], [4, 5, 6]))
    (r,) = drain(t)
    assert not r.success and r.successful_keys is None


def test_rows_out_of_the_primary_range_fail_the_job(tier) -> None:
    t, _ = tier
    keys = new_keys(1)
    t.submit_store(job(1, keys, [CHUNKS]))
    (r,) = drain(t)
    assert r.job_id == 1 and not r.success
    t.submit_load(job(2, keys, [CHUNKS]))
    (r,) = drain(t)
    assert r.job_id == 2 and not r.success
    assert not t.counters["hook_errors"]


def test_a_failed_load_is_a_miss_for_its_request_until_it_finishes(tmp_path) -> None:
    """kvsvc holds the key (the index says HIT) but every Retrieve fails: the
    failed promotion turns the key into a MISS for the same request, so vLLM's
    scheduler does not re-issue the doomed load every step; another request asks
    kvsvc again (HIT), and the request's end forgets the verdict."""
    srv = KvsvcProcess(free_port(), "handler.enter=Retrieve@raise", str(tmp_path))
    tensor = private_tensor()
    t = make_tier(srv, tensor)
    try:
        keys = new_keys(1)
        t.submit_store(job(1, keys, [0]))
        assert all(r.success for r in drain(t))
        wait_index(t)
        assert lookup(t, keys, req="a") == [LookupResult.HIT]
        t.submit_load(job(2, keys, [1], req="a"))
        (r,) = drain(t)
        assert not r.success
        assert lookup(t, keys, req="a") == [LookupResult.MISS]
        assert lookup(t, keys, req="b") == [LookupResult.HIT]
        t.on_request_finished(ReqContext(req_id="a"))
        assert lookup(t, keys, req="a") == [LookupResult.HIT]
    finally:
        t.shutdown()
        srv.kill()


def test_shutdown_answers_queued_jobs_and_is_idempotent(server) -> None:
    tensor = private_tensor()
    t = make_tier(server, tensor)
    for i in range(10):
        t.submit_store(job(i, new_keys(1), [i % CHUNKS]))
    t.shutdown()
    t.shutdown()
    assert not any(th.is_alive() for th in t.mover.threads)
    assert sorted(r.job_id for r in t.get_finished_jobs()) == list(range(10))
    assert not t.mover.pending()


# --- locality ---
@pytest.mark.parametrize("locality", ["local", ""])
def test_an_invalid_locality_is_refused_at_construction(server, locality) -> None:
    with pytest.raises(ValueError, match="Locality"):
        make_tier(server, private_tensor(2), locality=locality)


def test_an_unknown_key_is_refused_at_construction(server) -> None:
    with pytest.raises(ValueError, match="no_such_key"):
        make_tier(server, private_tensor(2), no_such_key=1)


@pytest.mark.parametrize(
    ("config", "expected"),
    [({}, None), ({"locality": None}, None), ({"locality": "LOCAL"}, Locality.LOCAL),
     ({"locality": "REMOTE"}, Locality.REMOTE)],
)  # fmt: skip
def test_vllms_factory_reports_locality_as_configured(server, config, expected) -> None:
    tensor = private_tensor(2)
    t = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvsvcTier", "module_path": MODULE, "target": server.address, **config},
        memoryview(tensor.numpy()),
        spec(),
    )
    try:
        assert type(t) is KvsvcTier and t.locality is expected
    finally:
        t.shutdown()


@pytest.mark.parametrize(("locality", "expected"), [(None, None), ("REMOTE", Locality.REMOTE)])
def test_kv_events_carry_the_configured_locality(server, locality, expected) -> None:
    tensor = private_tensor(2)
    extra = {} if locality is None else {"locality": locality}
    t = make_tier(server, tensor, spec(events=True), **extra)
    try:
        wait_index(t)
        keys = new_keys(1)
        t.submit_store(job(1, keys, [0]))
        assert all(r.success for r in drain(t))
        events: list[Any] = []
        end = time.monotonic() + 30
        while not any(not e.removed and keys[0] in list(e.keys) for e in events):
            assert time.monotonic() < end, events
            events += list(t.take_events())
            time.sleep(0.02)
        for e in events:
            assert e.locality is expected and e.medium is Medium.CPU, e
    finally:
        t.shutdown()


def test_kv_events_need_vllms_global_flag(server) -> None:
    t = make_tier(server, private_tensor(2), spec(events=False), enable_kv_events=True)
    try:
        assert t.events is None and list(t.take_events()) == []
    finally:
        t.shutdown()


# --- across tensor-parallel sizes ---
def test_a_replicated_layout_is_shared_across_tp_sizes(server) -> None:
    """Written by TP2's scheduler (replicated: one copy of the row), read by TP4's
    (rank 3): one namespace, a HIT, the row bit-exact, as vLLM's fs tier shares it."""
    wt, rt = private_tensor(4), private_tensor(4)
    wt[:] = torch.rand(4, ROW_FLOATS)
    expected = wt[0].clone()
    writer = make_tier(server, wt, spec(tp=2, replicated=True, model="xtp"))
    reader = make_tier(server, rt, spec(tp=4, rank=3, replicated=True, model="xtp"))
    try:
        assert writer.namespace == reader.namespace
        keys = new_keys(1)
        writer.submit_store(job(1, keys, [0]))
        assert all(r.success for r in drain(writer))
        wait_index(reader)
        end = time.monotonic() + 30
        while lookup(reader, keys) != [LookupResult.HIT]:
            assert time.monotonic() < end, reader.counters
            time.sleep(0.02)
        reader.submit_load(job(2, keys, [1]))
        assert all(r.success for r in drain(reader))
        assert torch.equal(rt[1], expected)
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_per_rank_layout_is_never_shared_across_tp_sizes(server) -> None:
    """Each worker's slot holds its own shard: TP2 and TP4 rows are different
    bytes, so their namespaces differ and TP4 misses what TP2 stored."""
    wt, rt = private_tensor(4), private_tensor(4)
    writer = make_tier(server, wt, spec(tp=2, model="xtp-sharded"))
    reader = make_tier(server, rt, spec(tp=4, rank=3, model="xtp-sharded"))
    try:
        assert writer.namespace != reader.namespace
        keys = new_keys(1)
        writer.submit_store(job(1, keys, [0]))
        assert all(r.success for r in drain(writer))
        wait_index(reader)
        assert lookup(reader, keys) == [LookupResult.MISS]
    finally:
        writer.shutdown()
        reader.shutdown()
