"""KvsvcHiCacheStorage against SGLang 0.5.23's real classes: built by SGLang's own
dynamic backend factory from the documented extra config, registered with SGLang's
real host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost) in every layout they
offer, driven through the zero-copy v1 calls SGLang's controller makes, against a
real `kvsvc serve` that is killed, stopped and restarted under it."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="runs in .venv-sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_pools import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    REFUSED_LAYOUTS,
    fill_pages,
    indices,
    mha_pool,
    mla_pool,
    page_bytes,
)
from support import ServerProcess

from kvsvc.integrations.sglang.pages import LayoutRefused
from kvsvc.integrations.sglang.storage import KvsvcHiCacheStorage


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    shm = tmp_path_factory.mktemp("shm")
    srv = ServerProcess(shm, "--store-bytes", "256M")
    yield srv
    srv.kill()


def storage_config(
    target: str, *, mla: bool = False, rank: int = 0, tp: int = 1, **extra: Any
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=rank,
        tp_size=tp,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="test/tiny-model",
        extra_config={
            "backend_name": "kvsvc",
            "module_path": "kvsvc.integrations.sglang",
            "class_name": "KvsvcHiCacheStorage",
            "interface_v1": 1,
            "target": target,
            "reconnect_interval_s": 0.3,
            # Hit counts are asserted: a Lookup on a busy 2-core machine may take
            # longer than the 50 ms default (which would be a miss, by design).
            "lookup_timeout_s": 5.0,
            **extra,
        },
    )


def backend(pool: Any, cfg: HiCacheStorageConfig) -> KvsvcHiCacheStorage:
    """As SGLang's cache controller makes it: the factory, then register_mem_pool_host."""
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(b, KvsvcHiCacheStorage) and isinstance(b, HiCacheStorage)
    b.register_mem_pool_host(pool)
    return b


def keys(tag: str, n: int) -> list[str]:
    return [f"{tag}-{i:04d}" for i in range(n)]


POOLS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


def make_pool(kind: str, layout: str) -> Any:
    return mha_pool(layout) if kind == "mha" else mla_pool(layout)


@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_round_trip_bit_exact(server: ServerProcess, kind: str, layout: str) -> None:
    """Pages written by one engine's backend are read bit-exact into another
    engine's host pool, at other host pages; a miss stops the run."""
    cfg = storage_config(server.address, mla=kind == "mla")
    src, dst = make_pool(kind, layout), make_pool(kind, layout)
    a, b = backend(src, cfg), backend(dst, cfg)
    try:
        ks = keys(f"rt-{kind}-{layout}", 6)
        src_pages, dst_pages = [1, 3, 4, 7, 9, 10], [2, 5, 6, 8, 11, 12]
        fill_pages(src, src_pages, seed=len(layout))
        assert a.batch_set_v1(ks, indices(src, src_pages)) == [True] * 6
        assert b.batch_exists(ks) == 6
        probe = [*ks[:3], "absent-key", *ks[3:]]
        assert b.batch_exists(probe) == 3
        got = b.batch_get_v1(probe, indices(dst, [*dst_pages[:3], 13, *dst_pages[3:]]))
        assert got == [True, True, True, False, False, False, False]
        for s, d in zip(src_pages[:3], dst_pages[:3], strict=True):
            assert page_bytes(dst, d) == page_bytes(src, s)
        assert page_bytes(dst, dst_pages[3]) == bytes(len(page_bytes(dst, 0)))  # untouched
        assert b.batch_get_v1(ks, indices(dst, dst_pages)) == [True] * 6
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert page_bytes(dst, d) == page_bytes(src, s)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_refused_layouts_one_line(server: ServerProcess, kind: str) -> None:
    for layout in REFUSED_LAYOUTS:
        pool = make_pool(kind, layout)
        b = StorageBackendFactory.create_backend(
            "dynamic", storage_config(server.address, mla=kind == "mla"), pool
        )
        with pytest.raises(LayoutRefused) as e:
            b.register_mem_pool_host(pool)
        assert "\n" not in str(e.value) and "page_unified" in str(e.value)


