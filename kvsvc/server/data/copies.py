"""The copy path: copy plans (an engine's blocks as merged byte runs), the pieces
one Store or Retrieve is cut into, how they are grouped into tasks for the copy
threads, and which loop runs them (``NATIVE``: kvsvc.server.data.nativecopy's
loop, or Python's). The checksum they take is kvsvc.server.data.checksum's
(its names are also importable from here).

The engine's side of a copy is ``Blocks`` (blocks under a mapping: memcpy from a
sealed memfd, ``preadv``/``pwritev`` on a shm file, CUDA copies into pinned
memory) or ``Inline`` (bytes carried in the message). Handlers pick one per chunk;
everything after that is the same for both.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvsvc.errors import LayoutMismatch
from kvsvc.server.data.checksum import SEGMENT_BYTES, Digest, checksum, segment_count, segments
from kvsvc.server.data.claims import Claims
from kvsvc.server.data.nativecopy import CRC_PATHS, TRUNCATED, NativeCopy, load_native, why_not
from kvsvc.server.data.regions import (
    CudaRegion,
    HostRegion,
    Mapping,
    MemfdRegion,
    PassedFileRegion,
    ShmRegion,
)
from kvsvc.server.ops import failpoints

#: Below this a copy runs as one task: a hand-off between threads costs more
#: than the parallel copy saves.
PARALLEL_MIN_BYTES = 4 << 20
#: Copy plans kept per mapping (by block ids); an engine reuses its block ids.
PLAN_CACHE_SIZE = 4096

Piece = Callable[[], list[Digest]]


def failed_chunks(results: list[list[Digest]]) -> dict[int, Digest]:
    """A Retrieve's chunks that failed their check (chunk index -> its first failed
    segment seen), from its tasks' results."""
    out: dict[int, Digest] = {}
    for group in results:
        for d in group:
            out.setdefault(d[0], d)
    return out


def copy_loop() -> tuple[str, str]:
    """Which copy loop runs copies in this process and why: ("native", what it runs
    on) or ("python", why not native), for the start line and GetServerInfo."""
    native = NATIVE
    if native is not None:
        files = "mapped, SIGBUS guarded" if native.guards else "by positional I/O"
        return "native", (
            f"built with the package; passed shared files {files}; "
            f"CRC-32C on {CRC_PATHS[min(native.level, 2)]}"
        )
    return "python", why_not() or "the native loop is turned off in this process"


#: The loaded native copy loop; None runs every copy in Python (tests set it).
NATIVE: NativeCopy | None = load_native()


@dataclass
class ChunkBuffer:
    """A chunk's bytes in the store, as the copy pieces see them."""

    view: memoryview
    addr: int  # where ``view`` starts, for memcpy
    store_tensor: torch.Tensor  # the whole store (pinned on CUDA hosts)
    offset: int  # of the chunk in ``store_tensor``
    namespace: str
    key: bytes
    expected: list[int]  # stored checksums, one per segment (empty while storing)

    @property
    def size(self) -> int:
        return len(self.view)

    @property
    def tensor(self) -> torch.Tensor:
        """The chunk's bytes as a tensor, for CUDA copies (a torch slice costs
        microseconds: only CUDA copies make it)."""
        return self.store_tensor[self.offset : self.offset + self.size]

    def check(self, ci: int, segment: int, digest: int) -> list[Digest]:
        """A Retrieve's check of one segment copied out: [] if ``digest`` is the stored
        checksum, else the failure (the handler drops the chunk, never reports it
        loaded)."""
        return [] if digest == self.expected[segment] else [(ci, segment, digest)]


# --- copy plans and copies between an engine's blocks and a chunk ---
@dataclass
class CopyPlan:
    block_ids: list[int]
    ops: list[tuple[HostRegion, int, int, int]]  # (region, region offset, chunk offset, n)
    starts: list[int]  # chunk offset of each op, for bisect
    #: For the native loop (mapped regions only): rows of (address, chunk offset, n).
    runs: np.ndarray | None = None
    #: The passed plain files among ``runs``' regions: they may shrink under the
    #: mapping, so the native loop copies them guarded, checking their size.
    files: tuple[PassedFileRegion, ...] = ()


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
    runs = None
    files = tuple({r: None for r, *_ in ops if isinstance(r, PassedFileRegion)})
    if all(mapped(op[0]) for op in ops):
        rows = [(r.base + o, p, n) for r, o, p, n in ops]  # type: ignore[union-attr,operator]
        runs = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    return CopyPlan(block_ids, ops, [op[2] for op in ops], runs, files)


def mapped(region: HostRegion) -> bool:
    """Whether the native loop can copy this region through its mapping."""
    if isinstance(region, PassedFileRegion):
        return region.base is not None
    return isinstance(region, MemfdRegion)


_plan_lock = threading.Lock()


