"""The Mooncake tier's pieces that need no Mooncake: its key names and the drop
pattern (one namespace's keys, no other's), a value read back checked (the S3
objects' header: a forged, copied or damaged value is refused), and what each
Mooncake return code counts as."""

from __future__ import annotations

import ctypes
import os
import re

import pytest

from kvsvc.server.data.copies import checksum, segments
from kvsvc.server.tiers.mooncake.client import FAILURES, NOT_FOUND, code_kind
from kvsvc.server.tiers.mooncake.values import (
    Rejected,
    chunk_bytes,
    drop_pattern,
    header,
    key_name,
    verify,
)

LAYOUT = "inline"


def test_the_drop_pattern_matches_its_namespace_only() -> None:
    pattern = re.compile(drop_pattern("kv.s", "a.b"))
    assert pattern.match(key_name("kv.s", "a.b", LAYOUT, b"k"))
    for other in (("kv.s", "a.bc"), ("kv.s", "aXb"), ("kvXs", "a.b"), ("kv.s", "a.b/x")):
        assert not pattern.match(key_name(*other, LAYOUT, b"k")), other


def value(name: str, data: bytes) -> bytes:
    digests = [checksum(data[lo:hi]) for lo, hi in segments(len(data))]
    return header(name, LAYOUT, len(data), digests) + data


def check(name: str, raw: bytes) -> list[int]:
    size = chunk_bytes(len(raw), LAYOUT)
    head = len(raw) - size
    buf = (ctypes.c_char * max(size, 1)).from_buffer_copy(raw[head:].ljust(1, b"\0"))
    chunk = memoryview(buf).cast("B")[:size]
    return verify(name, LAYOUT, memoryview(raw[:head]), chunk, ctypes.addressof(buf))


def test_a_value_reads_back_checked_and_anything_else_is_refused() -> None:
    data = os.urandom(3 << 20 | 5)
    name = key_name("kvsvc", "ns", LAYOUT, b"k")
    assert chunk_bytes(len(value(name, data)), LAYOUT) == len(data)
    assert check(name, value(name, data)) == [
        checksum(data[lo:hi]) for lo, hi in segments(len(data))
    ]
    with pytest.raises(Rejected, match="name"):  # another key's value copied here
        check(name, value(key_name("kvsvc", "ns", LAYOUT, b"other"), data))
    damaged = bytearray(value(name, data))
    damaged[-100] ^= 1
    with pytest.raises(Rejected, match="checksum"):
        check(name, bytes(damaged))
    with pytest.raises(Rejected, match="header"):
        check(name, os.urandom(len(value(name, data))))


def test_mooncake_codes_are_misses_or_counted_failures() -> None:
    assert code_kind(-704) == code_kind(-703) == NOT_FOUND  # not a failure
    assert code_kind(-900) == "rpc" and "rpc" in FAILURES  # the master
    assert code_kind(-800) == "transfer" and "transfer" in FAILURES  # the peer
    assert code_kind(-200) == "no_space" and "no_space" not in FAILURES
    assert code_kind(-706) == "leased"
    assert code_kind(-1) == "internal"
    assert code_kind(-777) == "object"  # an unknown code: named by its hundred
    assert code_kind(-99999) == "other"
