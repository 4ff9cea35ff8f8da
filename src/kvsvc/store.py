"""The chunk store: one buffer allocated once (pinned when CUDA is present),
carved into chunks by a first-fit allocator, LRU eviction of chunks nobody is
reading, and a checksum per chunk verified on every read.

Only the event loop touches the metadata; copies into and out of a chunk's
bytes run on transfer threads while the chunk is reserved or read-pinned, so
eviction can never free memory a copy is using.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import xxhash

from kvsvc.errors import CapacityExhausted, DataLoss, LayoutMismatch

ALIGN = 4096
INLINE_LAYOUT = "inline"
#: Checksums cover 1 MiB segments of a chunk, so the pieces of one chunk can be
#: copied (and hashed while in cache) by several threads at once.
SEGMENT_BYTES = 1 << 20


def segments(size: int) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges of a chunk's checksum segments."""
    return [(lo, min(lo + SEGMENT_BYTES, size)) for lo in range(0, max(size, 1), SEGMENT_BYTES)]


def checksum(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Chunk:
    """One stored chunk; visible to readers only once committed."""

    key: tuple[str, bytes]
    offset: int
    size: int
    layout: str
    digests: list[int] = field(default_factory=list)  # one per segment
    committed: bool = False
    readers: int = 0
    alloc_size: int = field(default=0)


class ChunkStore:
    def __init__(
        self, capacity_bytes: int, *, pin_memory: bool = False, prefault: bool = True
    ) -> None:
        self.capacity = _align(capacity_bytes)
        if pin_memory:
            self.tensor = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
            self._mmap: mmap.mmap | None = None
        else:
            # Private anonymous mapping, allocated once: huge pages where the kernel
            # allows (a shared one is shmem, which THP usually skips: ~10 % slower
            # copies), touched up front so no copy pays page faults later.
            self._mmap = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
            if prefault:
                self.tensor.fill_(0)
        self.base = self.tensor.data_ptr()
        self.view = memoryview(
            (ctypes.c_char * self.capacity).from_address(self.tensor.data_ptr())
        ).cast("B")
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, size)
        self._chunks: OrderedDict[tuple[str, bytes], Chunk] = OrderedDict()
        self.used_bytes = 0
        self.evicted_total = 0
        self.checksum_failures = 0

    # --- queries ---
    def __len__(self) -> int:
        return sum(1 for c in self._chunks.values() if c.committed)

    def get(self, namespace: str, key: bytes) -> Chunk | None:
        chunk = self._chunks.get((namespace, key))
        return chunk if chunk is not None and chunk.committed else None

    def lookup(self, namespace: str, keys: list[bytes], layout: str | None) -> int:
        """Leading keys present (in ``layout`` when given)."""
        chunks, hits = self._chunks, 0
        for key in keys:  # get() inlined: this runs on every Lookup
            chunk = chunks.get((namespace, key))
            if chunk is None or not chunk.committed:
                break
            if layout is not None and chunk.layout != layout:
                break
            hits += 1
        return hits

    # --- reads ---
    def acquire_prefix(self, namespace: str, keys: list[bytes], layout: str) -> list[Chunk]:
        """Read-pin the leading present chunks; a chunk of another layout is an error."""
        out: list[Chunk] = []
        for key in keys:
            chunk = self.get(namespace, key)
            if chunk is None:
                break
            if chunk.layout != layout:
                raise LayoutMismatch(
                    f"chunk {key.hex()[:32]} was stored with layout {chunk.layout}, "
                    f"requested layout {layout}",
                    metadata={"key": key.hex(), "storedLayout": chunk.layout, "layout": layout},
                )
            out.append(chunk)
        for chunk in out:
            chunk.readers += 1
            self._chunks.move_to_end(chunk.key)
        return out

    def release(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.readers -= 1

    def chunk_view(self, chunk: Chunk) -> memoryview:
        return self.view[chunk.offset : chunk.offset + chunk.size]

    def address(self, chunk: Chunk) -> int:
        """Where the chunk's bytes start in memory, for memcpy."""
        return self.base + chunk.offset

    def chunk_tensor(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's bytes as a slice of the (pinned, on CUDA hosts) store tensor."""
        return self.tensor[chunk.offset : chunk.offset + chunk.size]

    def verify(self, chunk: Chunk, segment: int, digest: int) -> None:
        """Raise DataLoss (fatal) if the bytes read do not match the stored checksum."""
        if digest != chunk.digests[segment]:
            self.checksum_failures += 1  # a lost increment is harmless; the raise is not
            raise DataLoss(
                f"checksum mismatch on chunk {chunk.key[1].hex()[:32]} segment {segment} "
                f"(stored {chunk.digests[segment]:016x}, read {digest:016x})",
                metadata={"key": chunk.key[1].hex(), "namespace": chunk.key[0], "segment": segment},
            )

    # --- writes ---
    def reserve(self, namespace: str, key: bytes, size: int, layout: str) -> tuple[Chunk, int]:
        """Allocate space for a new chunk, evicting LRU chunks; returns (chunk, evicted)."""
        alloc = _align(max(size, 1))
        if alloc > self.capacity:
            raise CapacityExhausted(
                f"chunk of {size} bytes exceeds store capacity {self.capacity}",
                metadata={"chunkBytes": size, "capacityBytes": self.capacity},
            )
        evicted = 0
        offset = self._alloc(alloc)
        while offset is None:
            victim = next(
                (c for c in self._chunks.values() if c.committed and c.readers == 0), None
            )
            if victim is None:
                raise CapacityExhausted(
                    f"no room for {size} bytes: {self.used_bytes} of {self.capacity} bytes "
                    "are held by chunks being written or read",
                    metadata={"chunkBytes": size, "usedBytes": self.used_bytes},
                    retryable=True,
                )
            self._drop(victim)
            evicted += 1
            offset = self._alloc(alloc)
        chunk = Chunk((namespace, key), offset, size, layout, alloc_size=alloc)
        self.used_bytes += alloc
        # An uncommitted chunk under the same key (a racing Store) keeps its slot
        # until it commits or aborts; readers only ever see committed chunks.
        self.evicted_total += evicted
        return chunk, evicted

    def commit(self, chunk: Chunk, digests: list[int]) -> bool:
        """Publish a written chunk; False (and freed) if an equal key won the race."""
        existing = self._chunks.get(chunk.key)
        if existing is not None and existing.committed:
            self.abort(chunk)
            return False
        chunk.digests = digests
        chunk.committed = True
        self._chunks[chunk.key] = chunk
        self._chunks.move_to_end(chunk.key)
        return True

    def abort(self, chunk: Chunk) -> None:
        self._free_range(chunk.offset, chunk.alloc_size)
        self.used_bytes -= chunk.alloc_size

    def _drop(self, chunk: Chunk) -> None:
        del self._chunks[chunk.key]
        self._free_range(chunk.offset, chunk.alloc_size)
        self.used_bytes -= chunk.alloc_size

    # --- allocator: sorted free list, first fit, coalescing ---
    def _alloc(self, size: int) -> int | None:
        for i, (off, sz) in enumerate(self._free):
            if sz >= size:
                if sz == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, sz - size)
                return off
        return None

    def _free_range(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # merge with next, then previous
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free[i - 1]
            self._free[i - 1] = (prev[0], prev[1] + self._free[i][1])
            del self._free[i]
