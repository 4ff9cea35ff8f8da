"""Mapped KV regions: validating an engine's tensor descriptions, opening its
memory (shared-memory files or CUDA IPC), and the copies between its blocks
and a chunk's bytes in the store.

A chunk's bytes are, for each rank and each tensor in mapping order, the
contiguous bytes of ``tensor.index_select(block_dim, block_ids)``; CPU and CUDA
regions produce the same bytes for the same layout.

Shared-memory files are copied with ``preadv``/``pwritev`` on the file, not
through ``mmap``: a client that truncates its file then causes a short read
(a typed error), never a SIGBUS that would kill the server. Sealed memfds
(kvsvc.fdpass) cannot shrink, so they are mapped and copied with memcpy
(``ctypes.memmove``, which releases the GIL and costs ~1 µs a call where a
torch slice copy costs several: runs are as small as one block of one layer).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import functools
import hashlib
import itertools
import json
import math
import mmap
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash

from kvsvc.errors import CudaUnavailable, InvalidRequest, RegionUnavailable
from kvsvc.fdbroker import FdBroker, exited
from kvsvc.v1 import kv_cache_service_pb2 as pb

DTYPES: dict[int, torch.dtype] = {
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_UINT8: torch.uint8,
    pb.DTYPE_INT8: torch.int8,
    pb.DTYPE_FLOAT8_E4M3FN: torch.float8_e4m3fn,
    pb.DTYPE_FLOAT8_E5M2: torch.float8_e5m2,
}
DTYPE_CODES: dict[torch.dtype, int] = {v: k for k, v in DTYPES.items()}
MAX_DIMS = 8


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


@dataclass(frozen=True)
class TensorLayout:
    """One validated KV tensor: a strided view on a handle, blocks along ``block_dim``."""

    name: str
    handle_key: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    block_dim: int
    elsize: int = 0

    def __post_init__(self) -> None:
        if not self.elsize:
            object.__setattr__(self, "elsize", self.dtype.itemsize)

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
        return [str(self.dtype), self.block_dim, block_shape]

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


def handle_identity(h: pb.MemoryHandle) -> tuple[str, int]:
    """(key naming the memory, bytes its tensors may reach) of a set handle."""
    kind = h.WhichOneof("kind")
    if kind == "shared_memory":
        return "shm:" + h.shared_memory.name, h.shared_memory.size_bytes
    if kind == "sealed_memfd":
        return "memfd:" + h.sealed_memfd.token, h.sealed_memfd.size_bytes
    c = h.cuda_ipc
    return f"cuda:{c.device_uuid}:{c.ipc_handle.hex()}:{c.storage_offset_bytes}", (
        c.storage_size_bytes
    )


def parse_tensor(t: pb.KVTensor, ctx: pb.RankContext, rank: int) -> TensorLayout:
    """Validate a tensor description; every fault is INVALID_ARGUMENT with the rank
    (tp/pp rank, group) and the layer named."""
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
    if t.handle.WhichOneof("kind") == "cuda_ipc" and not torch.cuda.is_available():
        # Before the bounds check: its sizes mean nothing here, the device does.
        raise no_cuda({"layer": label})  # Map adds the rank context
    handle_key, handle_size = handle_identity(t.handle)
    layout = TensorLayout(
        label,
        handle_key,
        t.offset_bytes,
        tuple(t.shape),
        tuple(t.strides),
        DTYPES[t.dtype],
        t.block_dim,
    )
    if layout.offset % layout.elsize:
        raise bad(f"offset {layout.offset} is not a multiple of the element size")
    if layout.end_bytes > handle_size:
        raise InvalidRequest(
            f"{where}: shape x strides x dtype reaches byte {layout.end_bytes}, "
            f"beyond the handle's {handle_size} bytes",
            reason="TENSOR_OUT_OF_BOUNDS",
            metadata={
                **context,
                "endBytes": layout.end_bytes,
                "handleBytes": handle_size,
            },
        )
    return layout


def no_cuda(metadata: dict[str, object]) -> CudaUnavailable:
    return CudaUnavailable(
        "a CUDA IPC handle was sent to a server that has no CUDA device: map CPU memory "
        "(a sealed memfd or a shared-memory file) or use a server on a GPU host",
        metadata=metadata,
    )


def safe_shm_path(shm_dir: str, name: str) -> str:
    """A plain file name inside ``shm_dir``; anything that could escape it is refused."""
    if (
        not name
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name in (".", "..")
        or len(name) > 255
    ):
        raise InvalidRequest(
            f"shared-memory name {name!r} must be a plain file name inside the shm dir",
            reason="INVALID_REGION_NAME",
            metadata={"name": name[:255]},
        )
    return os.path.join(shm_dir, name)


class ShmRegion:
    """A client's file under --shm-dir, accessed only by positional read/write."""

    device = torch.device("cpu")

    def __init__(self, shm_dir: str, name: str, need_bytes: int) -> None:
        path = safe_shm_path(shm_dir, name)
        # O_NOFOLLOW: a symlink planted under the name cannot redirect us.
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise InvalidRequest(
                f"shared-memory region {name!r} is a symbolic link; it is refused",
                reason="INVALID_REGION_NAME",
                metadata={"name": name},
            ) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(
                    f"shared-memory region {name!r} is not a regular file",
                    reason="INVALID_REGION_NAME",
                    metadata={"name": name},
                )
            if st.st_size < need_bytes:
                raise RegionUnavailable(
                    f"shared-memory region {name!r} has {st.st_size} bytes, "
                    f"its tensors need {need_bytes}",
                    reason="REGION_TOO_SMALL",
                    metadata={"name": name, "sizeBytes": st.st_size, "needBytes": need_bytes},
                )
        except BaseException:
            os.close(fd)
            raise
        self.name = name
        self.path = path
        self.fd = fd
        self.size = need_bytes
        self.inode = (st.st_dev, st.st_ino)

    def is_current(self) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    def read(self, offset: int, buf: memoryview, addr: int, a: int, b: int) -> None:
        """Region bytes from ``offset`` into ``buf[a:b]``."""
        dst = buf[a:b]
        done = 0
        while done < len(dst):
            n = os.preadv(self.fd, [dst[done:]], offset + done)
            if n <= 0:
                raise self._truncated(offset + done)
            done += n

    def write(self, offset: int, buf: memoryview, addr: int, a: int, b: int) -> None:
        """``buf[a:b]`` into the region at ``offset``; the caller brackets its writes
        with :meth:`check_size` (``pwritev`` past the end would extend the file)."""
        src = buf[a:b]
        done = 0
        while done < len(src):
            n = os.pwritev(self.fd, [src[done:]], offset + done)
            if n <= 0:
                raise self._truncated(offset + done)
            done += n

    def check_size(self) -> None:
        """REGION_TRUNCATED if the file is now shorter than the mapping needs.

        Writing never re-grows a file its owner truncated: writes are checked
        before (so none lands past the end) and after (see below). Plain files
        cannot be sealed against shrinking, so a truncate can still land between
        the first check and a ``pwritev``, which then extends the file to the end
        of that write; the check after the writes sees the file shorter than the
        mapping needs and fails the call. What stays open: when the last write of
        that span ends at the mapping's last byte, the file is re-grown unseen,
        to exactly its mapped size (holes read as zeros). Sealed memfd regions
        have no such window. One fstat per checksum segment, not per run: it
        costs about as much as a small run's copy."""
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise self._truncated(size)

    def _truncated(self, at: int) -> RegionUnavailable:
        return RegionUnavailable(
            f"shared-memory region {self.name!r} ends before byte {at}: "
            "its owner truncated it after Map",
            reason="REGION_TRUNCATED",
            metadata={"name": self.name, "offset": at},
        )

    def synchronize(self) -> None:
        """File copies are synchronous; nothing is left in flight."""

    def close(self) -> None:
        os.close(self.fd)


