"""The copy path, in one place: the checksum (shared with the store), copy plans
(an engine's blocks as merged byte runs), the pieces one Store or Retrieve is
cut into, and how they are grouped into tasks for the copy threads.

The engine's side of a copy is ``Blocks`` (blocks under a mapping: memcpy from a
sealed memfd, ``preadv``/``pwritev`` on a shm file, CUDA copies into pinned
memory) or ``Inline`` (bytes carried in the message). Handlers pick one per chunk;
everything after that is the same for both.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from kvsvc import failpoints
from kvsvc.errors import DataLoss, LayoutMismatch
from kvsvc.regions import CudaRegion, HostRegion, Mapping, ShmRegion

#: Checksums cover 1 MiB segments of a chunk, so the pieces of one chunk can be
#: copied (and hashed while in cache) by several threads at once.
SEGMENT_BYTES = 1 << 20
#: Below this a copy runs as one task: a hand-off between threads costs more
#: than the parallel copy saves.
PARALLEL_MIN_BYTES = 4 << 20

Digest = tuple[int, int, int]  # (chunk index, segment index, xxh3)
Piece = Callable[[], list[Digest]]


def segments(size: int) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges of a chunk's checksum segments."""
    return [(lo, min(lo + SEGMENT_BYTES, size)) for lo in range(0, max(size, 1), SEGMENT_BYTES)]


def checksum(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)


@dataclass
class ChunkBuffer:
    """A chunk's bytes in the store, as the copy pieces see them."""

    view: memoryview
    addr: int  # where ``view`` starts, for memcpy
    tensor: torch.Tensor  # the same bytes (pinned on CUDA hosts), for CUDA copies
    namespace: str
    key: bytes
    expected: list[int]  # stored checksums, one per segment (empty while storing)
    on_mismatch: Callable[[], None]

    @property
    def size(self) -> int:
        return len(self.view)

    def verify(self, segment: int, digest: int) -> None:
        """Raise DataLoss (fatal) if the bytes read do not match the stored checksum."""
        if digest != self.expected[segment]:
            self.on_mismatch()
            raise DataLoss(
                f"checksum mismatch on chunk {self.key.hex()[:32]} segment {segment} "
                f"(stored {self.expected[segment]:016x}, read {digest:016x})",
                metadata={"key": self.key.hex(), "namespace": self.namespace, "segment": segment},
            )


# --- copy plans and copies between an engine's blocks and a chunk ---
@dataclass
class CopyPlan:
    block_ids: list[int]
    ops: list[tuple[HostRegion, int, int, int]]  # (region, region offset, chunk offset, n)
    starts: list[int]  # chunk offset of each op, for bisect


def plan(mapping: Mapping, block_ids: list[int]) -> CopyPlan:
    """The copy of one chunk: merged (region, region offset, chunk offset, length)
    runs in chunk order (shared memory), or the block ids (CUDA)."""
    if mapping.is_cuda:
        return CopyPlan(block_ids, [], [])
    ops: list[tuple[HostRegion, int, int, int]] = []
    pos = 0
    last: HostRegion | None = None
    last_end = -1
    for rank in mapping.ranks:
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
    plan: CopyPlan, buf: memoryview, addr: int, lo: int, hi: int, *, to_store: bool
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
    return checksum(buf[lo:hi])


def copy_cuda(
    mapping: Mapping, block_ids: list[int], host: torch.Tensor, *, to_store: bool
) -> None:
    """Copy a whole chunk between CUDA blocks and its bytes in the pinned store
    (``host``: a slice of the store's pinned tensor, so copies are async DMA)."""
    pos = 0
    used: list[CudaRegion] = []
    for rank in mapping.ranks:
        for t in rank.tensors:
            region = rank.regions[t.handle_key]
            assert isinstance(region, CudaRegion)
            torch.cuda.set_device(region.device)
            view = region.view(t)
            idx = torch.tensor(block_ids, dtype=torch.long, device=region.device)
            n = t.block_bytes * len(block_ids)
            out_shape = list(t.shape)
            out_shape[t.block_dim] = len(block_ids)
            part = host[pos : pos + n].view(view.dtype).view(out_shape)
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


