"""The S3 tier's object format and names: what a chunk looks like in the bucket,
and how an object read back is checked before a byte of it is loaded.

One object per chunk, named ``PREFIX/NAMESPACE/LAYOUT/KEY`` (the namespace
percent-encoded, so a lifecycle rule or DropNamespace names it by prefix; the
layout by a short hash, the header holding it whole; the key in hex). An object
is a header (magic, format version, layout fingerprint, the object name's
CRC-32C, length, one CRC-32C per store segment) before the chunk's bytes: an
object whose header, name, length or checksums do not match is a miss
(``Rejected``, counted by its kind), never loaded."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from urllib.parse import quote

from kvsvc.server.data import copies
from kvsvc.server.data.copies import SEGMENT_BYTES, checksum, segment_count, segments

MAGIC = b"KVS3"
FORMAT_VERSION = 1
# magic, version, fingerprint length, name hash, data length, segments
_HEAD = struct.Struct("<4sBHIQI")
#: bytes of a header before its variable part (header_length reads them)
HEAD_FIXED_BYTES = _HEAD.size

# Why an object was refused (the label of kvsvc_s3_rejected_objects_total).
BAD_HEADER, OTHER_LAYOUT, OTHER_NAME, TRUNCATED, BAD_CHECKSUM = (
    "header",
    "layout",
    "name",
    "truncated",
    "checksum",
)


class Rejected(Exception):
    """An object that is not this chunk: a miss of the given kind, never loaded."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def namespace_prefix(prefix: str, namespace: str) -> str:
    """Every object of ``namespace`` starts with this (DropNamespace lists it)."""
    return f"{prefix}/{quote(namespace, safe='')}/"


def object_name(prefix: str, namespace: str, layout: str, key: bytes) -> str:
    layout_id = hashlib.sha256(layout.encode()).hexdigest()[:16]
    return f"{namespace_prefix(prefix, namespace)}{layout_id}/{key.hex()}"


def header(name: str, layout: str, size: int, digests: list[int]) -> bytes:
    """The header of the object ``name`` holding a chunk of ``size`` bytes."""
    fp = layout.encode()
    return b"".join(
        (
            _HEAD.pack(MAGIC, FORMAT_VERSION, len(fp), checksum(name.encode()), size, len(digests)),
            fp,
            struct.pack(f"<{len(digests)}Q", *digests),
        )
    )


def chunk_bytes(length: int, layout: str) -> int:
    """The chunk's bytes in an object of ``length`` bytes (a HEAD's answer) written
    by ``header`` in ``layout``; 0 when no chunk size fits it."""
    rest = length - _HEAD.size - len(layout.encode())  # digests + data
    n = rest - 8 * max(1, -(-rest // (SEGMENT_BYTES + 8)))
    return n if n >= 0 and n + 8 * segment_count(n) == rest else 0


def header_length(fixed: bytes) -> int:
    """A header's size from its first HEAD_FIXED_BYTES; Rejected if they are not
    the start of one."""
    if len(fixed) < _HEAD.size:
        raise Rejected(TRUNCATED)
    magic, version, fp_len, _name, _n, nseg = _HEAD.unpack_from(fixed)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise Rejected(BAD_HEADER)
    return int(_HEAD.size + fp_len + 8 * nseg)


def parse_header(name: str, layout: str, raw: bytes) -> tuple[int, list[int]]:
    """(chunk bytes, segment digests) from the whole header of object ``name``."""
    head_len = header_length(raw)
    if len(raw) < head_len:
        raise Rejected(TRUNCATED)
    _magic, _version, fp_len, name_hash, n, nseg = _HEAD.unpack_from(raw)
    pos = _HEAD.size
    if raw[pos : pos + fp_len] != layout.encode():
        raise Rejected(OTHER_LAYOUT)
    if name_hash != checksum(name.encode()):
        raise Rejected(OTHER_NAME)
    if nseg != len(segments(n)):
        raise Rejected(BAD_HEADER)
    digests = list(struct.unpack_from(f"<{nseg}Q", raw, pos + fp_len))
    return n, digests


def receive_into(
    readinto: Callable[[memoryview], int], dst: memoryview, addr: int, digests: list[int]
) -> None:
    """Fill ``dst`` (at address ``addr``) from ``readinto`` (the response body),
    hashing each store segment right after it lands (the native CRC without the
    GIL where built): the bytes are read and checked in one pass. Rejected when
    the body ends early or a segment does not match (``dst`` is then garbage)."""
    native = copies.NATIVE
    for (lo, hi), digest in zip(segments(len(dst)), digests, strict=True):
        pos, crc = lo, 0
        while pos < hi:
            got = readinto(dst[pos:hi])
            if got <= 0:
                raise Rejected(TRUNCATED)
            if native is not None:
                crc = native.crc32c(crc, addr + pos, got)
            pos += got
        if native is None:
            crc = checksum(dst[lo:hi])
        if crc != digest:
            raise Rejected(BAD_CHECKSUM)
