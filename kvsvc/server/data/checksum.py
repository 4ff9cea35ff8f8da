"""What a chunk's checksum is: a CRC-32C per 1 MiB segment, shared by the store,
the copy path and every tier's self-verifying format."""

from __future__ import annotations

import crc32c

#: Checksums cover 1 MiB segments of a chunk, so the pieces of one chunk can be
#: copied (and hashed while in cache) by several threads at once.
SEGMENT_BYTES = 1 << 20
#: What a chunk's checksums are. Format 1 was xxh3-64 per segment; format 2 is
#: CRC-32C per segment, which the native copy loop computes in the same GIL-free
#: call as the copy (the CPU's crc32 instruction needs no header beyond the
#: compiler's), and the ``crc32c`` package computes identically without it.
STORE_FORMAT = 2
CHECKSUM_ALGORITHM = "crc32c"

#: (chunk index, segment index, CRC-32C): a Store piece returns its segments'; a
#: Retrieve piece those that failed their check (none: all loaded).
Digest = tuple[int, int, int]


def segments(size: int) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges of a chunk's checksum segments."""
    return [(lo, min(lo + SEGMENT_BYTES, size)) for lo in range(0, max(size, 1), SEGMENT_BYTES)]


def segment_count(size: int) -> int:
    """``len(segments(size))``, without making the list (per call on the hot path)."""
    return max(1, -(-size // SEGMENT_BYTES))


def checksum(view: memoryview | bytes) -> int:
    """CRC-32C of a segment (the package drops the GIL for large buffers)."""
    return int(crc32c.crc32c(view))