def test_tp2_mha_each_rank_its_own_heads(server: ServerProcess) -> None:
    pools = [mha_pool("page_first") for _ in range(2)]
    bs = [backend(p, storage_config(server.address, rank=r, tp=2)) for r, p in enumerate(pools)]
    try:
        ks = keys("tp2-mha", 4)
        for r, p in enumerate(pools):
            fill_pages(p, [1, 2, 3, 4], seed=100 + r)
            assert bs[r].batch_set_v1(ks, indices(p, [1, 2, 3, 4])) == [True] * 4
        readers = [mha_pool("page_first") for _ in range(2)]
        rb = [
            backend(p, storage_config(server.address, rank=r, tp=2)) for r, p in enumerate(readers)
        ]
        for r in range(2):
            assert rb[r].batch_get_v1(ks, indices(readers[r], [5, 6, 7, 8])) == [True] * 4
            for s, d in zip([1, 2, 3, 4], [5, 6, 7, 8], strict=True):
                assert page_bytes(readers[r], d) == page_bytes(pools[r], s)
        # tp 1 is another head split: it shares nothing with tp 2's pages
        solo = backend(mha_pool("page_first"), storage_config(server.address))
        assert solo.batch_exists(ks) == 0
        for b in [*rb, solo]:
            b.close()
    finally:
        for b in bs:
            b.close()


def test_tp2_mla_one_copy_shared_by_every_rank(server: ServerProcess) -> None:
    """MLA pages are the same on every rank: one copy under one key serves them all.
    A rank that is not the storage writer still stores when called (SGLang's own
    storage tests ask this of a backend; its controller calls only the writer)."""
    pools = [mla_pool("page_first") for _ in range(2)]
    bs = [
        backend(p, storage_config(server.address, mla=True, rank=r, tp=2))
        for r, p in enumerate(pools)
    ]
    try:
        assert bs[0].sc.is_storage_writer and not bs[1].sc.is_storage_writer
        ks = keys("tp2-mla", 3)
        fill_pages(pools[1], [1, 2, 3], seed=7)
        assert bs[1].batch_set_v1(ks, indices(pools[1], [1, 2, 3])) == [True] * 3
        assert bs[0].batch_exists(ks) == 3
        assert bs[0].batch_get_v1(ks, indices(pools[0], [4, 5, 6])) == [True] * 3
        for s, d in zip([1, 2, 3], [4, 5, 6], strict=True):
            assert page_bytes(pools[0], d) == page_bytes(pools[1], s)
        # the writer's copy of the same pages is the same entry: present, not stored
        assert bs[0].batch_set_v1(ks, indices(pools[0], [4, 5, 6])) == [True] * 3
        assert bs[0].counters.get("pages_stored", 0) == 0
    finally:
        for b in bs:
            b.close()


def test_tensor_calls_round_trip(server: ServerProcess) -> None:
    """The path without interface_v1, as SGLang's generic page get/set uses it."""
    src, dst = mha_pool("page_first"), mha_pool("page_first")
    cfg = storage_config(server.address)
    a, b = backend(src, cfg), backend(dst, cfg)
    try:
        fill_pages(src, [1, 2], seed=3)
        ks = keys("tensor", 2)
        assert a.batch_set(ks, [src.get_data_page(p * src.page_size) for p in (1, 2)])
        assert b.exists(ks[0]) and not b.exists("nope")
        got = b.batch_get([*ks, "nope"], [dst.get_dummy_flat_data_page() for _ in range(3)])
        assert got[2] is None and got[0] is not None and got[1] is not None
        for i, p in enumerate((3, 4)):
            dst.set_from_flat_data_page(p * dst.page_size, got[i])
        assert page_bytes(dst, 3) == page_bytes(src, 1)
        assert page_bytes(dst, 4) == page_bytes(src, 2)
        assert b.get("nope") is None
        assert b.get_stats() is None  # SGLang did not ask for storage metrics
    finally:
        a.close()
        b.close()