def cached_plan(mapping: Mapping, block_ids: list[int]) -> CopyPlan:
    """The plan of these blocks, made once per mapping (engines reuse block ids)."""
    key = tuple(block_ids)
    found: CopyPlan | None = mapping.plans.get(key)
    if found is None:
        found = plan(mapping, block_ids)
        with _plan_lock:
            if len(mapping.plans) >= PLAN_CACHE_SIZE:
                del mapping.plans[next(iter(mapping.plans))]
            mapping.plans[key] = found
    return found


def copy_range(
    plan: CopyPlan, buf: memoryview, addr: int, lo: int, hi: int, *, to_store: bool
) -> int:
    """Copy chunk bytes [lo, hi) between the blocks and ``buf`` (the chunk in the
    store, at address ``addr``); returns the CRC-32C of those chunk bytes, taken
    right after the copy while they are still in cache. (On a Retrieve the blocks
    are written before the check: a chunk that fails it is never reported loaded.)"""
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

    @property
    def loop_safe(self) -> bool:
        """Its copies only move memory that cannot shrink (sealed memfds): they
        neither block nor fault, so a small one may run on the event loop."""
        return self.mapping.memfd_only

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
        """One piece per checksum segment (one per chunk on CUDA). A Retrieve checks
        each segment against the stored checksums (returns the failures); a Store
        returns them. The copy
        plan is made (or found in the mapping's cache) by the first piece that runs,
        on a copy thread, so the event loop only validates and reserves."""
        mapping = self.mapping
        if mapping.is_cuda:
            segs = segments(chunk.size)

            def cuda_piece() -> list[Digest]:
                if not to_store:  # checked in pinned memory: a bad chunk is not copied
                    for si, (lo, hi) in enumerate(segs):
                        if bad := chunk.check(ci, si, checksum(chunk.view[lo:hi])):
                            return bad
                copy_cuda(mapping, self.block_ids, chunk.tensor, to_store=to_store)
                if to_store:
                    return [
                        (ci, si, checksum(chunk.view[lo:hi])) for si, (lo, hi) in enumerate(segs)
                    ]
                return []

            return [cuda_piece]
        job = _BlockCopy(mapping, self.block_ids, chunk, ci, to_store)
        return [SegmentPiece(job, si) for si in range(segment_count(chunk.size))]


class _BlockCopy:
    """The copy of one chunk between host blocks and the store, run a span of
    segments at a time: one native call per span where it can, else the Python loop."""

    def __init__(
        self, mapping: Mapping, block_ids: list[int], chunk: ChunkBuffer, ci: int, to_store: bool
    ) -> None:
        self.mapping, self.block_ids, self.chunk = mapping, block_ids, chunk
        self.ci, self.to_store = ci, to_store

    def run(self, a: int, b: int) -> list[Digest]:
        """Segments [a, b) of the chunk."""
        chunk, ci, to_store = self.chunk, self.ci, self.to_store
        p = cached_plan(self.mapping, self.block_ids)
        lo, hi = a * SEGMENT_BYTES, min(b * SEGMENT_BYTES, chunk.size)
        native = native_for(p)
        if native is not None and p.runs is not None:
            digests = (ctypes.c_uint32 * (b - a))(*([] if to_store else chunk.expected[a:b]))
            before_guarded(p, to_store)
            failed, got = native.copy(
                p.runs, chunk.addr, lo, hi, digests, to_store=to_store, guarded=bool(p.files)
            )
            after_guarded(p, failed)
            if to_store:
                return [(ci, a + k, d) for k, d in enumerate(digests)]
            return [(ci, a + failed, got)] if failed >= 0 else []
        out: list[Digest] = []
        for si in range(a, b):
            s_lo, s_hi = si * SEGMENT_BYTES, min((si + 1) * SEGMENT_BYTES, chunk.size)
            digest = copy_range(p, chunk.view, chunk.addr, s_lo, s_hi, to_store=to_store)
            if to_store:
                out.append((ci, si, digest))
            elif bad := chunk.check(ci, si, digest):
                return bad  # the rest of this chunk is not copied
        return out

    def run_claimed(self, claims: Claims, me: int) -> list[Digest]:
        """Task ``me`` of the chunk's copy shared by ``claims``: its segments, then
        help with the others' (see Claims)."""
        chunk, ci, to_store = self.chunk, self.ci, self.to_store
        p = cached_plan(self.mapping, self.block_ids)
        native = native_for(p)
        if native is not None and p.runs is not None and native.claims:
            before_guarded(p, to_store)
            failed, got = native.claim(
                p.runs, chunk.addr, chunk.size, claims, me, to_store=to_store,
                guarded=bool(p.files),
            )  # fmt: skip
            after_guarded(p, failed)
            if to_store:
                return [(ci, s, claims.digests[s]) for s in claims.mine(me)]
            return [(ci, failed, got)] if failed >= 0 else []
        out: list[Digest] = []
        while (si := claims.next(me)) is not None:
            s_lo, s_hi = si * SEGMENT_BYTES, min((si + 1) * SEGMENT_BYTES, chunk.size)
            digest = copy_range(p, chunk.view, chunk.addr, s_lo, s_hi, to_store=to_store)
            if to_store:
                out.append((ci, si, digest))
            elif digest != claims.digests[si]:
                claims.stop()
                return [(ci, si, digest)]
        return out


