"""vLLM's KV cache as a kvsvc region (worker side).

On CPU, vLLM's cache is one zeroed allocation viewed per layer. At
``register_kv_caches`` a sealed memfd is mapped over the pages of that
allocation (``mmap(MAP_FIXED | MAP_SHARED)``, an OS call on this process's own
address space): every pointer into the cache stays valid, whoever holds it, and
the server maps the same memfd. No torch internals are touched. The bytes of the
first and last page that lie outside vLLM's tensor (the allocator's own) are
copied into the memfd first, so they keep their values. Its pages are faulted in
on a thread of their own (``populate``), so the hook returns at once.

Where the cache cannot be mapped over (it shares its pages' mapping with
something that is not anonymous memory, or the mmap fails), the region is a
mirror instead: a memfd of the same layout that the server maps, and each
transfer copies its blocks between vLLM's tensors and the mirror on the worker
(``Staging``): slower, never a dropped transfer. On CUDA the tensors are
described by their IPC handles."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from dataclasses import dataclass

import torch

from kvsvc.client.fdpass import make_sealed_memfd
from kvsvc.client.kvcache import rank_context
from kvsvc.integrations.vllm.common import log
from kvsvc.layout import dtype_code
from kvsvc.v1 import kv_cache_service_pb2 as pb

PAGE = mmap.PAGESIZE


@dataclass
class Staging:
    """The mirror's views beside vLLM's: ``to_mirror`` before a Store reads the
    mirror, ``from_mirror`` after a Retrieve wrote it."""

    vllm: list[torch.Tensor]
    mirror: list[torch.Tensor]
    block_dim: int

    def _copy(self, src: list[torch.Tensor], dst: list[torch.Tensor], blocks: list[int]) -> None:
        idx = torch.tensor(blocks, dtype=torch.long)
        for s, d in zip(src, dst, strict=True):
            d.index_copy_(self.block_dim, idx, s.index_select(self.block_dim, idx))

    def to_mirror(self, blocks: list[int]) -> None:
        self._copy(self.vllm, self.mirror, blocks)

    def from_mirror(self, blocks: list[int]) -> None:
        self._copy(self.mirror, self.vllm, blocks)


@dataclass
class KvRegion:
    """What Map needs from this worker, and what must outlive vLLM's tensors."""

    region: pb.RankRegion
    fd: int = -1  # the memfd to pass to the server (CPU); -1: none (CUDA IPC)
    mm: mmap.mmap | None = None  # the mirror's mapping (staging only): never closed
    staging: Staging | None = None  # None: the server reads and writes vLLM's memory


def describe_kv_caches(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, rank: int, tp: int
) -> KvRegion:
    """The region of vLLM's KV tensors: mapped over in place on CPU, else a mirror."""
    tensors = list(kv_caches.values())
    dim = block_dim(tensors[0], num_blocks)
    if tensors[0].is_cuda:
        from kvsvc.client.kvcache import describe_cuda_tensors

        return KvRegion(
            describe_cuda_tensors(tensors, block_dim=dim, context=rank_context(rank, tp))
        )
    storage = tensors[0].untyped_storage()
    base = storage.data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        raise RuntimeError("the KV tensors do not share one storage (a newer vLLM?)")
    try:
        return mapped_region(tensors, dim, rank, tp)
    except OSError as exc:
        log.warning(
            "kvsvc: vLLM's KV cache cannot be mapped in place (%s); each transfer copies "
            "its blocks through a mirror memfd instead (slower, and the cache's size again "
            "in memory)",
            exc,
        )
        return mirror_region(tensors, dim, rank, tp)


def _region(
    tensors: list[torch.Tensor], block_dim: int, rank: int, tp: int, origin: int, size: int
) -> pb.RankRegion:
    """Each tensor at its offset from ``origin`` in a memfd of ``size`` bytes."""
    return pb.RankRegion(
        context=rank_context(rank, tp),
        tensors=[
            pb.KVTensor(
                name=f"layer.{i}",
                handle=pb.MemoryHandle(
                    sealed_memfd=pb.SealedMemfdHandle(token="", size_bytes=size)
                ),
                offset_bytes=t.data_ptr() - origin,
                shape=list(t.shape),
                strides=list(t.stride()),
                dtype=dtype_code(str(t.dtype)),  # type: ignore[arg-type]
                block_dim=block_dim,
            )
            for i, t in enumerate(tensors)
        ],
    )


