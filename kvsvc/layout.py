"""What an engine's KV tensors look like, as pure data: dtypes, strided tensor
layouts on a memory handle, the byte runs of a block selection, how a rank is
named in errors, and the layout fingerprint. No OS, torch or CUDA calls here,
so this is where a new engine layout is taught (and unit-tested) in isolation.

A chunk's bytes are, for each rank and each tensor in mapping order, the
contiguous bytes of ``tensor.index_select(block_dim, block_ids)``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass

from kvsvc.errors import CudaUnavailable, InvalidRequest
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: wire dtype -> (torch's name for it, bytes per element)
DTYPES: dict[int, tuple[str, int]] = {
    pb.DTYPE_FLOAT16: ("float16", 2),
    pb.DTYPE_BFLOAT16: ("bfloat16", 2),
    pb.DTYPE_FLOAT32: ("float32", 4),
    pb.DTYPE_UINT8: ("uint8", 1),
    pb.DTYPE_INT8: ("int8", 1),
    pb.DTYPE_FLOAT8_E4M3FN: ("float8_e4m3fn", 1),
    pb.DTYPE_FLOAT8_E5M2: ("float8_e5m2", 1),
}
MAX_DIMS = 8


def dtype_code(name: str) -> int:
    """The wire dtype of a torch dtype name ('bfloat16' or 'torch.bfloat16')."""
    name = name.removeprefix("torch.")
    for code, (known, _) in DTYPES.items():
        if known == name:
            return code
    raise ValueError(f"dtype {name} has no kvsvc wire dtype")


class HandleKind(enum.Enum):
    """The memory a handle names; regions open each kind their own way."""

    SHM = "shared_memory"
    MEMFD = "sealed_memfd"
    CUDA = "cuda_ipc"


@dataclass(frozen=True)
class HandleKey:
    """Identifies one piece of memory a rank's tensors live in."""

    kind: HandleKind
    ident: str  # shm file name, memfd token, or the CUDA allocation's identity


def handle_identity(h: pb.MemoryHandle) -> tuple[HandleKey, int]:
    """(key naming the memory, bytes its tensors may reach) of a set handle."""
    kind = HandleKind(h.WhichOneof("kind"))
    if kind is HandleKind.SHM:
        return HandleKey(kind, h.shared_memory.name), h.shared_memory.size_bytes
    if kind is HandleKind.MEMFD:
        return HandleKey(kind, h.sealed_memfd.token), h.sealed_memfd.size_bytes
    c = h.cuda_ipc
    ident = f"{c.device_uuid}:{c.ipc_handle.hex()}:{c.storage_offset_bytes}"
    return HandleKey(kind, ident), c.storage_size_bytes


