"""The remote tier's value format: what a chunk looks like in Redis, and how a
value read back is verified before a byte of it is loaded.

A value is self-describing: a header (magic, format version, layout fingerprint,
the Redis key's hash, length, parts, one checksum per store segment) before the
bytes. A value whose header or checksum does not match is a miss (``Rejected``,
counted by its kind) and never loaded. Values above ``--remote-value-bytes`` are
split into parts under ``KEY:1``, ``KEY:2``, ...
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsvc.server.data import copies
from kvsvc.server.data.copies import checksum, segments

MAGIC = b"KVR"
#: 2: segment digests and the key hash are CRC-32C (kvsvc.server.data.checksum, STORE_FORMAT 2)
FORMAT_VERSION = 2
# magic, version, fingerprint length, parts, key hash, data length, segments
_HEAD = struct.Struct("<3sBHHQQI")

# Why a value was refused (the label of kvsvc_remote_rejected_values).
BAD_HEADER, OTHER_LAYOUT, BAD_CHECKSUM, MISSING_PART = (
    "header",
    "layout",
    "checksum",
    "part",
)


def redis_key(prefix: str, namespace: str, layout: str, key: bytes) -> bytes:
    """Namespaced, binary-safe, and without '{': no accidental Redis Cluster hash tag
    pins every key to one shard (hex spreads them over all)."""
    return redis_keys(prefix, namespace, layout, [key])[0]


def redis_keys(prefix: str, namespace: str, layout: str, keys: Sequence[bytes]) -> list[bytes]:
    """redis_key of each of ``keys`` (the common part made once: Lookup's path)."""
    head = b"%s:%s:%s:" % (prefix.encode(), namespace.encode().hex().encode(), layout.encode())
    return [head + key.hex().encode() for key in keys]


def header_bytes(layout: str, nseg: int) -> int:
    """The header's size for a chunk of ``nseg`` store segments in ``layout`` (what
    the first value holds before the chunk's bytes)."""
    return _HEAD.size + len(layout.encode()) + 8 * nseg


def encode(
    rkey: bytes,
    layout: str,
    data: memoryview,
    digests: Sequence[int],
    part_bytes: int,
    stage: Staging | None = None,
    addr: int = 0,
) -> list[tuple[bytes, Any]]:
    """(Redis key, value) pairs of one chunk: header + first part, then the rest
    (views of ``data``, sent as they are). With ``stage``: the first value is built
    in it, its bytes copied from ``addr`` (where ``data`` starts)."""
    fp = layout.encode()
    n = len(data)
    first = max(0, part_bytes - header_bytes(layout, len(digests)))
    if first <= 0:
        raise ValueError("--remote-value-bytes is too small for the header")
    rest = [data[lo : lo + part_bytes] for lo in range(first, n, part_bytes)]
    head = b"".join(
        (
            _HEAD.pack(
                MAGIC, FORMAT_VERSION, len(fp), 1 + len(rest), checksum(rkey), n, len(digests)
            ),
            fp,
            struct.pack(f"<{len(digests)}Q", *digests),
        )
    )
    value: Any
    if stage is None:
        value = b"".join((head, data[:first]))
    else:
        value = stage.add(head, addr, min(first, n))
    return [(rkey, value)] + [(rkey + b":%d" % (i + 1), part) for i, part in enumerate(rest)]


class Staging:
    """A writer's buffer for the first value of each chunk (header + bytes), reused
    batch after batch: no allocation and no page faults per value (a fresh bytes
    object per value cost more than the copy itself), and the bytes are copied by
    memmove without the GIL (ctypes releases it)."""

    def __init__(self) -> None:
        self._array = np.empty(0, dtype=np.uint8)
        self._used = 0

    def reset(self, need: int) -> None:
        """Room for ``need`` bytes; the views handed out before are dead from now."""
        if len(self._array) < need:
            self._array = np.empty(need, dtype=np.uint8)
        self._used = 0

    def add(self, head: bytes, addr: int, n: int) -> memoryview:
        lo = self._used
        hi = lo + len(head) + n
        if hi > len(self._array):
            raise ValueError("staging buffer too small (reset with the batch's size)")
        view = self._array.data[lo:hi]
        view[: len(head)] = head
        ctypes.memmove(self._array.ctypes.data + lo + len(head), addr, n)
        self._used = hi
        return view


@dataclass
class Value:
    """A verified chunk from Redis: its bytes and the store's per-segment checksums."""

    parts: list[memoryview]
    size: int
    digests: list[int]


class Rejected(Exception):
    """A value that is not this chunk: a miss of the given kind, never loaded."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


#: bytes of a header before its variable part (header_length reads them)
HEAD_FIXED_BYTES = _HEAD.size


def header_length(fixed: bytes | memoryview) -> int:
    """A value's header size, from its first HEAD_FIXED_BYTES (parse_head checks the
    rest); Rejected if they are not the start of a header."""
    if len(fixed) < _HEAD.size:
        raise Rejected(BAD_HEADER)
    magic, version, fp_len, _parts, _key_hash, _n, nseg = _HEAD.unpack_from(fixed)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise Rejected(BAD_HEADER)
    return int(_HEAD.size + fp_len + 8 * nseg)


def parse_head(
    rkey: bytes, layout: str, raw: bytes | memoryview
) -> tuple[int, list[int], memoryview, int]:
    """(parts, digests, first part's data, total length) of a value's first key."""
    if len(raw) < _HEAD.size:
        raise Rejected(BAD_HEADER)
    magic, version, fp_len, parts, key_hash, n, nseg = _HEAD.unpack_from(raw)
    if magic != MAGIC or version != FORMAT_VERSION or parts < 1:
        raise Rejected(BAD_HEADER)
    pos = _HEAD.size
    if raw[pos : pos + fp_len] != layout.encode():
        raise Rejected(OTHER_LAYOUT)
    if key_hash != checksum(rkey) or nseg != len(segments(n)):
        raise Rejected(BAD_HEADER)
    pos += fp_len
    if len(raw) < pos + 8 * nseg:
        raise Rejected(BAD_HEADER)
    digests = list(struct.unpack_from(f"<{nseg}Q", raw, pos))
    return parts, digests, memoryview(raw)[pos + 8 * nseg :], n


def load_into(
    dst: memoryview, parts: list[memoryview], digests: list[int], addr: int | None = None
) -> None:
    """Copy a value's parts into ``dst`` (at address ``addr``) one store segment at
    a time, hashing each segment right after its copy (still in cache: one pass
    over the bytes, as the copy path does); Rejected if any does not match (``dst``
    is then garbage). With ``addr`` and the native copy loop: one call without
    the GIL, so a reader thread reads the next replies meanwhile."""
    if sum(len(p) for p in parts) != len(dst):
        raise Rejected(BAD_HEADER)
    native = copies.NATIVE
    if native is not None and addr is not None:
        rows, pos = [], 0
        for part in parts:
            if len(part):
                rows.append((np.frombuffer(part, dtype=np.uint8).ctypes.data, pos, len(part)))
                pos += len(part)
        runs = np.array(rows, dtype=np.uint64).reshape(-1, 3)
        got = (ctypes.c_uint32 * len(digests))()
        native.copy(runs, addr, 0, len(dst), got, to_store=True)
        if list(got) != digests:
            raise Rejected(BAD_CHECKSUM)
        return
    pi, off = 0, 0  # where in the parts the next byte comes from
    for (lo, hi), digest in zip(segments(len(dst)), digests, strict=True):
        pos = lo
        while pos < hi:
            part = parts[pi]
            take = min(hi - pos, len(part) - off)
            dst[pos : pos + take] = part[off : off + take]
            pos += take
            off += take
            if off == len(part):
                pi, off = pi + 1, 0
        if checksum(dst[lo:hi]) != digest:
            raise Rejected(BAD_CHECKSUM)


def receive_into(
    some: Callable[[memoryview], int], dst: memoryview, addr: int, digests: list[int]
) -> bool:
    """Fill ``dst`` (at address ``addr``) with a value's bytes as ``some`` gives them
    (kvsvc.server.tiers.redis.replies.Replies.some: a socket read straight into
    ``dst``), checking each store segment's CRC-32C against ``digests``: each
    piece is hashed right after it lands (still in cache; the native CRC without
    the GIL), so the bytes are read off the socket and checked in one pass. False
    at the first segment that does not match (it stops there: ``dst`` is then
    garbage and the rest of the value unread)."""
    bounds = segments(len(dst))
    if len(bounds) != len(digests):
        return False
    native = copies.NATIVE
    for (lo, hi), digest in zip(bounds, digests, strict=True):
        pos, crc = lo, 0
        while pos < hi:
            got = some(dst[pos:hi])
            if native is not None:
                crc = native.crc32c(crc, addr + pos, got)
            pos += got
        if native is None:
            crc = checksum(dst[lo:hi])
        if crc != digest:
            return False
    return True