def mapped_region(tensors: list[torch.Tensor], block_dim: int, rank: int, tp: int) -> KvRegion:
    """Map a sealed memfd over the pages of the one storage all layers view; raises
    OSError (nothing changed) when those pages are not plain anonymous memory."""
    storage = tensors[0].untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    start = base - base % PAGE
    end = -(-(base + nbytes) // PAGE) * PAGE
    check_anonymous(start, end)
    region = _region(tensors, block_dim, rank, tp, start, end - start)
    t0 = time.perf_counter()
    fd = make_sealed_memfd(f"kvsvc-vllm-tp{rank}", end - start)
    try:
        # The allocator's bytes around vLLM's tensor, kept (vLLM's own are zeros).
        os.pwrite(fd, ctypes.string_at(start, base - start), 0)
        tail = end - (base + nbytes)
        os.pwrite(fd, ctypes.string_at(base + nbytes, tail), base + nbytes - start)
        map_fixed(start, end - start, fd)
        populate(start, end - start, fd)
    except BaseException:
        os.close(fd)
        raise
    log.info(
        "kvsvc: vLLM's KV cache (%d layers, %.1f MiB) mapped over by a sealed memfd in %.1f ms",
        len(tensors),
        nbytes / (1 << 20),
        (time.perf_counter() - t0) * 1000,
    )
    return KvRegion(region, fd)


def mirror_region(tensors: list[torch.Tensor], block_dim: int, rank: int, tp: int) -> KvRegion:
    """A memfd laid out as vLLM's storage, that transfers stage through."""
    storage = tensors[0].untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    fd = make_sealed_memfd(f"kvsvc-vllm-mirror-tp{rank}", nbytes)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    # vLLM's views are of its int8 buffer viewed as their dtype: the same here.
    mirror = [
        raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset()) for t in tensors
    ]
    region = _region(tensors, block_dim, rank, tp, base, nbytes)
    return KvRegion(region, fd, mm, Staging(tensors, mirror, block_dim))


def check_anonymous(start: int, end: int) -> None:
    """[start, end) lies in one private anonymous mapping of this process (not the
    heap, a stack or a file): mapping over it then affects no one else's memory
    but the allocation's own bytes, which are copied."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= start < hi:
                name = fields[5] if len(fields) > 5 else ""
                if end > hi or name or fields[1] != "rw-p":
                    raise OSError(
                        f"the KV cache's pages [{start:#x}, {end:#x}) lie in mapping "
                        f"{fields[0]} {fields[1]} {name or '(anonymous)'}"
                    )
                return
    raise OSError(f"the KV cache's first page {start:#x} is in no mapping")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
MAP_FIXED = 0x10  # Linux (mman-common.h); Python's mmap module does not export it


def map_fixed(addr: int, length: int, fd: int, *, now: bool = False) -> None:
    """``fd`` mapped shared at exactly ``addr``, replacing the pages there;
    ``now``: populated before it returns (``MAP_POPULATE``)."""
    flags = mmap.MAP_SHARED | MAP_FIXED | (getattr(mmap, "MAP_POPULATE", 0) if now else 0)
    got = _libc.mmap(addr, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(MAP_FIXED) over the KV cache: {os.strerror(err)}")


_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; faults pages in writable, data unchanged
POPULATE_STEP = 64 << 20


def populate(addr: int, length: int, fd: int) -> None:
    """Fault the memfd's pages in, as vLLM's ``torch.zeros`` touched its own (a
    first write to a block must not fault on the request path): on a thread of its
    own with ``MADV_POPULATE_WRITE``, which leaves the bytes as they are, so vLLM
    may use the cache meanwhile and the hook returns at once; where the kernel
    lacks it, here, by mapping the same memfd again with ``MAP_POPULATE`` (nothing
    has written the cache yet)."""
    if _libc.madvise(addr, min(length, POPULATE_STEP), MADV_POPULATE_WRITE) != 0:
        map_fixed(addr, length, fd, now=True)
        return

    def rest() -> None:
        t0 = time.perf_counter()
        for off in range(POPULATE_STEP, length, POPULATE_STEP):
            if _libc.madvise(addr + off, min(POPULATE_STEP, length - off), MADV_POPULATE_WRITE):
                return  # unmapped meanwhile (vLLM freed its cache): nothing left to do
        log.info(
            "kvsvc: the KV cache's %.1f MiB populated in %.1f s (in the background)",
            length / (1 << 20),
            time.perf_counter() - t0,
        )

    threading.Thread(target=rest, name="kvsvc-populate", daemon=True).start()


def block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension that indexes blocks: of size ``num_blocks`` and, if several
    are, the outermost of them (largest stride: a block is a contiguous run in
    every layout vLLM uses). vLLM's layouts differ by version and backend; none
    is hard-coded."""
    dims = [i for i, s in enumerate(t.shape) if s == num_blocks]
    if not dims:
        raise RuntimeError(f"no dimension of KV shape {tuple(t.shape)} has {num_blocks} blocks")
    return max(dims, key=lambda i: t.stride(i))