@dataclass(frozen=True)
class TensorLayout:
    """One validated KV tensor: a strided view on a handle, blocks along ``block_dim``."""

    name: str
    handle_key: HandleKey
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: int  # wire dtype
    block_dim: int

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def elsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.shape) // self.shape[self.block_dim] * self.elsize

    @property
    def end_bytes(self) -> int:
        """One past the last byte the view can touch."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return self.offset + (last + 1) * self.elsize

    def signature(self) -> list[object]:
        block_shape = [n for i, n in enumerate(self.shape) if i != self.block_dim]
        return [f"torch.{self.dtype_name}", self.block_dim, block_shape]

    @functools.cached_property
    def _template(self) -> tuple[list[int], int, list[int], int, bool]:
        """The tensor's geometry for ``runs``, computed once: byte offsets of the dims
        before the block dim, the block stride, offsets of the dims between the
        block dim and the contiguous tail, the tail's length, and whether whole
        blocks are adjacent (then consecutive ids make one run)."""
        el = self.elsize
        ndim = len(self.shape)
        k, expected = ndim, 1
        for i in reversed(range(ndim)):
            if i == self.block_dim or self.strides[i] != expected:
                break
            expected *= self.shape[i]
            k = i
        run_len = math.prod(self.shape[k:]) * el

        def offsets(dims: range) -> list[int]:
            axes = [[j * self.strides[i] * el for j in range(self.shape[i])] for i in dims]
            return [sum(parts) for parts in itertools.product(*axes)]

        outers = [self.offset + o for o in offsets(range(self.block_dim))]
        inners = offsets(range(self.block_dim + 1, k))
        stride = self.strides[self.block_dim] * el
        return outers, stride, inners, run_len, inners == [0] and stride == run_len

    def runs(self, block_ids: list[int]) -> Iterator[tuple[int, int]]:
        """(byte offset in the handle, length) of each contiguous run, in chunk order."""
        outers, stride, inners, run_len, adjacent = self._template
        if adjacent:
            groups: list[list[int]] = []
            for b in block_ids:
                if groups and groups[-1][0] + groups[-1][1] == b:
                    groups[-1][1] += 1
                else:
                    groups.append([b, 1])
            for base in outers:
                for first, count in groups:
                    yield base + first * stride, count * run_len
            return
        for base in outers:
            for b in block_ids:
                at = base + b * stride
                for inner in inners:
                    yield at + inner, run_len


def rank_metadata(ctx: pb.RankContext, index: int) -> dict[str, object]:
    """The context every rank-level error carries (kvcached's lesson: name the rank)."""
    return {
        "rankIndex": index,
        "tpRank": ctx.tp_rank,
        "tpSize": ctx.tp_size,
        "ppRank": ctx.pp_rank,
        "ppSize": ctx.pp_size,
        "groupId": ctx.group_id,
    }


def rank_label(ctx: pb.RankContext, index: int) -> str:
    """How every message names a rank: by its ranks, with its place in the request
    second (an entry's position is not its tp_rank)."""
    return f"tp_rank={ctx.tp_rank} pp_rank={ctx.pp_rank} group_id={ctx.group_id!r} (ranks[{index}])"


def parse_tensor(
    t: pb.KVTensor, ctx: pb.RankContext, rank: int, *, cuda: bool = True
) -> TensorLayout:
    """Validate a tensor description; every fault is INVALID_ARGUMENT with the rank
    (tp/pp rank, group) and the layer named. ``cuda``: whether this host has CUDA."""
    label = t.name or "tensor"
    where = f"{rank_label(ctx, rank)} layer {label!r}"
    context = {**rank_metadata(ctx, rank), "layer": label}

    def bad(msg: str) -> InvalidRequest:
        return InvalidRequest(f"{where}: {msg}", metadata=context)

    if t.dtype not in DTYPES:
        raise bad(f"unsupported dtype {t.dtype}")
    ndim = len(t.shape)
    if not 1 <= ndim <= MAX_DIMS:
        raise bad(f"shape must have 1..{MAX_DIMS} dims, got {ndim}")
    if len(t.strides) != ndim:
        raise bad(f"strides has {len(t.strides)} entries for {ndim} dims")
    if any(n <= 0 for n in t.shape):
        raise bad(f"shape entries must be > 0, got {list(t.shape)}")
    if any(s < 0 for s in t.strides):
        raise bad(f"strides must be >= 0, got {list(t.strides)}")
    if t.strides[-1] != 1:
        raise bad("the innermost stride must be 1")
    if t.block_dim >= ndim:
        raise bad(f"block_dim {t.block_dim} out of range for {ndim} dims")
    if t.handle.WhichOneof("kind") is None:
        raise bad("memory handle is not set")
    if t.handle.WhichOneof("kind") == HandleKind.CUDA.value and not cuda:
        # Before the bounds check: its sizes mean nothing here, the device does.
        raise no_cuda({"layer": label})  # Map adds the rank context
    handle_key, handle_size = handle_identity(t.handle)
    layout = TensorLayout(
        label, handle_key, t.offset_bytes, tuple(t.shape), tuple(t.strides), t.dtype, t.block_dim
    )
    if layout.offset % layout.elsize:
        raise bad(f"offset {layout.offset} is not a multiple of the element size")
    if layout.end_bytes > handle_size:
        raise InvalidRequest(
            f"{where}: shape x strides x dtype reaches byte {layout.end_bytes}, "
            f"beyond the handle's {handle_size} bytes",
            reason="TENSOR_OUT_OF_BOUNDS",
            metadata={**context, "endBytes": layout.end_bytes, "handleBytes": handle_size},
        )
    return layout


def parse_rank(rank: pb.RankRegion, index: int, *, cuda: bool = True) -> list[TensorLayout]:
    """A rank's tensors, validated; they must agree on the number of blocks."""
    if not rank.tensors:
        raise InvalidRequest(
            f"{rank_label(rank.context, index)} has no tensors",
            metadata=rank_metadata(rank.context, index),
        )
    tensors = [parse_tensor(t, rank.context, index, cuda=cuda) for t in rank.tensors]
    blocks = {t.num_blocks for t in tensors}
    if len(blocks) != 1:
        raise InvalidRequest(
            f"{rank_label(rank.context, index)}: tensors disagree on the number of blocks "
            f"{sorted(blocks)}",
            metadata=rank_metadata(rank.context, index),
        )
    return tensors


def no_cuda(metadata: dict[str, object]) -> CudaUnavailable:
    return CudaUnavailable(
        "a CUDA IPC handle was sent to a server that has no CUDA device: map CPU memory "
        "(a sealed memfd or a shared-memory file) or use a server on a GPU host",
        metadata=metadata,
    )


def layout_fingerprint(ranks: list[tuple[pb.RankContext, list[TensorLayout]]]) -> str:
    """Chunks load only into the layout they were stored from: dtype, block shape, ranks."""
    sig = [
        [
            [ctx.tp_rank, ctx.tp_size, ctx.pp_rank, ctx.pp_size],
            [t.signature() for t in tensors],
        ]
        for ctx, tensors in ranks
    ]
    return hashlib.sha256(json.dumps(sig).encode()).hexdigest()[:16]
