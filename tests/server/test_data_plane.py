"""Mapped KV regions on CPU shared memory: Map, Store/Retrieve by blocks, Lookup,
Fence, Unmap, and hostile input that must be contained."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from support import (
    LAYOUTS,
    SERVING,
    fill_random,
    health_status,
    make_cache,
    truncating,
    wait_inflight,
)

from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache, rank_context
from kvsvc.errors import (
    NOT_STARTED,
    DeadlineExceeded,
    InvalidRequest,
    MappingLost,
    RegionUnavailable,
    TransferUnprovable,
)
from kvsvc.v1 import kv_cache_service_pb2 as pb

pytestmark = pytest.mark.slow  # starts servers or subprocesses


def blocks(cache: SharedKVCache, ids: list[int]) -> list[torch.Tensor]:
    return [
        layer.index_select(cache.block_dim, torch.tensor(ids)).clone() for layer in cache.layers
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_tp2_into_other_blocks_is_bit_exact(client, shm_dir, dtype, layout) -> None:
    src = [make_cache(shm_dir, f"src{r}", dtype, layout) for r in range(2)]
    dst = [make_cache(shm_dir, f"dst{r}", dtype, layout) for r in range(2)]
    for r, c in enumerate(src):
        fill_random(c, seed=r)
    ctx = [rank_context(tp_rank=r, tp_size=2, group_id="g") for r in range(2)]
    m_src = client.map("llama", [c.rank_region(ctx[i]) for i, c in enumerate(src)])
    m_dst = client.map("llama", [c.rank_region(ctx[i]) for i, c in enumerate(dst)])
    assert m_src.layout_fingerprint == m_dst.layout_fingerprint
    assert m_src.num_blocks == 12

    chunks = [(b"chunk-a", [0, 1, 2]), (b"chunk-b", [7, 3, 9])]
    r = client.store(m_src, chunks)
    assert r.stored_chunks == 2 and r.stored_bytes == 6 * m_src.block_bytes
    assert client.lookup([b"chunk-a", b"chunk-b", b"x"], mapping=m_src) == 2

    targets = [(b"chunk-a", [11, 10, 4]), (b"chunk-b", [5, 6, 8])]
    got = client.retrieve(m_dst, targets)
    assert got.loaded_chunks == 2 and got.loaded_bytes == r.stored_bytes
    for rank in range(2):
        for (_, s_ids), (_, d_ids) in zip(chunks, targets, strict=True):
            for a, b in zip(blocks(src[rank], s_ids), blocks(dst[rank], d_ids), strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert client.leased_blocks(m_dst) == set()


def test_retrieve_with_a_miss_loads_only_the_prefix(client, shm_dir) -> None:
    src, dst = make_cache(shm_dir, "src"), make_cache(shm_dir, "dst")
    fill_random(src, 1)
    sentinel = torch.full_like(dst.layers[0], 7)
    for layer in dst.layers:
        layer.copy_(sentinel)
    m_src, m_dst = client.map("ns", [src.rank_region()]), client.map("ns", [dst.rank_region()])
    client.store(m_src, [(b"a", [0]), (b"c", [2])])
    got = client.retrieve(m_dst, [(b"a", [5]), (b"b", [6]), (b"c", [7])])
    assert got.loaded_chunks == 1
    assert torch.equal(blocks(dst, [5])[0], blocks(src, [0])[0])
    for b in (6, 7):  # after the miss: never touched
        for layer in dst.layers:
            assert torch.equal(layer.select(1, b), sentinel.select(1, b))


def test_another_layout_is_a_miss_not_corrupt_data(client, shm_dir) -> None:
    """Presence is per (namespace, key, layout): a chunk stored in bf16 is a miss
    for an fp16 mapping (never its bytes), and the fp16 one can be stored beside it."""
    bf = make_cache(shm_dir, "bf", torch.bfloat16, seed=1)
    fp = make_cache(shm_dir, "fp", torch.float16, seed=2)
    m_bf, m_fp = client.map("ns", [bf.rank_region()]), client.map("ns", [fp.rank_region()])
    client.store(m_bf, [(b"k", [0])])
    assert client.lookup([b"k"], mapping=m_fp) == 0
    assert client.lookup([b"k"], namespace="ns") == 1
    before = [layer.clone() for layer in fp.layers]
    assert client.retrieve(m_fp, [(b"k", [3])]).loaded_chunks == 0
    assert all(torch.equal(a, b) for a, b in zip(before, fp.layers, strict=True))
    assert client.leased_blocks(m_fp) == set()
    # The fp16 chunk of the same key is stored, not skipped as "present".
    r = client.store(m_fp, [(b"k", [1])])
    assert (r.stored_chunks, r.present_chunks) == (1, 0)
    assert client.lookup([b"k"], mapping=m_fp) == 1
    assert client.retrieve(m_fp, [(b"k", [3])]).loaded_chunks == 1
    assert client.retrieve(m_bf, [(b"k", [3])]).loaded_chunks == 1
    for layer in fp.layers:
        assert torch.equal(layer.select(1, 3), layer.select(1, 1))
    for layer in bf.layers:
        assert torch.equal(layer.select(1, 3), layer.select(1, 0))


def test_map_is_all_or_none_and_names_the_failing_rank(server, client, shm_dir) -> None:
    caches = [make_cache(shm_dir, f"r{i}") for i in range(4)]
    regions = [
        c.rank_region(rank_context(tp_rank=i, tp_size=4, pp_rank=1, pp_size=2, group_id="grp-7"))
        for i, c in enumerate(caches)
    ]
    regions[2].tensors[1].handle.shared_memory.name = "../escape"
    before = _open_fds(shm_dir)
    with pytest.raises(InvalidRequest) as ei:
        client.map("ns", regions)
    e = ei.value
    assert e.metadata["tpRank"] == "2" and e.metadata["ppRank"] == "1"
    assert e.metadata["groupId"] == "grp-7"
    assert "tp_rank=2 pp_rank=1 group_id='grp-7' (ranks[2])" in e.message
    assert client.server_info().mappings == 0
    assert _open_fds(shm_dir) == before  # ranks 0 and 1 were rolled back
    # the same request, fixed, maps; mapping it again is idempotent
    regions[2].tensors[1].handle.shared_memory.name = "r2"
    m1 = client.map("ns", regions)
    m2 = client.map("ns", regions)
    assert m1.mapping_id == m2.mapping_id and client.server_info().mappings == 1


def _open_fds(shm_dir: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(shm_dir)):
                n += 1
        except OSError:
            pass
    return n


def test_map_waits_for_a_region_created_late(client, shm_dir) -> None:
    probe = make_cache(shm_dir, "late")
    region = probe.rank_region()
    probe.close()  # the file is gone; it appears 200 ms after Map starts
    timer = threading.Timer(0.2, lambda: fill_random(make_cache(shm_dir, "late"), 0))
    t0 = time.monotonic()  # before the timer starts: the file cannot exist before t0 + 0.2
    timer.start()
    m = client.map("ns", [region], timeout=10)
    assert time.monotonic() - t0 >= 0.2 and m.num_blocks == 12
    timer.join()


def test_map_of_a_region_never_created_names_the_last_cause(client, shm_dir) -> None:
    probe = make_cache(shm_dir, "never")
    region = probe.rank_region()
    probe.close()
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as ei:
        client.map("ns", [region], timeout=2)
    assert time.monotonic() - t0 < 2 + 3
    # The server's reply races the deadline (it retries until just before it): on a
    # loaded host gRPC's DEADLINE_EXCEEDED may win; the cause is named when it does not.
    if ei.value.reason != "TRANSPORT_DEADLINE_EXCEEDED":
        assert ei.value.reason == "REGION_NOT_READY"
        assert "No such file" in ei.value.message
        assert "No such file" in ei.value.metadata["lastError"]


def test_hostile_input_is_invalid_argument_and_server_stays_serving(server, client, shm_dir):
    cache = make_cache(shm_dir, "ok")
    outside = shm_dir.parent / "outside"
    outside.write_bytes(b"\0" * cache.size)
    os.symlink(outside, shm_dir / "link")
    for name in ("../outside", "/etc/passwd", "link", "..", "a/b", ""):
        region = cache.rank_region()
        region.tensors[0].handle.shared_memory.name = name
        with pytest.raises(InvalidRequest) as ei:
            client.map("ns", [region])
        assert ei.value.reason == "INVALID_REGION_NAME", name
    # a shape whose extent exceeds the handle
    region = cache.rank_region()
    region.tensors[0].shape[1] = 10_000
    with pytest.raises(InvalidRequest) as ei:
        client.map("ns", [region])
    assert ei.value.reason == "TENSOR_OUT_OF_BOUNDS"
    # out-of-range and empty block lists
    m = client.map("ns", [cache.rank_region()])
    with pytest.raises(InvalidRequest) as ei:
        client.store(m, [(b"k", [12])])
    assert ei.value.reason == "BLOCK_OUT_OF_RANGE" and ei.value.metadata["blockId"] == "12"
    with pytest.raises(InvalidRequest):
        client.retrieve(m, [(b"k", [])])
    assert client.leased_blocks(m) == set()
    assert health_status(server.address) == SERVING


def test_truncating_a_mapped_region_does_not_kill_the_server(server, client, shm_dir) -> None:
    cache = make_cache(shm_dir, "victim", layers=4)
    fill_random(cache, 3)
    m = client.map("ns", [cache.rank_region()])
    client.store(m, [(b"before", [0, 1])])
    with truncating(cache):
        for i in range(40):
            try:
                client.store(m, [(b"k%d" % i, [i % 12, (i + 1) % 12])])
            except RegionUnavailable as exc:
                assert exc.reason == "REGION_TRUNCATED"
    os.truncate(cache.path, 0)
    with pytest.raises(RegionUnavailable) as ei:
        client.store(m, [(b"after", [3])])
    assert ei.value.reason == "REGION_TRUNCATED"
    assert client.leased_blocks(m) == set()  # FINISHED: safe to reuse
    assert health_status(server.address) == SERVING
    assert client.lookup([b"before"], mapping=m) == 1


def test_deadline_too_short_is_not_started(make_server, shm_dir) -> None:
    srv = make_server(store_bytes=512 << 20)
    big = SharedKVCache(
        "big",
        num_layers=4,
        num_blocks=64,
        block_size=64,
        kv_heads=8,
        head_dim=128,
        shm_dir=str(shm_dir),
    )  # 64 blocks x 1 MiB
    with KVCacheClient(srv.address) as c:
        m = c.map("ns", [big.rank_region()])
        # the server's estimate: 64 MiB need ~67 s, so it refuses at once, long
        # before the client's deadline (the reply must not race it)
        srv.server.servicer.engine.rate.bytes_per_s = 1e6
        with pytest.raises(DeadlineExceeded) as ei:
            c.store(m, [(b"k", list(range(64)))], timeout=5)
        assert ei.value.reason == "DEADLINE_TOO_SHORT"
        assert (
            ei.value.transfer_state == pb.TransferState.Value("TRANSFER_STATE_NOT_STARTED")
            if hasattr(pb, "TransferState")
            else True
        )
        assert c.leased_blocks(m) == set()
        assert c.lookup([b"k"], mapping=m) == 0


def test_slow_copy_outlives_client_deadline_then_fence_proves_it(spawn, shm_dir) -> None:
    # the copy outlasts the deadline by seconds, and starts well within it
    srv = spawn(env={"KVSVC_FAILPOINTS": "transfer.copy=sleep(5000)"})
    cache = make_cache(shm_dir, "slow")
    with KVCacheClient(srv.address) as c:
        m = c.map("ns", [cache.rank_region()])
        with pytest.raises(TransferUnprovable) as ei:
            c.store(m, [(b"a", [0]), (b"b", [1])], timeout=1.5)
        assert ei.value.transfer_state == 3  # UNKNOWN
        assert c.leased_blocks(m) == {0, 1}
        r = c.fence(m, timeout=10)
        assert r.waited_transfers == 1
        assert c.leased_blocks(m) == set()
        assert c.lookup([b"a", b"b"], mapping=m) == 2  # the copy did finish


def test_unmap_waits_for_the_copy_in_flight(spawn, shm_dir) -> None:
    srv = spawn(env={"KVSVC_FAILPOINTS": "transfer.copy=sleep(3000)"})
    cache = make_cache(shm_dir, "busy")
    with KVCacheClient(srv.address) as c:
        m = c.map("ns", [cache.rank_region()])
        fut = c.store_async(m, [(b"a", [0]), (b"b", [1])])
        wait_inflight(srv.address, 1)
        r = c.unmap(m, timeout=10)
        assert r.fenced_transfers == 1
        assert fut.result(10).stored_chunks == 2  # its reply may trail Unmap's
        with pytest.raises(MappingLost):
            c.store(m, [(b"c", [2])])


def test_unmap_that_cannot_fence_in_time_keeps_the_mapping(spawn, shm_dir) -> None:
    srv = spawn(env={"KVSVC_FAILPOINTS": "transfer.copy=sleep(4000)"})
    cache = make_cache(shm_dir, "busy")
    with KVCacheClient(srv.address) as c:
        m = c.map("ns", [cache.rank_region()])
        fut = c.store_async(m, [(b"a", [0]), (b"b", [1])])
        wait_inflight(srv.address, 1)
        with pytest.raises((TransferUnprovable, DeadlineExceeded)) as ei:
            c.unmap(m, timeout=0.5)
        if isinstance(ei.value, TransferUnprovable):  # the fence ran out of time
            assert ei.value.reason == "UNMAP_FENCE_TIMEOUT" or ei.value.metadata.get("grpcCode")
        else:  # a loaded host: the 0.5 s were gone before the Unmap could start
            assert ei.value.transfer_state == NOT_STARTED, ei.value
        # Two 4 s copies, one after the other where one copy thread takes both: a
        # bound for a loaded host, not a timing claim.
        assert fut.result(60).stored_chunks == 2
        assert c.server_info().mappings == 1
        assert c.unmap(m).fenced_transfers == 0


def test_fence_bars_a_transfer_id_it_has_not_seen(client, shm_dir) -> None:
    cache = make_cache(shm_dir, "f")
    m = client.map("ns", [cache.rank_region()])
    r = client.fence(m, ["late-request-1"])
    assert r.barred_transfers == 1
    import grpc

    from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(client.target) as ch:
        resp = pb_grpc.KVCacheServiceStub(ch).Store(
            pb.StoreRequest(
                header=pb.RequestHeader(request_id="late-request-1"),
                blocks=pb.BlockChunks(
                    mapping_id=m.mapping_id, chunks=[pb.BlockChunk(key=b"k", block_ids=[0])]
                ),
            ),
            timeout=5,
        )
    assert resp.error.reason == "TRANSFER_BARRED"
    assert resp.error.transfer_state == 1  # NOT_STARTED
    assert client.lookup([b"k"], mapping=m) == 0


def test_a_call_without_deadline_gets_the_default_one(make_server, shm_dir) -> None:
    """No wait on the server is unbounded, even for a client that sets no deadline."""
    import grpc

    from kvsvc.v1 import error_pb2
    from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

    srv = make_server(default_deadline=0.5)
    probe = make_cache(shm_dir, "never2")
    region = probe.rank_region()
    probe.close()
    with grpc.insecure_channel(srv.address) as ch:
        t0 = time.monotonic()
        stub = pb_grpc.KVCacheServiceStub(ch)
        fut = stub.Map.future(pb.MapRequest(namespace="ns", ranks=[region]))
        r = fut.result(timeout=60)  # a guard only: the server answers at its 0.5 s default
    assert time.monotonic() - t0 < 30
    # Map's own retry budget names the region; the wrapper's backstop is the same deadline.
    assert r.error.reason in ("REGION_NOT_READY", "DEFAULT_DEADLINE_EXCEEDED")
    assert r.error.code == error_pb2.CODE_DEADLINE_EXCEEDED


def _grid_regions(shm_dir, num_blocks=(12, 12, 12, 12)) -> list[pb.RankRegion]:
    """Four ranks, tp 2 x pp 2: entry 3 of the request is tp_rank 1, pp_rank 1."""
    regions = []
    for i, blocks in enumerate(num_blocks):
        cache = SharedKVCache(
            f"grid{i}", num_layers=2, num_blocks=blocks, block_size=4, kv_heads=2,
            head_dim=16, shm_dir=str(shm_dir),
        )  # fmt: skip
        ctx = rank_context(tp_rank=i % 2, tp_size=2, pp_rank=i // 2, pp_size=2, group_id="g-3")
        regions.append(cache.rank_region(ctx))
    return regions


def test_map_layout_errors_name_tp_rank_pp_rank_group_and_layer(client, shm_dir) -> None:
    regions = _grid_regions(shm_dir)
    regions[3].tensors[1].dtype = 99
    with pytest.raises(InvalidRequest) as ei:
        client.map("ns", regions)
    e = ei.value
    layer = regions[3].tensors[1].name
    assert layer
    assert (e.metadata["tpRank"], e.metadata["ppRank"], e.metadata["groupId"]) == ("1", "1", "g-3")
    assert e.metadata["layer"] == layer and e.metadata["rankIndex"] == "3"
    assert e.message.startswith(f"tp_rank=1 pp_rank=1 group_id='g-3' (ranks[3]) layer '{layer}'")
    assert client.server_info().mappings == 0


def test_map_ranks_that_disagree_on_blocks_are_named(client, shm_dir) -> None:
    regions = _grid_regions(shm_dir, num_blocks=(12, 12, 8, 12))
    with pytest.raises(InvalidRequest) as ei:
        client.map("ns", regions)
    e = ei.value
    assert e.reason == "RANK_BLOCKS_DISAGREE"
    assert (e.metadata["tpRank"], e.metadata["ppRank"], e.metadata["groupId"]) == ("0", "1", "g-3")
    assert (e.metadata["numBlocks"], e.metadata["expectedBlocks"]) == ("8", "12")
    assert "tp_rank=0 pp_rank=1 group_id='g-3' (ranks[2])" in e.message
    assert client.server_info().mappings == 0