class MemfdRegion:
    """A client's sealed memfd, mapped: it cannot shrink, so memcpy is safe. Copies
    stay inside the mapping because every tensor was checked to end within
    ``need_bytes``, and the mapping is released only after its copies are fenced."""

    device = torch.device("cpu")

    def __init__(self, fds: FdBroker | None, token: str, need_bytes: int) -> None:
        if fds is None:
            raise InvalidRequest(
                "this server runs with --fd-socket off: sealed memfd handles are refused",
                reason="FD_PASSING_DISABLED",
            )
        fd, size, self.owner = fds.open(token)
        try:
            if size < need_bytes:
                raise InvalidRequest(
                    f"memfd {token[:12]!r} has {size} bytes, its tensors declare {need_bytes}",
                    reason="REGION_TOO_SMALL",
                    metadata={"token": token[:12], "sizeBytes": size, "needBytes": need_bytes},
                )
            self.mm = mmap.mmap(fd, need_bytes)
        except BaseException:
            if self.owner >= 0:
                os.close(self.owner)
            raise
        finally:
            os.close(fd)  # the mapping keeps the memfd alive
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self.size = need_bytes

    def read(self, offset: int, buf: memoryview, addr: int, a: int, b: int) -> None:
        """Region bytes from ``offset`` into ``buf[a:b]`` (``buf`` is at ``addr``)."""
        ctypes.memmove(addr + a, self.base + offset, b - a)

    def write(self, offset: int, buf: memoryview, addr: int, a: int, b: int) -> None:
        """``buf[a:b]`` into the region at ``offset``."""
        ctypes.memmove(self.base + offset, addr + a, b - a)

    def is_current(self) -> bool:
        """False once the process that passed the memfd has exited."""
        return not exited(self.owner)

    def synchronize(self) -> None:
        """memcpy is synchronous; nothing is left in flight."""

    def close(self) -> None:
        self._anchor = None
        self.mm.close()
        if self.owner >= 0:
            os.close(self.owner)
            self.owner = -1


