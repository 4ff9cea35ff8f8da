"""Helpers that make a KV region an engine can map, so a newcomer needs no
knowledge of memory handles: a CPU KV cache in a shared-memory file (vLLM's
per-layer layout), and descriptions of existing torch CUDA tensors."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Sequence

import torch

from kvsvc.client.fdpass import make_sealed_memfd
from kvsvc.layout import dtype_code
from kvsvc.v1 import kv_cache_service_pb2 as pb


def rank_context(
    tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, group_id: str = ""
) -> pb.RankContext:
    return pb.RankContext(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, group_id=group_id
    )


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return dtype_code(str(dtype))
    except ValueError:
        raise ValueError(f"dtype {dtype} is not supported by kvsvc") from None


class SharedKVCache:
    """A CPU KV cache in one shared-memory region: ``num_layers`` tensors of
    ``[2, num_blocks, block_size, kv_heads, head_dim]`` (vLLM's layout), or any
    per-layer ``layer_shape`` with blocks along ``block_dim``.

    By default the region is a file under ``shm_dir`` (tmpfs), which any client can
    name. With ``memfd=True`` it is a sealed memfd, which the server copies several
    times faster; pass it once per server start and name the token::

        cache = SharedKVCache("engine0", num_layers=32, num_blocks=4096, memfd=True)
        token = client.register_memfd(cache.fd)
        mapping = client.map("ns", [cache.rank_region(token=token)])
    """

    def __init__(
        self,
        name: str,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int = 16,
        kv_heads: int = 8,
        head_dim: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        layer_shape: Sequence[int] | None = None,
        block_dim: int = 1,
        shm_dir: str = "/dev/shm",
        memfd: bool = False,
    ) -> None:
        self.name = name
        self.path = "" if memfd else os.path.join(shm_dir, name)
        self.dtype = dtype
        self.block_dim = block_dim
        self.shape = tuple(layer_shape or (2, num_blocks, block_size, kv_heads, head_dim))
        self.num_blocks = self.shape[block_dim]
        el = torch.empty((), dtype=dtype).element_size()
        self.layer_bytes = math.prod(self.shape) * el
        self.size = size = num_layers * self.layer_bytes
        self.fd = -1
        self._mmap: mmap.mmap | None = None
        if memfd:
            self.fd = make_sealed_memfd(name, size)
            self._mmap = mmap.mmap(self.fd, size)
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            self.buffer = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
        self.layers = [
            self.buffer[i * self.layer_bytes : (i + 1) * self.layer_bytes]
            .view(dtype)
            .view(self.shape)
            for i in range(num_layers)
        ]

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        return self.layers[layer].select(self.block_dim, block_id)

    def rank_region(
        self, context: pb.RankContext | None = None, *, token: str = ""
    ) -> pb.RankRegion:
        """The Map description of this cache; a memfd cache needs the ``token`` that
        ``register_memfd`` returned for its fd."""
        strides = list(self.layers[0].stride())
        if self.fd >= 0:
            if not token:
                raise ValueError("a memfd cache is mapped by token: pass register_memfd(fd)")
            handle = pb.MemoryHandle(
                sealed_memfd=pb.SealedMemfdHandle(token=token, size_bytes=self.size)
            )
        else:
            handle = pb.MemoryHandle(
                shared_memory=pb.SharedMemoryHandle(name=self.name, size_bytes=self.size)
            )
        return pb.RankRegion(
            context=context or rank_context(),
            tensors=[
                pb.KVTensor(
                    name=f"layer.{i}",
                    handle=handle,
                    offset_bytes=i * self.layer_bytes,
                    shape=list(self.shape),
                    strides=strides,
                    dtype=_dtype_code(self.dtype),  # type: ignore[arg-type]
                    block_dim=self.block_dim,
                )
                for i in range(len(self.layers))
            ],
        )

    def close(self, unlink: bool = True) -> None:
        self.layers.clear()
        del self.buffer
        if self.fd >= 0:
            assert self._mmap is not None
            # Views the caller still holds keep the mapping; it goes with them.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            os.close(self.fd)
            self.fd = -1
        elif unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __enter__(self) -> SharedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def describe_cuda_tensors(
    tensors: Sequence[torch.Tensor], *, block_dim: int, context: pb.RankContext | None = None
) -> pb.RankRegion:
    """Describe CUDA KV tensors for Map through torch's CUDA IPC, with the device
    UUID so that differing CUDA_VISIBLE_DEVICES on both sides are safe."""
    out = []
    for i, t in enumerate(tensors):
        if not t.is_cuda:
            raise ValueError(f"tensor {i} is on {t.device}, not CUDA")
        storage = t.untyped_storage()
        (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = (
            storage._share_cuda_()
        )
        uuid = str(torch.cuda.get_device_properties(t.device).uuid)
        out.append(
            pb.KVTensor(
                name=f"layer.{i}",
                handle=pb.MemoryHandle(
                    cuda_ipc=pb.CudaIpcHandle(
                        device_uuid=uuid,
                        ipc_handle=handle,
                        storage_size_bytes=size,
                        storage_offset_bytes=offset,
                        ref_counter_handle=rc_handle,
                        ref_counter_offset=rc_offset,
                        event_handle=ev_handle or b"",
                        event_sync_required=ev_sync,
                    )
                ),
                offset_bytes=int(t.storage_offset()) * t.element_size(),
                shape=list(t.shape),
                strides=list(t.stride()),
                dtype=_dtype_code(t.dtype),  # type: ignore[arg-type]
                block_dim=block_dim,
            )
        )
    return pb.RankRegion(context=context or rank_context(), tensors=out)
