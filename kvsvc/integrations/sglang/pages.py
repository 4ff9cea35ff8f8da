"""SGLang's host pool as pages kvsvc can copy. Data path: one staging region per
backend, a sealed memfd of ``STORAGE_BATCH_SIZE`` pages that kvsvc maps once.
A write gathers the batch's pages from the host pool into it (one copy, torch's
threads) and Stores them as blocks; a read Retrieves into it and scatters back.

Why not map the host pool itself: SGLang allocates it with its own allocator
(malloc, its unsealed ``shm`` memfd, CUDA-pinned memory) and keeps raw pointer
tables into it (``k_data_ptrs`` for its transfer kernels, ``cudaHostRegister``
ranges), so it cannot be moved into a sealed memfd after the fact, and the
server maps only sealed memory (a file its owner can shrink would SIGBUS it).

The page view is derived from the pool's tensor by layout and checked, page by
page, against the pointers SGLang itself reports (``get_page_buffer_meta``): a
layout whose pages are not exactly those bytes is refused at construction."""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvsvc.client.fdpass import make_sealed_memfd
from kvsvc.client.kvcache import rank_context
from kvsvc.layout import dtype_code
from kvsvc.v1 import kv_cache_service_pb2 as pb

# Layouts indexed by token (a page is ``page_size`` rows of the token dim) and the
# dim that indexes tokens or pages, per (MLA?, layout) (pool_host/mha.py, mla.py).
_TOKEN_LAYOUTS = frozenset({"layer_first", "page_first"})
_PAGE_DIM = {
    (False, "layer_first"): 2,  # (2, L, tokens, H, D)
    (False, "page_first"): 1,  # (2, tokens, L, H, D)
    (False, "page_first_direct"): 1,  # (2, pages, L, page, H, D)
    (False, "page_head"): 1,  # (2, pages, H, page, L, D)
    (False, "page_unified"): 0,  # (pages, groups, L, 2, page, heads, D)
    (True, "layer_first"): 1,  # (L, tokens, 1, D)
    (True, "page_first"): 0,  # (tokens, L, 1, D)
    (True, "page_first_direct"): 0,  # (pages, L, page, 1, D)
    (True, "page_unified"): 0,  # (pages, L, page, D)
}


class LayoutRefused(ValueError):
    """A host pool this backend cannot copy pages of; the message is one line."""


def page_view(pool: Any, is_mla: bool) -> tuple[torch.Tensor, int]:
    """The host pool's buffer as ``(outer..., pages, page_elements)`` and the page
    dim, or LayoutRefused naming why not."""
    layout = str(getattr(pool, "layout", "?"))
    dim = _PAGE_DIM.get((is_mla, layout))
    kind = "MLA" if is_mla else "MHA"
    if dim is None:
        raise LayoutRefused(
            f"kvsvc: {kind} host layout {layout!r} is not supported (supported: "
            f"{sorted(name for mla, name in _PAGE_DIM if mla == is_mla)})"
        )
    buf = getattr(pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
        raise LayoutRefused(f"kvsvc: the {kind} host pool has no CPU kv_buffer tensor")
    if not buf.is_contiguous():
        raise LayoutRefused(f"kvsvc: the {kind} host pool's kv_buffer is not contiguous")
    page = int(pool.page_size)
    rows = int(buf.shape[dim])
    if layout in _TOKEN_LAYOUTS:
        if rows % page:
            raise LayoutRefused(f"kvsvc: {rows} host tokens are not whole pages of {page}")
        pages = rows // page
    else:
        pages = rows
    return buf.view(*buf.shape[:dim], pages, -1), dim


def check_against_sglang(pool: Any, view: torch.Tensor, dim: int) -> None:
    """Each page's bytes as SGLang reports them (get_page_buffer_meta) are exactly
    the page's bytes in ``view``; else LayoutRefused."""
    pages = view.shape[dim]
    page = int(pool.page_size)
    probe = sorted({0, 1, pages // 2, pages - 1} & set(range(pages)))
    try:
        ptrs, sizes = pool.get_page_buffer_meta(
            torch.tensor([p * page + i for p in probe for i in range(page)], dtype=torch.int64)
        )
    except Exception as exc:  # noqa: BLE001 - a layout SGLang itself cannot describe
        raise LayoutRefused(
            f"kvsvc: get_page_buffer_meta fails on this host pool ({type(exc).__name__}: {exc})"
        ) from None
    per = len(ptrs) // len(probe)
    el = view.element_size()
    for j, p in enumerate(probe):
        runs = _runs(view.select(dim, p), el)
        mine = sorted(
            zip(ptrs[j * per : (j + 1) * per], sizes[j * per : (j + 1) * per], strict=True)
        )
        if _merge(mine) != runs:
            raise LayoutRefused(
                f"kvsvc: page {p} of host layout {pool.layout!r} is not the bytes SGLang "
                "reports for it (get_page_buffer_meta): refused rather than copy wrong bytes"
            )


def _runs(page: torch.Tensor, el: int) -> list[tuple[int, int]]:
    """The byte runs ``(address, size)`` of one page of the view (its last dim is
    contiguous; each index of the dims before it is one run)."""
    inner = page.shape[-1] * el
    outer = page.shape[:-1]
    strides = page.stride()[:-1]
    start = page.data_ptr()
    runs = [
        (start + sum(i * s for i, s in zip(index, strides, strict=True)) * el, inner)
        for index in itertools.product(*(range(n) for n in outer))
    ]
    return _merge(runs)


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for addr, size in sorted(runs):
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((addr, size))
    return out


@dataclass
class Staging:
    """A sealed memfd of ``capacity`` pages shaped like the pool's page view: what
    kvsvc maps (once per server start) and copies blocks to and from."""

    tensor: torch.Tensor  # (outer..., capacity, page_elements), block dim ``dim``
    dim: int
    fd: int
    mm: mmap.mmap
    region: pb.RankRegion

    @property
    def capacity(self) -> int:
        return int(self.tensor.shape[self.dim])

    @property
    def page_bytes(self) -> int:
        return math.prod(self.tensor.shape) // self.capacity * self.tensor.element_size()

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):  # a view still held keeps the mapping
            self.mm.close()
        os.close(self.fd)


def make_staging(view: torch.Tensor, dim: int, capacity: int, rank: int, tp: int) -> Staging:
    shape = (*view.shape[:dim], capacity, view.shape[dim + 1])
    nbytes = math.prod(shape) * view.element_size()
    fd = make_sealed_memfd(f"kvsvc-sglang-tp{rank}", nbytes)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | populate)
    tensor = torch.frombuffer(mm, dtype=view.dtype).view(shape)
    region = pb.RankRegion(
        context=rank_context(rank, tp),
        tensors=[
            pb.KVTensor(
                name="host_pages",
                handle=pb.MemoryHandle(
                    sealed_memfd=pb.SealedMemfdHandle(token="", size_bytes=nbytes)
                ),
                offset_bytes=0,
                shape=list(shape),
                strides=list(tensor.stride()),
                dtype=dtype_code(str(view.dtype)),  # type: ignore[arg-type]
                block_dim=dim,
            )
        ],
    )
    return Staging(tensor, dim, fd, mm, region)
