"""SGLang's host pool as pages kvsvc can copy, described only by SGLang's own
interface: ``get_page_buffer_meta(host_indices)`` names each page as byte runs
(pointer, size) in the order that makes up the page, and ``kv_buffer`` is the host
memory those pointers lie in (what every other backend registers with its transfer
engine). Nothing is read from the buffer's shape or the layout's name, so a flat
buffer, a shaped one, MHA, MLA, every ``--hicache-mem-layout`` SGLang describes and
any page size are the same case: a page is its runs, concatenated.

Runs move with ``ctypes.memmove`` (one call a run; it releases the GIL, so the
engine's other threads run meanwhile): torch's indexed copies start a parallel region
a row, which on a loaded machine costs more than the copy (measured 0.3-0.7 GB/s
for 4 MiB rows where memmove made 5 GB/s).

Data path: one staging region per direction (``Staging``), a sealed memfd of
``STORAGE_BATCH_SIZE`` pages that kvsvc maps once. A write gathers the batch's
pages into it and Stores them as blocks; a read Retrieves into it and scatters
back. The host pool itself is not mapped: SGLang allocates it itself (``mmap``,
its unsealed ``shm`` memfd, CUDA-pinned memory), and the server maps only sealed
memory (a file its owner can shrink would SIGBUS it)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvsvc.client.fdpass import make_sealed_memfd
from kvsvc.client.kvcache import rank_context
from kvsvc.v1 import kv_cache_service_pb2 as pb


class LayoutRefused(ValueError):
    """A host pool this backend cannot copy pages of; the message is one line."""


class PagesUnavailable(ValueError):
    """One call's pages cannot be copied (SGLang described them otherwise than at
    registration, or outside its host memory); the message is one line."""


@dataclass(frozen=True)
class HostPages:
    """The pool's host buffers and the runs that make up one of its pages."""

    pool: Any
    page_size: int
    sizes: tuple[int, ...]  # the byte runs of one page, in SGLang's order
    dtype: torch.dtype
    base: int  # address of ``flat``'s first byte
    flat: torch.Tensor  # from the first buffer's start to the last one's end, as bytes
    buffers: tuple[tuple[int, int], ...]  # (start, end) of each host buffer, sorted

    @property
    def page_bytes(self) -> int:
        return sum(self.sizes)

    def runs(self, host_indices: torch.Tensor) -> list[int]:
        """The run addresses of the pages at ``host_indices`` (whole pages, as SGLang's
        controller passes them; ``len(sizes)`` a page), from SGLang's own description
        of those pages, each checked to lie inside the pool's buffers."""
        n, rest = divmod(len(host_indices), self.page_size)
        if rest:
            raise PagesUnavailable(f"{len(host_indices)} host indices are not whole pages")
        if n == 0:
            return []
        try:
            ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        except Exception as exc:  # noqa: BLE001 - SGLang's own refusal, as a miss
            raise PagesUnavailable(
                f"get_page_buffer_meta failed ({type(exc).__name__}: {exc})"
            ) from None
        if len(ptrs) != n * len(self.sizes) or list(sizes) != list(self.sizes) * n:
            raise PagesUnavailable(
                "get_page_buffer_meta describes these pages otherwise than at registration"
            )
        addrs = [int(p) for p in ptrs]
        starts = torch.tensor(addrs, dtype=torch.int64)
        self._check_inside(starts, starts + torch.tensor(self.sizes, dtype=torch.int64).repeat(n))
        return addrs

    def _check_inside(self, starts: torch.Tensor, ends: torch.Tensor) -> None:
        """Every run lies inside one of the pool's buffers: a pointer SGLang got wrong
        is a refused call, never a copy to or from memory the pool does not own."""
        lo = torch.tensor([s for s, _ in self.buffers], dtype=torch.int64)
        hi = torch.tensor([e for _, e in self.buffers], dtype=torch.int64)
        which = torch.searchsorted(lo, starts, right=True) - 1
        if bool((which < 0).any()) or bool((ends > hi[which.clamp(min=0)]).any()):
            raise PagesUnavailable("a page run lies outside the host pool's buffers")

    def gather(self, runs: list[int], dst: int) -> None:
        """Copy the whole pages whose runs are ``runs`` to ``dst``, back to back."""
        at = dst
        for src, size in zip(runs, itertools.cycle(self.sizes)):
            ctypes.memmove(at, src, size)
            at += size

    def scatter(self, src: int, runs: list[int]) -> None:
        """Copy back-to-back pages at ``src`` to the whole pages whose runs are ``runs``."""
        at = src
        for dst, size in zip(runs, itertools.cycle(self.sizes)):
            ctypes.memmove(dst, at, size)
            at += size

    def span(self, ptr: int, size: int) -> torch.Tensor:
        """The bytes ``[ptr, ptr + size)`` of the pool (the pointer-style calls), or
        PagesUnavailable when they are not inside one of its buffers."""
        if not isinstance(ptr, int) or not isinstance(size, int) or size <= 0:
            raise PagesUnavailable(f"target {ptr!r} of {size!r} bytes is not a pointer and size")
        if not any(s <= ptr and ptr + size <= e for s, e in self.buffers):
            raise PagesUnavailable(f"{size} bytes at {ptr:#x} lie outside the host pool's buffers")
        return self.flat[ptr - self.base : ptr - self.base + size]