# --- the engine's side of a copy: one per chunk ---
class Blocks:
    """Blocks of a mapping: stored from, or retrieved into."""

    def __init__(self, mapping: Mapping, block_ids: list[int], chunk_index: int) -> None:
        mapping.check_blocks(block_ids, chunk_index)
        self.mapping = mapping
        self.block_ids = block_ids
        self.nbytes = len(block_ids) * mapping.block_bytes

    def check(self, size: int, chunk_index: int) -> None:
        """A stored chunk fits these blocks exactly (Retrieve)."""
        if size != self.nbytes:
            raise LayoutMismatch(
                f"chunk {chunk_index} holds {size // self.mapping.block_bytes} blocks, "
                f"the request lists {len(self.block_ids)}",
                reason="BLOCK_COUNT_MISMATCH",
                metadata={"chunkIndex": chunk_index, "listedBlocks": len(self.block_ids)},
            )

    def pieces(self, chunk: ChunkBuffer, ci: int, *, to_store: bool) -> list[Piece]:
        """One piece per checksum segment (one per chunk on CUDA). A Retrieve verifies
        each segment against the stored checksums; a Store returns them. The copy
        plan is made by the first piece that runs, on a copy thread, so the event
        loop only validates and reserves, and planning overlaps other chunks' copies."""
        mapping, segs = self.mapping, segments(chunk.size)
        made: list[CopyPlan] = []
        lock = threading.Lock()

        def the_plan() -> CopyPlan:
            if not made:
                with lock:
                    if not made:
                        made.append(plan(mapping, self.block_ids))
            return made[0]

        def check(si: int, digest: int) -> list[Digest]:
            if not to_store:
                chunk.verify(si, digest)
                return []
            return [(ci, si, digest)]

        if mapping.is_cuda:

            def cuda_piece() -> list[Digest]:
                out: list[Digest] = []
                if not to_store:  # verify before the bytes reach the engine's blocks
                    for si, (lo, hi) in enumerate(segs):
                        out += check(si, checksum(chunk.view[lo:hi]))
                copy_cuda(mapping, self.block_ids, chunk.tensor, to_store=to_store)
                if to_store:
                    for si, (lo, hi) in enumerate(segs):
                        out += check(si, checksum(chunk.view[lo:hi]))
                return out

            return [cuda_piece]

        buf, addr = chunk.view, chunk.addr

        def piece(si: int, lo: int, hi: int) -> Piece:
            return lambda: check(si, copy_range(the_plan(), buf, addr, lo, hi, to_store=to_store))

        return [piece(si, lo, hi) for si, (lo, hi) in enumerate(segs)]


class Inline:
    """Bytes carried in the message: stored from ``data``, or retrieved into ``out``."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data
        self.nbytes = len(data)
        self.out = bytearray()

    def check(self, size: int, chunk_index: int) -> None:
        """Any stored size fits: the reply carries it."""

    def pieces(self, chunk: ChunkBuffer, ci: int, *, to_store: bool) -> list[Piece]:
        if not to_store:
            self.out = bytearray(chunk.size)
        data, dst = self.data, chunk.view
        out = memoryview(self.out)

        def piece(si: int, lo: int, hi: int) -> Piece:
            def store() -> list[Digest]:
                dst[lo:hi] = data[lo:hi]
                return [(ci, si, checksum(dst[lo:hi]))]

            def load() -> list[Digest]:
                out[lo:hi] = dst[lo:hi]
                chunk.verify(si, checksum(out[lo:hi]))
                return []

            return store if to_store else load

        return [piece(si, lo, hi) for si, (lo, hi) in enumerate(segments(chunk.size))]


Side = Blocks | Inline


def tasks(pieces: list[Piece], nbytes: int, threads: int) -> list[Callable[[], list[Digest]]]:
    """The pieces of one copy as a few tasks, one per copy thread at most; small
    copies run as one task."""
    threads = threads if nbytes > PARALLEL_MIN_BYTES else 1
    n_tasks = max(1, min(len(pieces), threads))
    per = -(-len(pieces) // n_tasks)

    def task(group: list[Piece], first: int) -> Callable[[], list[Digest]]:
        def run() -> list[Digest]:
            out: list[Digest] = []
            for i, piece in enumerate(group):
                if first + i == 1:
                    failpoints.hit("transfer.copy")
                out.extend(piece())
            return out

        return run

    return [task(pieces[i : i + per], i) for i in range(0, len(pieces), per)]
