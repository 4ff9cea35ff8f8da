"""The remote tier's value format, keys, breaker and settings, without a server."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from kvsvc.server.config import (
    ConfigError,
    ServerConfig,
    parse_server_config,
    redact_url,
    remote_password,
)
from kvsvc.server.config.values import remote_url
from kvsvc.server.data.copies import checksum, segments
from kvsvc.server.tiers.redis import (
    BAD_CHECKSUM,
    BAD_HEADER,
    OTHER_LAYOUT,
    Rejected,
    Staging,
    encode,
    header_bytes,
    load_into,
    parse_head,
    redis_key,
)

MiB = 1 << 20


def digests_of(data: bytes) -> list[int]:
    view = memoryview(data)
    return [checksum(view[lo:hi]) for lo, hi in segments(len(data))]


def decode(pairs: list[tuple[bytes, object]], layout: str) -> bytes:
    """What a reader does with the values of one chunk."""
    rkey, first = pairs[0]
    parts, digests, data, n = parse_head(rkey, layout, bytes(first))  # type: ignore[arg-type]
    assert parts == len(pairs)
    views = [data] + [memoryview(bytes(v)) for _, v in pairs[1:]]  # type: ignore[arg-type]
    out = bytearray(n)
    load_into(memoryview(out), views, digests)
    return bytes(out)


@pytest.mark.parametrize(("size", "parts"), [(1, 1), (4096, 1), (MiB, 2), (3 * MiB + 17, 4)])
def test_values_round_trip_whole_and_split(size: int, parts: int) -> None:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    rkey = redis_key("kvsvc", "llama", "fp1", b"key")
    whole = encode(rkey, "fp1", memoryview(data), digests_of(data), 64 * MiB)
    assert len(whole) == 1
    assert decode(whole, "fp1") == data
    split = encode(rkey, "fp1", memoryview(data), digests_of(data), MiB)
    assert len(split) == parts
    assert all(len(bytes(v)) <= MiB for _, v in split)  # type: ignore[arg-type]
    assert [k for k, _ in split[1:]] == [rkey + b":%d" % i for i in range(1, len(split))]
    assert decode(split, "fp1") == data


def test_a_staged_first_value_is_the_header_and_the_bytes_sized_by_header_bytes() -> None:
    """The writer sizes its staging buffer with header_bytes: a chunk that fits in
    one part is exactly that header and its bytes, and staged it is the same value
    as built alone."""
    data = bytes(range(256)) * 40 + b"tail"
    digests = digests_of(data)
    rkey = redis_key("kvsvc", "llama", "fp1", b"key")
    ((_, alone),) = encode(rkey, "fp1", memoryview(data), digests, MiB)
    need = header_bytes("fp1", len(digests)) + len(data)
    assert len(alone) == need
    stage = Staging()
    stage.reset(need)
    addr = np.frombuffer(data, dtype=np.uint8).ctypes.data
    ((_, staged),) = encode(rkey, "fp1", memoryview(data), digests, MiB, stage, addr)
    assert bytes(staged) == alone
    assert decode([(rkey, staged)], "fp1") == data
    with pytest.raises(ValueError):  # full: a second chunk needs a reset first
        encode(rkey, "fp1", memoryview(data), digests, MiB, stage, addr)


def test_a_value_is_refused_for_what_it_is() -> None:
    data = b"kv" * 5000
    rkey = redis_key("kvsvc", "ns", "fp1", b"k")
    ((_, value),) = encode(rkey, "fp1", memoryview(data), digests_of(data), MiB)
    with pytest.raises(Rejected) as ei:
        parse_head(rkey, "fp2", value)
    assert ei.value.kind == OTHER_LAYOUT
    for bad in (b"", b"hello", b"XYZ" + value[3:], value[:20]):
        with pytest.raises(Rejected) as ei:
            parse_head(rkey, "fp1", bad)
        assert ei.value.kind == BAD_HEADER
    # The same value under another key (renamed, copied) is not that key's chunk.
    with pytest.raises(Rejected) as ei:
        parse_head(redis_key("kvsvc", "ns", "fp1", b"other"), "fp1", value)
    assert ei.value.kind == BAD_HEADER
    flipped = bytearray(value)
    flipped[-1] ^= 1
    _, digests, body, n = parse_head(rkey, "fp1", bytes(flipped))
    with pytest.raises(Rejected) as ei:
        load_into(memoryview(bytearray(n)), [body], digests)
    assert ei.value.kind == BAD_CHECKSUM
    with pytest.raises(Rejected):  # truncated
        load_into(memoryview(bytearray(n)), [body[:-1]], digests)


def test_keys_are_namespaced_and_free_of_cluster_hash_tags() -> None:
    a = redis_key("kvsvc", "{tenant}", "fp", b"{k}")
    assert b"{" not in a and b"}" not in a
    assert (
        len(
            {
                redis_key("p", ns, fp, k)
                for ns in ("a", "b")
                for fp in ("f", "g")
                for k in (b"x", b"y")
            }
        )
        == 8
    )
    assert redis_key("p", "a", "f", b"x") != redis_key("q", "a", "f", b"x")


def test_remote_settings() -> None:
    c = parse_server_config(["--remote", "redis+cluster://10.0.0.1:7000", "--remote-ttl", "60"])
    assert c.tiers.remote == "redis+cluster://10.0.0.1:7000" and c.tiers.remote_ttl == 60
    assert ServerConfig().tiers.remote == "off"
    for ok in ("off", "redis://h:6379/2", "rediss://user@h:6380", "rediss+cluster://h"):
        assert remote_url(ok) == ok
    assert remote_url("") == "off"  # KVSVC_REMOTE set to nothing (compose pass-through)
    for bad in ("http://h", "redis://", "h:6379", "redis://user:pw@h:6379"):
        with pytest.raises(argparse.ArgumentTypeError) as ei:
            remote_url(bad)
        assert "pw" not in str(ei.value) or "password-file" in str(ei.value)
    assert redact_url("redis://u:pw@h:1") == "redis://u:***@h:1"
    with pytest.raises(SystemExit):
        parse_server_config(["--remote-value-bytes", "100K"])


def test_password_file(tmp_path) -> None:
    f = tmp_path / "pw"
    f.write_text("secret\n")
    assert remote_password(ServerConfig.from_settings(remote_password_file=str(f))) == "secret"
    assert remote_password(ServerConfig()) is None
    with pytest.raises(ConfigError, match="--remote-password-file"):
        remote_password(ServerConfig.from_settings(remote_password_file=str(tmp_path / "missing")))
