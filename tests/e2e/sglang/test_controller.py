"""SGLang's own cache-controller code paths over KvsvcHiCacheStorage: the hit query
(``_storage_hit_query``, batch_exists per 128 keys), the prefetch read
(``_page_transfer`` -> ``_page_get_zero_copy``, batch_get_v1) and the backup
(``_page_backup_or_log`` -> ``_page_set_zero_copy``, batch_set_v1), with SGLang's
real page hashes (``get_storage_hash_str``), operations and host pool.

``HiCacheController.__init__`` is skipped (``__new__``): it needs a device KV pool,
a device allocator and torch.distributed groups; the object gets the attributes
these methods read, set as that ``__init__`` sets them for ``dynamic`` with
``interface_v1``. The methods themselves are SGLang's, unchanged."""

from __future__ import annotations

import logging
from queue import Queue
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="runs in .venv-sglang")

from sglang.srt.managers import cache_controller as cc
from sglang_pools import fill_pages, indices, mha_pool, page_bytes
from support import ServerProcess
from test_storage import backend, storage_config, wait_down

PAGE = 4
PAGES = 130  # more than one STORAGE_BATCH_SIZE (128)


def controller(b: Any, pool: Any) -> Any:
    c = cc.HiCacheController.__new__(cc.HiCacheController)
    c.storage_backend = b
    c.mem_pool_host = c.storage_host_pool = pool
    c.page_size = pool.page_size
    c.prefetch_sync_queue = Queue()
    c.page_get_func = c._page_get_zero_copy
    c.page_set_func = c._page_set_zero_copy
    return c


def test_backup_hit_query_prefetch(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProcess(shm, "--store-bytes", "64M")
    cfg = storage_config(srv.address, load_timeout_s=2.0, store_timeout_s=2.0)
    src = mha_pool("page_first", page=PAGE, device_tokens=PAGES * PAGE)
    dst = mha_pool("page_first", page=PAGE, device_tokens=PAGES * PAGE)
    a, b = backend(src, cfg), backend(dst, cfg)
    try:
        tokens = list(range(1000, 1000 + PAGES * PAGE))
        hashes = cc.get_storage_hash_str(tokens, None, page_size=PAGE)
        assert len(hashes) == PAGES
        src_pages = list(range(1, PAGES + 1))
        fill_pages(src, src_pages, seed=5)
        writer = controller(a, src)
        op = cc.StorageOperation(indices(src, src_pages), tokens, hash_value=list(hashes))
        writer._page_backup_or_log(op)
        assert op.completed_tokens == PAGES * PAGE

        reader = controller(b, dst)
        pre = cc.PrefetchOperation("req-1", tokens)
        hit_hashes, hit_tokens = reader._storage_hit_query(pre)
        assert (hit_hashes, hit_tokens) == (hashes, PAGES * PAGE)
        dst_pages = [p + PAGES + 1 for p in range(PAGES)]
        pre.hash_value = hit_hashes
        pre.host_indices = indices(dst, dst_pages)
        assert reader._page_transfer(pre) == PAGES
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert page_bytes(dst, d) == page_bytes(src, s)

        # kvsvc gone: the same SGLang code gets 0 hits and a stopped backup, and
        # logs no exception (nothing was raised into it)
        srv.kill()
        wait_down(b, hashes)
        caplog.clear()
        pre = cc.PrefetchOperation("req-2", tokens)
        assert reader._storage_hit_query(pre) == ([], 0)
        pre.hash_value, pre.host_indices = hashes, indices(dst, dst_pages)
        assert reader._page_transfer(pre) == 0
        op = cc.StorageOperation(indices(src, src_pages), tokens, hash_value=list(hashes))
        writer._page_backup_or_log(op)
        assert op.completed_tokens == 0
        assert not [r for r in caplog.records if r.exc_info], "an exception reached SGLang"
    finally:
        a.close()
        b.close()
        srv.kill()
