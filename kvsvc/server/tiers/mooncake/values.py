"""What a chunk looks like in Mooncake Store: one value per chunk, under the same
name and with the same self-verifying header as the S3 tier's objects
(kvsvc.server.tiers.s3.objects: magic, format, layout, the name's CRC-32C,
length, one CRC-32C per store segment), so a value that is not this chunk
(foreign, forged, truncated, another key's) is a miss, never loaded. The header
is put from registered memory beside the chunk's own bytes (two buffers, one
value): the bytes are never copied to be sent."""

from __future__ import annotations

import re

from kvsvc.server.tiers.s3.objects import (
    BAD_HEADER,
    TRUNCATED,
    Rejected,
    chunk_bytes,
    header,
    namespace_prefix,
    object_name,
    parse_header,
    receive_into,
)

__all__ = [
    "BAD_HEADER",
    "Rejected",
    "chunk_bytes",
    "drop_pattern",
    "header",
    "key_name",
    "verify",
]

#: characters a regular expression (Mooncake's remove_by_regex) reads specially
_SPECIAL = re.compile(r"([.^$|?*+()\[\]{}\\])")


def key_name(prefix: str, namespace: str, layout: str, key: bytes) -> str:
    """The Mooncake key of a chunk: ``PREFIX/NAMESPACE/LAYOUT/KEY`` (the namespace
    percent-encoded, the layout hashed, the key in hex)."""
    return object_name(prefix, namespace, layout, key)


def drop_pattern(prefix: str, namespace: str) -> str:
    """A regular expression matching every key of ``namespace`` (and no other)."""
    return "^" + _SPECIAL.sub(r"\\\1", namespace_prefix(prefix, namespace))


def verify(name: str, layout: str, head: memoryview, chunk: memoryview, addr: int) -> list[int]:
    """The chunk's segment digests once ``head`` (the header read back) and the
    bytes read into ``chunk`` (at ``addr``) are this chunk; Rejected otherwise."""
    size, digests = parse_header(name, layout, bytes(head))
    if size != len(chunk):
        raise Rejected(TRUNCATED)
    # The bytes are already there: each segment "arrives" whole, and is checked
    # by the same native CRC pass the S3 tier runs on a body as it lands.
    receive_into(len, chunk, addr, digests)
    return digests
