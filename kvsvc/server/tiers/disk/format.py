"""The on-disk format of one chunk: a file named by the hash of its identity
(namespace, layout, key), holding a self-describing header (format version, the
identity itself, the owner, the length, a CRC-32C per 1 MiB segment as the store
keeps them, and a CRC-32C of the header) followed by the bytes at a page-aligned
offset. A file is written under a temporary name in ``tmp/`` and renamed into
place, so a final name never holds a torn header; its bytes are checked against
the header's CRCs each time they are loaded back."""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from dataclasses import dataclass

from kvsvc.server.data.copies import SEGMENT_BYTES, checksum, segment_count

MAGIC = b"KVSD"
FORMAT_VERSION = 1
#: where the bytes start: the header is padded to a page (reads land page-aligned)
PAGE = 4096
SUFFIX = ".kv"
TMP_DIR = "tmp"
QUARANTINE_DIR = "quarantine"

# magic, version, header length, namespace, layout, owner and key lengths, size, segments
_FIXED = struct.Struct("<4sHIHHHIQI")
_CRC = struct.Struct("<I")

# Why a file was refused (counted and logged once per kind).
BAD_MAGIC = "bad_magic"
BAD_VERSION = "bad_version"
BAD_HEADER = "bad_header"
TRUNCATED = "truncated"
BAD_CHECKSUM = "bad_checksum"
OTHER_CHUNK = "other_chunk"
IO_ERROR = "io_error"
NOT_A_FILE = "not_a_file"


class Refused(Exception):
    """A file that does not check; ``kind`` is one of the kinds above."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Header:
    namespace: str
    layout: str
    key: bytes
    owner: str
    size: int
    digests: tuple[int, ...]
    #: offset of the bytes in the file (the header's length, page-aligned)
    data_offset: int

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.size


def open_file(path: str) -> tuple[int, os.stat_result]:
    """A chunk file opened for reading, and its stat. Non-blocking, and refused
    (NOT_A_FILE) unless a regular file: a FIFO or device named like a chunk would
    otherwise hang the index rebuild (and health) or a reader thread for ever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(NOT_A_FILE, f"mode {stat.filemode(st.st_mode)}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def file_name(namespace: str, layout: str, key: bytes) -> str:
    """``ab/abcdef....kv``: 256 subdirectories, names no tenant can choose or collide."""
    h = hashlib.blake2b(digest_size=20)
    for part in (namespace.encode(), layout.encode(), key):
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    hexed = h.hexdigest()
    return f"{hexed[:2]}/{hexed}{SUFFIX}"


def fingerprint(size: int, digests: tuple[int, ...] | list[int]) -> int:
    """Which bytes a chunk holds, from its length and segment CRCs: equal for a
    re-Store of the same bytes, so only other bytes replace a file."""
    return hash((size, *digests))


def encode_header(
    namespace: str, layout: str, key: bytes, owner: str, size: int, digests: list[int]
) -> bytes:
    """The header, padded to a page boundary (``data_offset``)."""
    ns, lay, own = namespace.encode(), layout.encode(), owner.encode()
    if len(digests) != segment_count(size):
        raise ValueError(f"{len(digests)} digests for {size} bytes")
    body_len = _FIXED.size + len(ns) + len(lay) + len(own) + len(key) + 4 * len(digests)
    data_offset = -(-(body_len + _CRC.size) // PAGE) * PAGE
    body = b"".join(
        [
            _FIXED.pack(
                MAGIC,
                FORMAT_VERSION,
                data_offset,
                len(ns),
                len(lay),
                len(own),
                len(key),
                size,
                len(digests),
            ),
            ns,
            lay,
            own,
            key,
            struct.pack(f"<{len(digests)}I", *digests),
        ]
    )
    head = body + _CRC.pack(checksum(body))
    return head + bytes(data_offset - len(head))


def header_length(first: bytes) -> int:
    """The header's length from its first bytes (at least _FIXED.size of them)."""
    _check_fixed(first)
    return int(_FIXED.unpack_from(first)[2])


def _check_fixed(raw: bytes | memoryview) -> tuple[int, ...]:
    if len(raw) < _FIXED.size:
        raise Refused(TRUNCATED, f"{len(raw)} header bytes")
    magic, version, *rest = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise Refused(BAD_MAGIC, repr(bytes(magic)))
    if version != FORMAT_VERSION:
        raise Refused(BAD_VERSION, f"version {version}, this server reads {FORMAT_VERSION}")
    return tuple(rest)


def parse_header(raw: bytes | memoryview) -> Header:
    """The header at the start of ``raw`` (its first page or more), checked."""
    data_offset, ns_len, lay_len, own_len, key_len, size, nseg = _check_fixed(raw)
    body_len = _FIXED.size + ns_len + lay_len + own_len + key_len + 4 * nseg
    if data_offset % PAGE or data_offset < body_len + _CRC.size:
        raise Refused(BAD_HEADER, f"data offset {data_offset}")
    if len(raw) < body_len + _CRC.size:
        raise Refused(TRUNCATED, f"{len(raw)} of {body_len + _CRC.size} header bytes")
    (crc,) = _CRC.unpack_from(raw, body_len)
    if checksum(bytes(raw[:body_len])) != crc:
        raise Refused(BAD_HEADER, "header checksum")
    if nseg != segment_count(size):
        raise Refused(BAD_HEADER, f"{nseg} segments for {size} bytes")
    at = _FIXED.size
    fields = []
    for n in (ns_len, lay_len, own_len, key_len):
        fields.append(bytes(raw[at : at + n]))
        at += n
    digests = struct.unpack_from(f"<{nseg}I", raw, at)
    try:
        ns, lay, own = (f.decode() for f in fields[:3])
    except UnicodeDecodeError as exc:
        raise Refused(BAD_HEADER, str(exc)) from None
    return Header(ns, lay, fields[3], own, size, digests, data_offset)


def verify(view: memoryview, digests: tuple[int, ...]) -> None:
    """Each 1 MiB segment of ``view`` against its CRC-32C, or Refused(BAD_CHECKSUM)."""
    for i, lo in enumerate(range(0, max(len(view), 1), SEGMENT_BYTES)):
        if checksum(view[lo : lo + SEGMENT_BYTES]) != digests[i]:
            raise Refused(BAD_CHECKSUM, f"segment {i}")