def native_for(p: CopyPlan) -> NativeCopy | None:
    """The native loop if it can copy this plan: a plan with passed plain files
    needs its guarded copies."""
    native = NATIVE
    if native is not None and p.files and not native.guards:
        return None
    return native


def before_guarded(p: CopyPlan, to_store: bool) -> None:
    """A guarded write starts only into files still as long as the mapping."""
    if not to_store:
        for f in p.files:
            f.check_size()


def after_guarded(p: CopyPlan, failed: int) -> None:
    """REGION_TRUNCATED for a guarded copy that faulted, or whose file is now shorter
    than the mapping (a truncate inside the last page reads zeros, no fault)."""
    for f in p.files:
        f.check_size()
    if failed == TRUNCATED:  # the file was truncated and grown back since the fault
        f = p.files[0]
        raise f._truncated(f.size)


class SegmentPiece:
    """One checksum segment of a chunk's copy; ``tasks`` runs neighbours as one span."""

    __slots__ = ("job", "si")

    def __init__(self, job: _BlockCopy, si: int) -> None:
        self.job, self.si = job, si

    def __call__(self) -> list[Digest]:
        return self.job.run(self.si, self.si + 1)


class Inline:
    """Bytes carried in the message: stored from ``data``, or retrieved into ``out``."""

    #: copies between the message and the store never block
    loop_safe = True

    def __init__(self, data: bytes = b"") -> None:
        self.data = data
        self.nbytes = len(data)
        self.out = bytearray()

    def check(self, size: int, chunk_index: int) -> None:
        """Any stored size fits: the reply carries it."""

    def pieces(self, chunk: ChunkBuffer, ci: int, *, to_store: bool) -> list[Piece]:
        if not to_store:
            self.out = bytearray(chunk.size)
        data, dst = memoryview(self.data), chunk.view
        out = memoryview(self.out)

        def piece(si: int, lo: int, hi: int) -> Piece:
            def store() -> list[Digest]:
                dst[lo:hi] = data[lo:hi]
                return [(ci, si, checksum(dst[lo:hi]))]

            def load() -> list[Digest]:
                out[lo:hi] = dst[lo:hi]
                return chunk.check(ci, si, checksum(out[lo:hi]))

            return store if to_store else load

        return [piece(si, lo, hi) for si, (lo, hi) in enumerate(segments(chunk.size))]


Side = Blocks | Inline


def tasks(pieces: list[Piece], nbytes: int, threads: int) -> list[Callable[[], list[Digest]]]:
    """The pieces of one copy as a few tasks, one per copy thread at most; small
    copies run as one task. Neighbouring segments of one chunk run as one span
    (one native call)."""
    threads = threads if nbytes > PARALLEL_MIN_BYTES else 1
    n_tasks = max(1, min(len(pieces), threads))
    per = -(-len(pieces) // n_tasks)
    job = pieces[0].job if isinstance(pieces[0], SegmentPiece) else None
    if (
        n_tasks > 1
        and job is not None
        and not failpoints.ENABLED  # the transfer.copy failpoint cuts static spans
        and all(
            isinstance(p, SegmentPiece) and p.job is job and p.si == i for i, p in enumerate(pieces)
        )
    ):
        # One chunk's segments (in order: Blocks.pieces): its tasks share them.
        bounds = [(i, min(i + per, len(pieces))) for i in range(0, len(pieces), per)]
        claims = Claims(bounds, None if job.to_store else job.chunk.expected)
        return [functools.partial(job.run_claimed, claims, me) for me in range(len(bounds))]

    def task(group: list[Piece], first: int) -> Callable[[], list[Digest]]:
        def run() -> list[Digest]:
            out: list[Digest] = []
            i = 0
            # The transfer.copy failpoint fires before the copy's second piece (only
            # when failpoints are loaded is a span cut there).
            cut = 1 if failpoints.ENABLED else -1
            while i < len(group):
                if first + i == cut:
                    failpoints.hit("transfer.copy")
                piece, j = group[i], i + 1
                if isinstance(piece, SegmentPiece):
                    while j < len(group) and first + j != cut:
                        nxt = group[j]
                        if not (isinstance(nxt, SegmentPiece) and nxt.job is piece.job):
                            break
                        j += 1
                    out.extend(piece.job.run(piece.si, piece.si + j - i))
                else:
                    out.extend(piece())
                i = j
            return out

        return run

    return [task(pieces[i : i + per], i) for i in range(0, len(pieces), per)]
