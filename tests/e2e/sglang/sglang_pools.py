"""SGLang's real host pools on CPU, built as SGLang's pool assembler builds them
(an ``MHABufferInfo``/``MLABufferInfo`` over device-side K/V tensors, here CPU
tensors), and the one import stand-in these tests need.

The stand-in: ``import sglang.srt.mem_cache.pool_host`` reaches
``sglang.srt.configs``, whose multimodal configs import torchvision at module
level. PyPI's torchvision wheels are CUDA builds that fail to load against the
CPU torch (``operator torchvision::nms does not exist``), and torchvision plays
no part in host pools or storage. So, only when torchvision is absent, an empty
``torchvision`` package is registered whose every name raises when used; no
SGLang code is replaced."""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import torch


class _Absent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is not installed in the SGLang test venv")


def _absent_torchvision() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    names = (
        "torchvision",
        "torchvision.io",
        "torchvision.ops",
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    )
    mods: dict[str, types.ModuleType] = {}
    for name in names:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        m.__path__ = []

        def attr(a: str) -> Any:
            if a.startswith("__"):
                raise AttributeError(a)
            return _Absent

        m.__getattr__ = attr  # type: ignore[method-assign]
        mods[name] = m

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    for name in ("torchvision.transforms", "torchvision.transforms.functional"):
        mods[name].InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    mods["torchvision"].__version__ = "0.0"  # type: ignore[attr-defined]
    for name, m in mods.items():
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(mods[parent], child, m)
    sys.modules.update(mods)


_absent_torchvision()

from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
REFUSED_LAYOUTS = ("page_unified",)  # SGLang's own get_page_buffer_meta refuses it


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
