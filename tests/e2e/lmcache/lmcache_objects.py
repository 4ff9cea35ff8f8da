"""LMCache's own objects for driving an L2 adapter as its controllers do: keys
(``ObjectKey``), memory objects (``TensorMemoryObj`` over one L1-like buffer, as
LMCache's ``check`` mode builds them), the adapter built by LMCache's factory from
the same ``--l2-adapter`` JSON its server parses, and the eventfd waits."""

from __future__ import annotations

import argparse
import hashlib
import json
import select
import time
from typing import Any

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.config import L1MemoryManagerConfig
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd


def plugin_spec(target: str, **params: Any) -> str:
    """The ``--l2-adapter`` JSON of docs/lmcache.md."""
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvsvc.integrations.lmcache",
            "class_name": "KvsvcL2Adapter",
            "adapter_params": {
                "target": target,
                "reconnect_interval_s": 0.3,
                # Bitmaps are asserted: a Lookup on a busy 2-core machine may take
                # longer than the 50 ms default (which would be absent, by design).
                "lookup_timeout_s": 5.0,
                **params,
            },
        }
    )


class L1:
    """One buffer cut into objects, like LMCache's L1 arena: anonymous memory (what
    LMCache allocates without ``--shm-name``: the adapter's staging path)."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.used = 0

    def desc(self) -> L1MemoryDesc:
        return L1MemoryDesc(ptr=self.buffer.data_ptr(), size=self.buffer.numel(), align_bytes=1)

    def close(self) -> None:
        pass

    def objects(self, n: int, size: int, seed: int | None = None) -> list[TensorMemoryObj]:
        out = []
        for i in range(n):
            raw = self.buffer[self.used : self.used + size]
            assert raw.numel() == size, "L1 buffer too small"
            self.used += size
            if seed is not None:
                g = torch.Generator().manual_seed(seed * 1000 + i)
                raw.copy_(torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8))
            meta = MemoryObjMetadata(
                shape=torch.Size([size // 2]),
                dtype=torch.float16,
                address=raw.data_ptr(),
                phy_size=size,
                fmt=MemoryFormat.KV_2LTD,
                ref_count=1,
            )
            out.append(TensorMemoryObj(raw.view(torch.float16), meta, parent_allocator=None))
        return out


class ShmL1(L1):
    """LMCache's own L1 memory manager with ``shm_name`` set (what its MP server
    builds with ``--shm-name``): the arena is a POSIX shm file, and its descriptor
    is the one LMCache's storage manager hands its L2 adapters (the direct path)."""

    def __init__(self, nbytes: int, name: str) -> None:
        self.manager = L1MemoryManager(
            L1MemoryManagerConfig(size_in_bytes=nbytes, use_lazy=False, shm_name=name)
        )
        self.buffer = self.manager._allocator.buffer[:nbytes]
        self.used = 0

    def desc(self) -> L1MemoryDesc:
        return self.manager.get_l1_memory_desc()

    def close(self) -> None:
        self.manager.close()


def obj_bytes(obj: TensorMemoryObj) -> bytes:
    return bytes(obj.raw_tensor.view(torch.uint8).numpy().tobytes())


def keys(tag: str, n: int, model: str = "test/model", salt: str = "") -> list[ObjectKey]:
    return [
        ObjectKey(
            chunk_hash=hashlib.sha256(f"{tag}-{i}".encode()).digest(),
            model_name=model,
            kv_rank=0,
            cache_salt=salt,
        )
        for i in range(n)
    ]


def make_adapter(target: str, l1: L1, **params: Any) -> Any:
    """As LMCache's server builds it: its parser, then its factory."""
    cfg = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[plugin_spec(target, **params)])
    )
    return create_l2_adapter(cfg.adapters[0], l1_memory_desc=l1.desc())


def wait_fd(fd: int, timeout_s: float) -> float:
    """Seconds until ``fd`` is signalled (consumed); AssertionError after ``timeout_s``."""
    t0 = time.monotonic()
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    assert poll.poll(int(timeout_s * 1000)), f"eventfd {fd} not signalled in {timeout_s} s"
    consume_fd(fd)
    return time.monotonic() - t0


def _result(adapter: Any, fd: int, query: Any, timeout_s: float) -> tuple[Any, float]:
    """The task's result, polling its eventfd as LMCache's controllers do (one signal
    may cover several tasks; a result is given out once)."""
    t0 = time.monotonic()
    while True:
        got = query()
        if got is not None:
            return got, time.monotonic() - t0
        left = timeout_s - (time.monotonic() - t0)
        assert left > 0, f"no result within {timeout_s} s"
        wait_fd(fd, left)


def store(adapter: Any, ks: list[Any], objs: list[Any], timeout_s: float = 60) -> tuple[Any, float]:
    task = adapter.submit_store_task(ks, objs)
    held: dict[int, Any] = {}

    def query() -> Any:
        held.update(adapter.pop_completed_store_tasks())
        return held.pop(task, None)

    return _result(adapter, adapter.get_store_event_fd(), query, timeout_s)


def lookup(adapter: Any, ks: list[Any], timeout_s: float = 60) -> tuple[list[bool], float]:
    task = adapter.submit_lookup_and_lock_task(ks, {})
    bm, took = _result(
        adapter,
        adapter.get_lookup_and_lock_event_fd(),
        lambda: adapter.query_lookup_and_lock_result(task),
        timeout_s,
    )
    adapter.submit_unlock(ks)
    return [bool(bm.test(i)) for i in range(len(ks))], took


def submit_load(adapter: Any, ks: list[Any], objs: list[Any]) -> int:
    """A load task, its result left to the caller (``query_load_result``)."""
    return int(adapter.submit_load_task(ks, objs))


def load(
    adapter: Any, ks: list[Any], objs: list[Any], timeout_s: float = 60
) -> tuple[list[bool], float]:
    task = submit_load(adapter, ks, objs)
    bm, took = _result(
        adapter, adapter.get_load_event_fd(), lambda: adapter.query_load_result(task), timeout_s
    )
    return [bool(bm.test(i)) for i in range(len(ks))], took
