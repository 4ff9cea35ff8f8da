"""vLLM's KV cache as a kvsvc region (worker side). On CPU, vLLM's cache is one
allocation viewed per layer; at ``register_kv_caches`` its memory is moved into a
sealed memfd (no copy: the cache is still zero) that the server maps once. On CUDA
the tensors are described by their IPC handles. Either way Retrieve and Store then
copy straight between vLLM's blocks and the store."""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass

import torch

from kvsvc.client.fdpass import make_sealed_memfd
from kvsvc.client.kvcache import rank_context
from kvsvc.integrations.vllm.common import log
from kvsvc.layout import dtype_code
from kvsvc.v1 import kv_cache_service_pb2 as pb


@dataclass
class KvRegion:
    """What Map needs from this worker, and what must outlive vLLM's tensors."""

    region: pb.RankRegion
    fd: int = -1  # the memfd to pass to the server (CPU); -1: none (CUDA IPC)
    mm: mmap.mmap | None = None  # vLLM's KV cache now: never closed while it runs


def describe_kv_caches(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, rank: int, tp: int
) -> KvRegion:
    """The region of vLLM's KV tensors (moved into a memfd first on CPU)."""
    tensors = list(kv_caches.values())
    dim = block_dim(tensors[0], num_blocks)
    if tensors[0].is_cuda:
        from kvsvc.client.kvcache import describe_cuda_tensors

        return KvRegion(
            describe_cuda_tensors(tensors, block_dim=dim, context=rank_context(rank, tp))
        )
    return memfd_region(tensors, dim, rank, tp)


def memfd_region(tensors: list[torch.Tensor], block_dim: int, rank: int, tp: int) -> KvRegion:
    """Move the one storage all layers view into a sealed memfd, in place:
    every view, whoever holds it, then points into memory the server maps.
    The region is described first, so nothing can fail once vLLM's memory moved
    (a view's offset in its storage does not change with the move)."""
    storage = tensors[0].untyped_storage()
    base = storage.data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        raise RuntimeError("the KV tensors do not share one storage (a newer vLLM?)")
    nbytes = storage.nbytes()
    region = pb.RankRegion(
        context=rank_context(rank, tp),
        tensors=[
            pb.KVTensor(
                name=f"layer.{i}",
                handle=pb.MemoryHandle(
                    sealed_memfd=pb.SealedMemfdHandle(token="", size_bytes=nbytes)
                ),
                offset_bytes=t.data_ptr() - base,
                shape=list(t.shape),
                strides=list(t.stride()),
                dtype=dtype_code(str(t.dtype)),  # type: ignore[arg-type]
                block_dim=block_dim,
            )
            for i, t in enumerate(tensors)
        ],
    )
    t0 = time.perf_counter()
    fd = make_sealed_memfd(f"kvsvc-vllm-tp{rank}", nbytes)
    # Populated now, as vLLM's torch.zeros touched its allocation: otherwise each
    # first write to a block faults its pages in on the request path.
    populate = getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | populate)
    fresh = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()
    # No copy: vLLM 0.32 registers its cache before anything writes it (zeros).
    storage._swap_data_ptr_(fresh)  # type: ignore[attr-defined]
    del fresh  # holds vLLM's original allocation, freed now
    log.info(
        "kvsvc: vLLM's KV cache (%d layers, %.1f MiB) moved into a sealed memfd in %.1f ms",
        len(tensors),
        nbytes / (1 << 20),
        (time.perf_counter() - t0) * 1000,
    )
    return KvRegion(region, fd, mm)


def block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension that indexes blocks: of size ``num_blocks`` and, if several
    are, the outermost of them (largest stride: a block is a contiguous run in
    every layout vLLM uses). vLLM's layouts differ by version and backend; none
    is hard-coded."""
    dims = [i for i, s in enumerate(t.shape) if s == num_blocks]
    if not dims:
        raise RuntimeError(f"no dimension of KV shape {tuple(t.shape)} has {num_blocks} blocks")
    return max(dims, key=lambda i: t.stride(i))