def test_storage_metrics_are_sglangs(server: ServerProcess) -> None:
    """With --enable-storage-metrics SGLang logs what get_stats returns through its
    own collector (a StorageMetrics, asserted there): pages and GB/s per batch."""
    from sglang.srt.observability.metrics_collector import (
        StorageMetrics,
        StorageMetricsCollector,
    )

    cfg = storage_config(server.address)
    cfg.enable_storage_metrics = True
    pool = mha_pool("page_first")
    b = backend(pool, cfg)
    try:
        ks = keys("metrics", 3)
        assert b.batch_set_v1(ks, indices(pool, [1, 2, 3])) == [True] * 3
        assert b.batch_get_v1(ks, indices(pool, [4, 5, 6])) == [True] * 3
        m = b.get_stats()
        assert isinstance(m, StorageMetrics)
        assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
        assert all(bw > 0 for bw in [*m.backup_bandwidth, *m.prefetch_bandwidth])
        StorageMetricsCollector(labels={"storage_backend": "kvsvc"}).log_storage_metrics(m)
        assert b.get_stats().prefetch_pgs == []  # since the last call
    finally:
        b.close()


def _no_wrong_bytes(
    pool: Any, got: list[bool], src: Any, src_pages: list[int], dst_pages: list[int]
) -> None:
    """A page reported loaded holds exactly its bytes; the run is leading."""
    assert isinstance(got, list) and all(isinstance(x, bool) for x in got)
    n = sum(got)
    assert got == [True] * n + [False] * (len(got) - n)
    for s, d in zip(src_pages[:n], dst_pages[:n], strict=True):
        assert page_bytes(pool, d) == page_bytes(src, s)


def wait_down(b: KvsvcHiCacheStorage, ks: list[str]) -> None:
    """The presence index may answer from memory until it learns its stream ended
    (at most its stale_after_s, 1 s): a stale hint, which a read then misses."""
    deadline = time.monotonic() + 10
    while (n := b.batch_exists(ks)) != 0:
        assert isinstance(n, int)
        assert time.monotonic() < deadline, "batch_exists still hits 10 s after a kill"
        time.sleep(0.05)


def test_kill_stop_restart_never_raise_never_wrong(tmp_path: Path) -> None:
    """kvsvc killed, SIGSTOPped and restarted under running backends: every call
    returns its type within its deadline; hits come back after the restart."""
    port = free_port()
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProcess(shm, port=port)
    extra = {"load_timeout_s": 2.0, "store_timeout_s": 2.0, "fence_timeout_s": 2.0}
    cfg = storage_config(srv.address, **extra)
    src, dst = mha_pool("page_first"), mha_pool("page_first")
    a, b = backend(src, cfg), backend(dst, cfg)
    ks = keys("faults", 5)
    sp, dp = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    fill_pages(src, sp, seed=11)
    try:
        assert a.batch_set_v1(ks, indices(src, sp)) == [True] * 5
        assert b.batch_get_v1(ks, indices(dst, dp)) == [True] * 5
        _no_wrong_bytes(dst, [True] * 5, src, sp, dp)

        # SIGSTOP: answers within the call's deadline (plus margin), as misses
        srv.signal(signal.SIGSTOP)
        try:
            for call in (
                lambda: b.batch_exists(ks),
                lambda: b.batch_get_v1(ks, indices(dst, dp)),
                lambda: a.batch_set_v1(ks, indices(src, sp)),
            ):
                t0 = time.monotonic()
                r = call()
                assert time.monotonic() - t0 < 5.0 + 10  # the call's deadline + margin
                assert r in (0, [False] * 5) or isinstance(r, list)
                if isinstance(r, list):
                    _no_wrong_bytes(dst, r, src, sp, dp)
        finally:
            srv.signal(signal.SIGCONT)
        # back: hits again once the link's down time passed (and the fence proved)
        deadline = time.monotonic() + 30
        while b.batch_get_v1(ks, indices(dst, dp)) != [True] * 5:
            assert time.monotonic() < deadline, "no hits after SIGCONT"
            time.sleep(0.2)
        _no_wrong_bytes(dst, [True] * 5, src, sp, dp)

        # kill -9: misses, never an exception
        srv.kill()
        wait_down(b, ks)
        for _ in range(3):
            assert b.batch_exists(ks) == 0
            assert b.batch_get_v1(ks, indices(dst, dp)) == [False] * 5
            assert a.batch_set_v1(ks, indices(src, sp)) == [False] * 5
            time.sleep(0.2)

        # restarted on the same address: an empty store (misses), then writes and hits
        srv = ServerProcess(shm, port=port)
        deadline = time.monotonic() + 30
        while a.batch_set_v1(ks, indices(src, sp)) != [True] * 5:
            assert time.monotonic() < deadline, "no writes after the restart"
            time.sleep(0.2)
        for p in dp:  # so that only a real load can make them right
            dst.get_data_page(p * dst.page_size).zero_()
        deadline = time.monotonic() + 30
        while (got := b.batch_get_v1(ks, indices(dst, dp))) != [True] * 5:
            _no_wrong_bytes(dst, got, src, sp, dp)
            assert time.monotonic() < deadline, "no hits after the restart"
            time.sleep(0.2)
        _no_wrong_bytes(dst, got, src, sp, dp)
        # the presence index (a hint, following the events stream) catches up
        deadline = time.monotonic() + 10
        while (n := b.batch_exists(ks)) != 5:
            assert isinstance(n, int) and time.monotonic() < deadline, n
            time.sleep(0.05)
    finally:
        a.close()
        b.close()
        srv.kill()


