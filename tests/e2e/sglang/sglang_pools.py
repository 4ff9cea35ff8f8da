"""SGLang's real host pools on CPU, built as SGLang's pool assembler builds them
(an ``MHABufferInfo``/``MLABufferInfo`` over device-side K/V tensors, here CPU
tensors; conftest.py registers the torchvision stand-in these imports need)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
REFUSED_LAYOUTS = ("page_unified",)  # SGLang's own get_page_buffer_meta refuses it

# SGLang refuses a host pool unless the machine's free memory, less a reserve of
# several GB, covers it; a busy 2-core CI machine often has less. The pools here are
# small, so they are booked against a budget of their own (SGLang's own scope for
# booking pools against one snapshot) instead of against what other jobs left free.
BUDGET_BYTES = 8 << 30


def mha_pool(
    layout: str,
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    page: int = 4,
    device_tokens: int = 64,
    ratio: float = 2.0,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD
        ),
        page_size=page,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    with host_memory_budget_scope(BUDGET_BYTES):
        pool = MHATokenToKVPoolHost(
            info,
            ratio,
            0,
            page,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_tokens,
            start_layer=0,
            end_layer=layers,
        )
    pool._device_tensors = (k, v)  # SGLang's pool keeps pointers into them
    return pool


def mla_pool(
    layout: str,
    *,
    layers: int = 2,
    dim: int = 48,
    page: int = 4,
    device_tokens: int = 64,
    ratio: float = 2.0,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    bufs = tuple(torch.zeros(device_tokens, 1, dim, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=None,
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page,
        kv_lora_rank=dim - 16,
        qk_rope_head_dim=16,
        kv_cache_dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    with host_memory_budget_scope(BUDGET_BYTES):
        pool = MLATokenToKVPoolHost(
            info,
            ratio,
            0,
            page,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_tokens,
            start_layer=0,
            end_layer=layers,
            target_layer_num=layers,
        )
    pool._device_tensors = bufs
    return pool


def fill_pages(pool: Any, pages: list[int], seed: int) -> None:
    """Random bytes in the given pages (through SGLang's own page setter)."""
    g = torch.Generator().manual_seed(seed)
    flat = pool.get_dummy_flat_data_page()
    for p in pages:
        data = torch.randint(-128, 127, (flat.numel() * flat.element_size(),), generator=g)
        page_data = data.to(torch.int8).view(flat.dtype)
        pool.set_from_flat_data_page(p * pool.page_size, page_data)


def page_bytes(pool: Any, page: int) -> bytes:
    """A page's bytes as SGLang reads them (its own get_data_page)."""
    t = pool.get_data_page(page * pool.page_size, flat=True)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def indices(pool: Any, pages: list[int]) -> torch.Tensor:
    """The host token indices of whole pages, as SGLang's controller passes them."""
    ps = pool.page_size
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)