def host_pages(pool: Any, is_mla: bool) -> HostPages:
    """The pool as ``HostPages``, or LayoutRefused naming why not (one line)."""
    kind = "MLA" if is_mla else "MHA"
    layout = getattr(pool, "layout", "?")
    if not callable(getattr(pool, "get_page_buffer_meta", None)):
        raise LayoutRefused(
            f"kvsvc: the {kind} host pool has no get_page_buffer_meta (SGLang's zero-copy "
            "description of its pages)"
        )
    page_size = int(getattr(pool, "page_size", 0) or 0)
    if page_size <= 0:
        raise LayoutRefused(f"kvsvc: the {kind} host pool has no page size")
    tensors = _buffers(pool, kind)
    buffers = tuple(sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors))
    base, end = buffers[0][0], max(e for _, e in buffers)
    probe = _probe_pages(pool, page_size)
    runs: list[list[tuple[int, int]]] = []
    for p in probe:
        idx = torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64)
        try:
            ptrs, sizes = pool.get_page_buffer_meta(idx)
        except Exception as exc:  # noqa: BLE001 - a pool SGLang itself cannot describe
            raise LayoutRefused(
                f"kvsvc: SGLang's get_page_buffer_meta refuses {kind} host layout {layout!r}"
                f" ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
        runs.append([(int(a), int(s)) for a, s in zip(ptrs, sizes, strict=True)])
    sizes0 = tuple(s for _, s in runs[0])
    if (
        not sizes0
        or any(s <= 0 for s in sizes0)
        or any(tuple(s for _, s in r) != sizes0 for r in runs)
    ):
        raise LayoutRefused(
            f"kvsvc: the {kind} host pool's pages (layout {layout!r}) are not the same runs "
            "page to page (get_page_buffer_meta)"
        )
    pages = HostPages(
        pool=pool,
        page_size=page_size,
        sizes=sizes0,
        dtype=_dtype(pool, tensors),
        base=base,
        flat=_bytes_at(base, end - base),
        buffers=buffers,
    )
    for p in probe:
        try:
            addrs = pages.runs(torch.arange(p * page_size, (p + 1) * page_size))
        except PagesUnavailable as exc:
            raise LayoutRefused(f"kvsvc: {kind} host layout {layout!r}: {exc}") from None
        if _overlap(addrs, sizes0):
            raise LayoutRefused(
                f"kvsvc: the runs of a {kind} page (layout {layout!r}) overlap: "
                "refused rather than copy wrong bytes"
            )
    return pages


def _overlap(addrs: list[int], sizes: tuple[int, ...]) -> bool:
    spans = sorted(zip(addrs, sizes, strict=True))
    return any(a + s > b for (a, s), (b, _) in itertools.pairwise(spans))


def _buffers(pool: Any, kind: str) -> list[torch.Tensor]:
    buf = getattr(pool, "kv_buffer", None)
    found = list(buf) if isinstance(buf, (list, tuple)) else [buf]
    tensors = [t for t in found if isinstance(t, torch.Tensor)]
    if not tensors or len(tensors) != len(found):
        raise LayoutRefused(f"kvsvc: the {kind} host pool has no kv_buffer tensor")
    if any(t.device.type != "cpu" for t in tensors):
        raise LayoutRefused(f"kvsvc: the {kind} host pool's kv_buffer is not in host memory")
    return [t for t in tensors if t.nbytes]


def _probe_pages(pool: Any, page_size: int) -> list[int]:
    """Pages checked at registration: the first two and, when SGLang says how many
    tokens the pool holds, the middle and the last."""
    tokens = getattr(pool, "size", None)
    pages = int(tokens) // page_size if isinstance(tokens, int) and tokens > 0 else 2
    return sorted({0, 1, pages // 2, pages - 1} & set(range(max(pages, 1))))


def _dtype(pool: Any, tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = getattr(pool, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else tensors[0].dtype


def _bytes_at(address: int, size: int) -> torch.Tensor:
    """``size`` bytes at ``address`` as a uint8 tensor (the pool keeps them alive)."""
    raw = (ctypes.c_uint8 * size).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8)


@dataclass
class Staging:
    """A sealed memfd of ``capacity`` pages of ``page_bytes``: what kvsvc maps (once
    per server start) and copies blocks to and from."""

    tensor: torch.Tensor  # (capacity, page_bytes) uint8, block dim 0
    fd: int
    mm: mmap.mmap
    region: pb.RankRegion

    @property
    def capacity(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def page_bytes(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):  # a view still held keeps the mapping
            self.mm.close()
        os.close(self.fd)


def make_staging(name: str, page_bytes: int, capacity: int, rank: int, tp: int) -> Staging:
    nbytes = capacity * page_bytes
    fd = make_sealed_memfd(name, nbytes)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | populate)
    tensor = torch.frombuffer(mm, dtype=torch.uint8).view(capacity, page_bytes)
    region = pb.RankRegion(
        context=rank_context(rank, tp),
        tensors=[
            pb.KVTensor(
                name="host_pages",
                handle=pb.MemoryHandle(
                    sealed_memfd=pb.SealedMemfdHandle(token="", size_bytes=nbytes)
                ),
                offset_bytes=0,
                shape=[capacity, page_bytes],
                strides=[page_bytes, 1],
                dtype=pb.DTYPE_UINT8,
                block_dim=0,
            )
        ],
    )
    return Staging(tensor, fd, mm, region)