def test_a_corrupt_page_is_never_reported_loaded(make_server: Any) -> None:
    """A page whose stored bytes fail kvsvc's CRC-32C is False, and so is every
    page after it; the pages before it load bit-exact; its host page is untouched.
    (An in-process server, tests/conftest.py's, so that a stored byte can be flipped.)"""
    server = make_server()
    cfg = storage_config(server.address)
    src, dst = mha_pool("page_first"), mha_pool("page_first")
    a, b = backend(src, cfg), backend(dst, cfg)
    try:
        ks = keys("corrupt", 4)
        fill_pages(src, [1, 2, 3, 4], seed=21)
        assert a.batch_set_v1(ks, indices(src, [1, 2, 3, 4])) == [True] * 4
        store = server.server.servicer.store
        mapping = a.lanes["set"].mapping
        assert mapping is not None
        chunk = store.get(a.namespace, a.key(ks[2]), mapping.layout_fingerprint)
        assert chunk is not None
        store.view[chunk.offset + 100] ^= 0xFF
        got = b.batch_get_v1(ks, indices(dst, [5, 6, 7, 8]))
        assert got == [True, True, False, False]
        assert page_bytes(dst, 5) == page_bytes(src, 1)
        assert page_bytes(dst, 6) == page_bytes(src, 2)
        zero = bytes(len(page_bytes(dst, 7)))
        assert page_bytes(dst, 7) == zero and page_bytes(dst, 8) == zero
        assert store.checksum_failures == 1
        assert b.batch_exists(ks) in (2, 4)  # dropped: a hint may lag the drop
    finally:
        a.close()
        b.close()


def test_a_miss_in_a_later_piece_ends_the_run(server: ServerProcess) -> None:
    """A batch goes to kvsvc in pieces of PIECE_PAGES: a miss in the second piece is
    False with every page after it (later pieces loaded or not), the pages before it
    bit-exact, the pages after it untouched."""
    from kvsvc.integrations.sglang.storage import PIECE_PAGES

    n = 2 * PIECE_PAGES + 8
    cfg = storage_config(server.address)
    src = mha_pool("page_first", device_tokens=n * 4)
    dst = mha_pool("page_first", device_tokens=n * 4)
    a, b = backend(src, cfg), backend(dst, cfg)
    try:
        ks = keys("pieces", n)
        sp = list(range(1, n + 1))
        fill_pages(src, sp, seed=31)
        assert a.batch_set_v1(ks, indices(src, sp)) == [True] * n
        miss = PIECE_PAGES + 3
        probe = [*ks[:miss], "absent", *ks[miss + 1 :]]
        got = b.batch_get_v1(probe, indices(dst, sp))
        assert got == [True] * miss + [False] * (n - miss)
        zero = bytes(len(page_bytes(dst, 1)))
        for p in sp[:miss]:
            assert page_bytes(dst, p) == page_bytes(src, p)
        for p in sp[miss:]:
            assert page_bytes(dst, p) == zero
    finally:
        a.close()
        b.close()
