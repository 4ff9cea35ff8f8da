"""KvsvcHiCacheStorage held to what SGLang's own storage tests ask of a backend.

SGLang 0.5.23's wheel ships storage tests written against the generic
``HiCacheStorage`` interface (``srt/mem_cache/storage/mooncake_store/
test_mooncake_store.py``, ``simm/test_simm.py``): a host pool that is only a flat
buffer, a layout name, a page size and ``get_page_buffer_meta`` (K and V runs per
page for MHA, one run for MLA); pointer-style ``set``/``exists``/``get`` with
``target_location``/``target_sizes``; ``batch_set_v1`` / ``batch_exists`` /
``batch_get_v1`` round trips for MHA and MLA at several TP ranks, including a rank
that is not the MLA storage writer. The same behaviours are asserted here of kvsvc,
with pools of our own making and page sizes above 1, together with what issue 41
asks on top: one-line refusals (before registration, at registration), ``clear()``
dropping the deployment's namespace, reads that do not wait on writes, and the
version gate."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="runs in .venv-sglang")

import torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_pools import fill_pages, indices, mha_pool, page_bytes
from support import ServerProcess
from test_storage import storage_config

from kvsvc.integrations.sglang.pages import LayoutRefused
from kvsvc.integrations.sglang.storage import KvsvcHiCacheStorage

HERE = Path(__file__).resolve().parent


class FlatHostPool:
    """A host pool as SGLang's generic storage tests describe one: a flat float32
    buffer, a layout name, a page size and ``get_page_buffer_meta`` (nothing else).
    Each page is ``runs`` runs (MHA: K and V, MLA: one) of ``page_size * elements``
    values; ``split``: the K runs of all pages first, then the V runs (as SGLang's own
    pools keep V at an offset), else each page's runs side by side."""

    def __init__(
        self,
        pages: int,
        *,
        runs: int = 2,
        elements: int = 64,
        page_size: int = 1,
        split: bool = False,
        layout: str = "page_first",
    ) -> None:
        self.memory = torch.zeros(pages * runs * page_size * elements, dtype=torch.float32)
        self.kv_buffer: torch.Tensor | None = self.memory
        self.layout = layout
        self.page_size = page_size
        self.pages, self.runs, self.split = pages, runs, split
        self.run = page_size * elements  # values per run

    def offset(self, page: int, run: int) -> int:
        if self.split:
            return (run * self.pages + page) * self.run
        return (page * self.runs + run) * self.run

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base, el = self.memory.data_ptr(), self.memory.element_size()
        ptrs, sizes = [], []
        for i in range(0, len(indices), self.page_size):
            page = int(indices[i]) // self.page_size
            for r in range(self.runs):
                ptrs.append(base + self.offset(page, r) * el)
                sizes.append(self.run * el)
        return ptrs, sizes

    def page(self, page: int) -> torch.Tensor:
        runs = [self.offset(page, r) for r in range(self.runs)]
        return torch.cat([self.memory[o : o + self.run] for o in runs])

    def fill(self, pages: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in pages:
            for r in range(self.runs):
                o = self.offset(p, r)
                self.memory[o : o + self.run] = torch.randn(self.run, generator=g)

    def indices(self, pages: list[int]) -> torch.Tensor:
        ps = self.page_size
        return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = ServerProcess(tmp_path_factory.mktemp("shm"), "--store-bytes", "128M")
    yield srv
    srv.kill()


def made(cfg: Any, pool: Any) -> KvsvcHiCacheStorage:
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(b, KvsvcHiCacheStorage)
    return b


def registered(cfg: Any, pool: Any) -> KvsvcHiCacheStorage:
    b = made(cfg, pool)
    b.register_mem_pool_host(pool)
    return b


def captured(caplog: pytest.LogCaptureFixture) -> Any:
    """The backend's logger does not propagate (it has its own handler): capture it."""
    logger = logging.getLogger("kvsvc.sglang")
    logger.addHandler(caplog.handler)
    return logger


def test_pointer_set_exists_get(server: ServerProcess) -> None:
    """SGLang's single-operation test: ``set``/``get`` by host pointer and size."""
    pool = FlatHostPool(8, elements=256)
    b = registered(storage_config(server.address, presence=False), pool)
    try:
        pool.fill([0], seed=1)
        el = pool.memory.element_size()
        src, dst = pool.memory[:256], pool.memory[256:512]
        size = 256 * el
        assert b.set("single", target_location=src.data_ptr(), target_sizes=size) is True
        assert b.exists("single")
        assert b.get("single", target_location=dst.data_ptr(), target_sizes=size) is True
        assert torch.equal(src, dst)
        # a miss is False, a pointer outside the host pool is refused: neither raises
        assert b.get("absent", target_location=dst.data_ptr(), target_sizes=size) is False
        outside = torch.zeros(256)
        assert b.set("x", target_location=outside.data_ptr(), target_sizes=size) is False
        assert b.get("single", target_location=outside.data_ptr(), target_sizes=size) is False
        assert torch.equal(outside, torch.zeros(256))
        # batch forms: leading keys loaded, and a bool for the writes
        ptrs = [pool.memory[i * 256 :].data_ptr() for i in (4, 5)]
        assert b.batch_set(["p4", "p5"], target_locations=ptrs, target_sizes=[size, size])
        assert b.batch_get(["p4", "absent", "p5"], [ptrs[0], ptrs[1], ptrs[1]], size) == 1
    finally:
        b.close()


CONFIGS = [(False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)]


@pytest.mark.parametrize(("mla", "rank", "tp"), CONFIGS)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("split", [False, True])
def test_batch_v1_flat_buffer(
    server: ServerProcess, mla: bool, rank: int, tp: int, page_size: int, split: bool
) -> None:
    """SGLang's batch test over a flat buffer (MHA: K and V runs, MLA: one run; an
    MLA rank that is not the storage writer included), at page sizes 1 and 4."""
    tag = f"flat-{mla}-{rank}-{tp}-{page_size}-{split}"
    pool = FlatHostPool(32, runs=1 if mla else 2, page_size=page_size, split=split)
    b = registered(storage_config(server.address, mla=mla, rank=rank, tp=tp), pool)
    try:
        keys = [f"{tag}-{i}" for i in range(13)]
        src, dst = list(range(13)), list(range(13, 26))
        pool.fill(src, seed=page_size)
        assert b.batch_set_v1(keys, pool.indices(src)) == [True] * 13
        assert b.batch_exists(keys) == 13
        assert b.batch_get_v1(keys, pool.indices(dst)) == [True] * 13
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(pool.page(s), pool.page(d))
    finally:
        b.close()


def test_a_layout_only_sglang_describes(server: ServerProcess) -> None:
    """The layout's name means nothing to kvsvc: pages are what SGLang reports."""
    pool = FlatHostPool(8, layout="a_layout_kvsvc_never_heard_of", split=True, page_size=2)
    b = registered(storage_config(server.address), pool)
    try:
        pool.fill([1, 2], seed=3)
        assert b.batch_set_v1(["new-1", "new-2"], pool.indices([1, 2])) == [True, True]
        assert b.batch_get_v1(["new-1", "new-2"], pool.indices([5, 6])) == [True, True]
        assert torch.equal(pool.page(1), pool.page(5))
        assert torch.equal(pool.page(2), pool.page(6))
    finally:
        b.close()


def test_calls_before_register_are_refused_in_one_line(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    pool = FlatHostPool(4)
    b = made(storage_config(server.address), pool)
    logger = captured(caplog)
    try:
        caplog.clear()
        idx = pool.indices([0, 1])
        ptr, size = pool.memory.data_ptr(), 64 * 4
        for _ in range(2):
            assert b.batch_exists(["a", "b"]) == 0
            assert b.exists("a") is False
            assert b.batch_get_v1(["a", "b"], idx) == [False, False]
            assert b.batch_set_v1(["a", "b"], idx) == [False, False]
            assert b.get("a", target_location=ptr, target_sizes=size) is False
            assert b.set("a", target_location=ptr, target_sizes=size) is False
            assert b.batch_set(["a"], [torch.zeros(4)]) is False
            assert b.batch_get(["a"]) == [None]
            b.clear()
        lines = [r.getMessage() for r in caplog.records if r.name == "kvsvc.sglang"]
        assert len(lines) == 1, lines
        assert "register_mem_pool_host" in lines[0] and "\n" not in lines[0]
    finally:
        logger.removeHandler(caplog.handler)
        b.close()


class NoMeta:
    layout, page_size = "page_first", 1
    kv_buffer = torch.zeros(64)


class MetaRefuses(FlatHostPool):
    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        raise ValueError("Unsupported layout: page_unified")


class NoBuffer(FlatHostPool):
    """Pages SGLang describes, but no kv_buffer naming the memory they lie in."""

    def __init__(self) -> None:
        super().__init__(4)
        self.kv_buffer = None


@pytest.mark.parametrize(
    "pool", [NoMeta(), MetaRefuses(4), NoBuffer()], ids=lambda p: type(p).__name__
)
def test_pools_it_cannot_copy_are_refused_at_register(server: ServerProcess, pool: Any) -> None:
    b = made(storage_config(server.address), pool)
    with pytest.raises(LayoutRefused) as e:
        b.register_mem_pool_host(pool)
    assert "\n" not in str(e.value) and str(e.value).startswith("kvsvc:")
    assert b.batch_get_v1(["a"], torch.tensor([0])) == [False]  # refused, not raised
    b.close()


def test_a_call_sglang_cannot_describe_is_a_miss(server: ServerProcess) -> None:
    """Host indices that are not whole pages, or fewer than the keys: a miss."""
    pool = FlatHostPool(8, page_size=4)
    b = registered(storage_config(server.address), pool)
    try:
        assert b.batch_set_v1(["w1", "w2"], torch.arange(6)) == [False, False]
        assert b.batch_get_v1(["w1", "w2"], torch.arange(4)) == [False, False]
    finally:
        b.close()


def test_clear_drops_the_namespace(server: ServerProcess) -> None:
    """SGLang's cache flush empties this deployment's KV in kvsvc; another
    deployment (another namespace) keeps its own."""
    ours, theirs = mha_pool("page_first"), mha_pool("page_first")
    a = registered(storage_config(server.address, presence=False), ours)
    other = registered(storage_config(server.address, presence=False, namespace="other"), theirs)
    try:
        keys = ["c1", "c2", "c3"]
        fill_pages(ours, [1, 2, 3], seed=5)
        fill_pages(theirs, [1, 2, 3], seed=6)
        assert a.batch_set_v1(keys, indices(ours, [1, 2, 3])) == [True] * 3
        assert other.batch_set_v1(keys, indices(theirs, [1, 2, 3])) == [True] * 3
        a.clear()
        assert a.batch_exists(keys) == 0
        assert a.batch_get_v1(keys, indices(ours, [4, 5, 6])) == [False] * 3
        assert other.batch_exists(keys) == 3
    finally:
        a.close()
        other.close()


def test_prefetch_does_not_wait_for_backup(tmp_path: Path) -> None:
    """Every Store kvsvc serves takes 6 s (a failpoint): a read of stored pages
    while a write is in flight answers long before the write does."""
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProcess(shm, env={"KVSVC_FAILPOINTS": "handler.enter=Store@sleep(6000)"})
    pool = mha_pool("page_first")
    b = registered(storage_config(srv.address, store_timeout_s=20.0), pool)
    try:
        fill_pages(pool, [1, 2, 3, 4], seed=9)
        assert b.batch_set_v1(["r1", "r2"], indices(pool, [1, 2])) == [True, True]
        backup = threading.Thread(
            target=b.batch_set_v1, args=(["r3", "r4"], indices(pool, [3, 4])), daemon=True
        )
        backup.start()
        time.sleep(0.5)  # the write holds its staging region now
        t0 = time.monotonic()
        assert b.batch_get_v1(["r1", "r2"], indices(pool, [8, 9])) == [True, True]
        assert time.monotonic() - t0 < 3.0  # the write still has >= 5 s to go
        assert page_bytes(pool, 8) == page_bytes(pool, 1)
        backup.join(30)
    finally:
        b.close()
        srv.kill()


def _import_storage(prelude: str) -> subprocess.CompletedProcess[str]:
    """Import the backend in a fresh interpreter after ``prelude`` changed SGLang."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from cpu_imports import absent_torchvision; absent_torchvision()\n"
        f"{prelude}\n"
        "import kvsvc.integrations.sglang.storage as s\n"
        "print('imported', s.KvsvcHiCacheStorage.__name__)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(HERE)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_an_untested_release_warns_once_and_runs() -> None:
    r = _import_storage("import sglang; sglang.__version__ = '0.6.1'")
    assert "imported KvsvcHiCacheStorage" in r.stdout, r.stderr
    warned = [line for line in r.stderr.splitlines() if "outside the tested range" in line]
    assert len(warned) == 1 and "0.6.1" in warned[0] and "0.5.23" in warned[0]


def test_absent_seams_are_a_clear_import_error() -> None:
    r = _import_storage(
        "import sglang.srt.mem_cache.hicache_storage as h\ndel h.HiCacheStorage.batch_get_v1"
    )
    assert r.returncode != 0 and "imported" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "HiCacheStorage.batch_get_v1" in last, last
    assert "tested with SGLang 0.5.23" in last


def test_writes_queued_behind_a_slow_one_answer_by_their_deadline(tmp_path: Path) -> None:
    """Every Store kvsvc serves takes 20 s; store_timeout_s is 4. Two backups at once
    on one backend: each answers ``False``s within its own deadline (plus margin),
    the second not after waiting out the first one's deadline and then its own."""
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProcess(shm, env={"KVSVC_FAILPOINTS": "handler.enter=Store@sleep(20000)"})
    pool = mha_pool("page_first")
    b = registered(storage_config(srv.address, store_timeout_s=4.0), pool)
    took: dict[int, float] = {}
    results: dict[int, list[bool]] = {}

    def backup(i: int) -> None:
        t0 = time.monotonic()
        results[i] = b.batch_set_v1([f"q{i}"], indices(pool, [i + 1]))
        took[i] = time.monotonic() - t0

    try:
        threads = [threading.Thread(target=backup, args=(i,), daemon=True) for i in (0, 1)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join(60)
        assert results == {0: [False], 1: [False]}
        assert max(took.values()) < 4.0 + 2.5, took
    finally:
        b.close()
        srv.kill()