def cuda_device_for_uuid(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RegionUnavailable(
        f"no visible CUDA device has uuid {uuid}",
        reason="DEVICE_NOT_FOUND",
        metadata={"deviceUuid": uuid},
    )


class CudaRegion:
    """A CUDA allocation opened from torch's IPC handle on the matching device."""

    def __init__(self, h: pb.CudaIpcHandle, need_bytes: int) -> None:
        if not torch.cuda.is_available():
            raise no_cuda({})
        index = cuda_device_for_uuid(h.device_uuid)
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(self.device)
        self.storage = torch.UntypedStorage._new_shared_cuda(
            index,
            h.ipc_handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle or None,
            h.event_sync_required,
        )
        if self.storage.nbytes() < need_bytes:
            raise RegionUnavailable(
                f"CUDA region has {self.storage.nbytes()} bytes, its tensors need {need_bytes}",
                reason="REGION_TOO_SMALL",
                metadata={"sizeBytes": self.storage.nbytes(), "needBytes": need_bytes},
            )
        self.stream = torch.cuda.Stream(device=self.device)
        self.size = need_bytes
        torch.cuda.synchronize(self.device)

    def view(self, t: TensorLayout) -> torch.Tensor:
        base = torch.empty(0, dtype=t.dtype, device=self.device)
        return base.set_(self.storage, t.offset // t.elsize, t.shape, t.strides)

    def synchronize(self) -> None:
        torch.cuda.set_device(self.device)
        self.stream.synchronize()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.synchronize()
        del self.storage


Region = ShmRegion | MemfdRegion | CudaRegion
HostRegion = ShmRegion | MemfdRegion


@dataclass
class RankMapping:
    context: pb.RankContext
    tensors: list[TensorLayout]
    regions: dict[str, Region]

    def close(self) -> None:
        for region in self.regions.values():
            region.close()


def open_rank(
    rank: pb.RankRegion,
    index: int,
    shm_dir: str,
    cuda_handles: dict[str, pb.CudaIpcHandle],
    fds: FdBroker | None = None,
) -> RankMapping:
    """Validate and open one rank's regions; raises with the rank named."""
    if not rank.tensors:
        raise InvalidRequest(
            f"{rank_label(rank.context, index)} has no tensors",
            metadata=rank_metadata(rank.context, index),
        )
    tensors = [parse_tensor(t, rank.context, index) for t in rank.tensors]
    blocks = {t.num_blocks for t in tensors}
    if len(blocks) != 1:
        raise InvalidRequest(
            f"{rank_label(rank.context, index)}: tensors disagree on the number of blocks "
            f"{sorted(blocks)}",
            metadata=rank_metadata(rank.context, index),
        )
    need: dict[str, int] = {}
    for t in rank.tensors:
        key, declared = handle_identity(t.handle)
        need[key] = max(need.get(key, 0), declared)
    regions: dict[str, Region] = {}
    try:
        for key, nbytes in need.items():
            if key.startswith("shm:"):
                regions[key] = ShmRegion(shm_dir, key[4:], nbytes)
            elif key.startswith("memfd:"):
                regions[key] = MemfdRegion(fds, key[6:], nbytes)
            else:
                regions[key] = CudaRegion(cuda_handles[key], nbytes)
    except BaseException:
        for region in regions.values():
            region.close()
        raise
    return RankMapping(rank.context, tensors, regions)


def cuda_handles_of(rank: pb.RankRegion) -> dict[str, pb.CudaIpcHandle]:
    return {
        handle_identity(t.handle)[0]: t.handle.cuda_ipc
        for t in rank.tensors
        if t.handle.WhichOneof("kind") == "cuda_ipc"
    }


def layout_fingerprint(ranks: list[RankMapping]) -> str:
    sig = [
        [
            [r.context.tp_rank, r.context.tp_size, r.context.pp_rank, r.context.pp_size],
            [t.signature() for t in r.tensors],
        ]
        for r in ranks
    ]
    return hashlib.sha256(json.dumps(sig).encode()).hexdigest()[:16]


@dataclass
class CopyPlan:
    block_ids: list[int]
    ops: list[tuple[HostRegion, int, int, int]]
    starts: list[int]  # chunk offset of each op, for bisect


@dataclass
class Mapping:
    """One engine's mapped ranks: the unit Store/Retrieve copy blocks of."""

    mapping_id: str
    namespace: str
    descriptor: bytes  # the MapRequest's ranks, to make re-mapping idempotent
    ranks: list[RankMapping]
    num_blocks: int
    block_bytes: int
    fingerprint: str
    closing: bool = False

    def is_current(self) -> bool:
        """Every shm region's name still names the file we hold open (a restarted
        client may have made a new file under the same name), and every memfd's
        owner is still running."""
        for rank in self.ranks:
            for region in rank.regions.values():
                if isinstance(region, (ShmRegion, MemfdRegion)) and not region.is_current():
                    return False
        return True

    @functools.cached_property
    def is_cuda(self) -> bool:
        return any(isinstance(r, CudaRegion) for rm in self.ranks for r in rm.regions.values())

    def check_blocks(self, block_ids: list[int], chunk_index: int) -> None:
        if not block_ids:
            raise InvalidRequest(
                f"chunk {chunk_index} lists no blocks", metadata={"chunkIndex": chunk_index}
            )
        for b in block_ids:
            if b >= self.num_blocks:
                raise InvalidRequest(
                    f"chunk {chunk_index}: block id {b} out of range [0, {self.num_blocks})",
                    reason="BLOCK_OUT_OF_RANGE",
                    metadata={
                        "chunkIndex": chunk_index,
                        "blockId": b,
                        "numBlocks": self.num_blocks,
                    },
                )

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()

    def synchronize(self) -> None:
        for rank in self.ranks:
            for region in rank.regions.values():
                region.synchronize()

    # --- copies (run on transfer threads) ---
    def plan(self, block_ids: list[int]) -> CopyPlan:
        """The copy of one chunk: merged (region, region offset, chunk offset, length)
        runs in chunk order (shared memory), or the block ids (CUDA)."""
        if self.is_cuda:
            return CopyPlan(block_ids, [], [])
        ops: list[tuple[HostRegion, int, int, int]] = []
        pos = 0
        last: HostRegion | None = None
        last_end = -1
        for rank in self.ranks:
            for t in rank.tensors:
                region = rank.regions[t.handle_key]
                assert not isinstance(region, CudaRegion)
                for off, n in t.runs(block_ids):
                    if region is last and off == last_end:  # contiguous: extend the run
                        r, o, p, m = ops[-1]
                        ops[-1] = (r, o, p, m + n)
                    else:
                        ops.append((region, off, pos, n))
                    last, last_end = region, off + n
                    pos += n
        return CopyPlan(block_ids, ops, [op[2] for op in ops])

    def copy_range(
        self, plan: CopyPlan, buf: memoryview, addr: int, lo: int, hi: int, *, to_store: bool
    ) -> int:
        """Copy chunk bytes [lo, hi) between the blocks and ``buf`` (the chunk in the
        store, at address ``addr``); returns the xxh3 of those chunk bytes, hashed
        right after the copy while they are still in cache. (On a Retrieve the blocks
        are written before the check: a mismatch fails the call with DATA_LOSS, so
        the engine never uses them.)"""
        ops = plan.ops
        i = max(0, bisect.bisect_right(plan.starts, lo) - 1)
        files: set[ShmRegion] = set()
        if not to_store:  # a write must not re-grow a truncated file
            files = {
                op[0]
                for op in ops[i : bisect.bisect_left(plan.starts, hi)]
                if isinstance(op[0], ShmRegion)
            }
            for f in files:
                f.check_size()
        while i < len(ops) and ops[i][2] < hi:
            region, off, pos, n = ops[i]
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                if to_store:
                    region.read(off + (a - pos), buf, addr, a, b)
                else:
                    region.write(off + (a - pos), buf, addr, a, b)
            i += 1
        for f in files:
            f.check_size()
        return xxhash.xxh3_64_intdigest(buf[lo:hi])

    def copy_cuda(self, plan: CopyPlan, host: torch.Tensor, *, to_store: bool) -> None:
        """Copy a whole chunk between CUDA blocks and its bytes in the pinned store
        (``host``: a slice of the store's pinned tensor, so copies are async DMA)."""
        self._cuda_copy(plan.block_ids, host, to_store=to_store)

    def _cuda_copy(self, block_ids: list[int], host: torch.Tensor, *, to_store: bool) -> None:
        pos = 0
        used: list[CudaRegion] = []
        for rank in self.ranks:
            for t in rank.tensors:
                region = rank.regions[t.handle_key]
                assert isinstance(region, CudaRegion)
                torch.cuda.set_device(region.device)
                view = region.view(t)
                idx = torch.tensor(block_ids, dtype=torch.long, device=region.device)
                n = t.block_bytes * len(block_ids)
                out_shape = list(t.shape)
                out_shape[t.block_dim] = len(block_ids)
                part = host[pos : pos + n].view(t.dtype).view(out_shape)
                with torch.cuda.stream(region.stream):
                    if to_store:
                        part.copy_(view.index_select(t.block_dim, idx), non_blocking=True)
                    else:
                        staged = part.to(region.device, non_blocking=True)
                        view.index_copy_(t.block_dim, idx, staged)
                used.append(region)
                pos += n
        for region in used:
            region.stream.synchronize()
