"""The byte work of SGLang's calls without interface_v1 (``get``, ``batch_get``,
``set``, ``batch_set``): pages carried inline over gRPC, named either by tensors
or (as SGLang's other backends also take them) by host pointers into the host
pool. A page stored by another geometry is a miss, never a wrong-sized copy; what
cannot be read as pages is PagesUnavailable (the backend makes every failure a
miss)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvsvc.integrations.sglang.pages import HostPages, PagesUnavailable


def is_pointer(location: Any) -> bool:
    return isinstance(location, int) and not isinstance(location, bool)


def sizes(sizes: Any, n: int) -> list[int]:
    """SGLang passes one size per target, or one for all of them."""
    if isinstance(sizes, int):
        return [sizes] * n
    if sizes is None or len(sizes) != n:
        raise PagesUnavailable(f"{n} target pointers but sizes {sizes!r}")
    return [int(s) for s in sizes]


def spans(pages: HostPages, ptrs: Sequence[Any], target_sizes: Any, n: int) -> list[torch.Tensor]:
    """The host pool's bytes at each of the ``n`` keys' pointers (PagesUnavailable
    outside the pool)."""
    return [pages.span(p, s) for p, s in zip(ptrs, sizes(target_sizes, n), strict=True)]


def into_tensors(
    blobs: list[bytes], n: int, dtype: torch.dtype, targets: Any | None
) -> list[torch.Tensor | None]:
    """``n`` pages as tensors of ``dtype`` (copied into ``targets`` when given),
    None from the first page missing or of another size on."""
    out: list[torch.Tensor | None] = [None] * n
    for i, blob in enumerate(blobs):
        t = torch.frombuffer(bytearray(blob), dtype=dtype)
        dst = targets[i] if targets is not None else None
        if dst is not None:
            if dst.numel() != t.numel():
                break  # another page geometry: a miss, never a wrong-sized copy
            dst.view(-1).copy_(t)
            t = dst
        out[i] = t
    return out


def into_spans(blobs: list[bytes], spans: list[torch.Tensor]) -> int:
    """Copy each page into its span of the host pool: how many leading ones were."""
    done = 0
    for blob, span in zip(blobs, spans, strict=False):
        if len(blob) != span.numel():
            break  # stored by another geometry: a miss, never a wrong-sized copy
        span.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        done += 1
    return done


def page_bytes(
    pages: HostPages, n: int, values: Any | None, target_locations: Any | None, target_sizes: Any
) -> list[bytes]:
    """The bytes of ``n`` pages to store, from ``values`` (tensors) or from host
    pointers."""
    if values is not None:
        return [tensor_bytes(v) for v in values]
    if target_locations is not None:
        return [span.numpy().tobytes() for span in spans(pages, target_locations, target_sizes, n)]
    raise PagesUnavailable("batch_set got neither values nor target locations")


def tensor_bytes(value: Any) -> bytes:
    if not isinstance(value, torch.Tensor):
        raise PagesUnavailable(f"a value of type {type(value).__name__}, not a tensor")
    return bytes(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
