"""The S3 tier's pieces that need no server: object names (one prefix per
namespace, whatever the namespace holds), the object format (a header only this
object's name, layout and bytes satisfy), error kinds, the breaker, and the
settings (an endpoint without credentials, a credentials file)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from kvsvc.server.config import SETTINGS, ConfigError, ServerConfig
from kvsvc.server.data.copies import checksum, segments
from kvsvc.server.tiers.s3.client import (
    AUTH,
    BUCKET,
    CONNECTION,
    MISSING,
    SERVER,
    TIMEOUT,
    credentials,
    error_kind,
)
from kvsvc.server.tiers.s3.objects import (
    HEAD_FIXED_BYTES,
    Rejected,
    chunk_bytes,
    header,
    header_length,
    namespace_prefix,
    object_name,
    parse_header,
    receive_into,
)


def obj(name: str, layout: str, data: bytes) -> bytes:
    digests = [checksum(data[lo:hi]) for lo, hi in segments(len(data))]
    return header(name, layout, len(data), digests) + data


def read_back(name: str, layout: str, raw: bytes) -> bytes:
    """What the tier's reader does with an object's bytes: the chunk, or Rejected."""
    body = io.BytesIO(raw)
    head_len = header_length(raw[:HEAD_FIXED_BYTES])
    n, digests = parse_header(name, layout, raw[:head_len])
    if len(raw) != head_len + n:
        raise Rejected("truncated")
    body.seek(head_len)
    dst = np.empty(n, dtype=np.uint8)  # at a real address: the native CRC reads it
    receive_into(body.readinto, dst.data, dst.ctypes.data, digests)
    return dst.tobytes()


def test_names_put_each_namespace_under_its_own_prefix() -> None:
    name = object_name("kvsvc", "ten/ant a", "layout", b"\x01\xff")
    assert name.startswith(namespace_prefix("kvsvc", "ten/ant a"))
    assert name.startswith("kvsvc/ten%2Fant%20a/") and name.endswith("/01ff")
    # a namespace that is a prefix of another never shares its prefix
    assert not namespace_prefix("kvsvc", "ab").startswith(namespace_prefix("kvsvc", "a"))
    assert object_name("p", "ns", "l1", b"k") != object_name("p", "ns", "l2", b"k")


@pytest.mark.parametrize("size", [1, 1 << 20, (3 << 20) + 7])
def test_an_object_reads_back_as_its_chunk(size: int) -> None:
    data = os.urandom(size)
    name = object_name("p", "ns", "L", b"key")
    assert read_back(name, "L", obj(name, "L", data)) == data


@pytest.mark.parametrize(
    "size", [0, 1, (1 << 20) - 8, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 << 20, 32 << 20]
)
def test_a_heads_length_gives_the_chunks_bytes(size: int) -> None:
    """What a HEAD says (the object's length) is the chunk's size, whatever the
    layout's length and however many segments; a length no chunk makes is 0."""
    for layout in ("inline", "L" * 300):
        digests = [0] * len(segments(size))
        length = len(header("n", layout, size, digests)) + size
        assert chunk_bytes(length, layout) == size
    assert chunk_bytes(HEAD_FIXED_BYTES + 6 + 3, "inline") == 0  # 3 digest bytes: none fits
    assert chunk_bytes(5, "inline") == 0


def test_objects_that_are_not_this_chunk_are_refused_by_kind() -> None:
    data = os.urandom((2 << 20) + 5)
    name = object_name("p", "ns", "L", b"key")
    good = obj(name, "L", data)
    cases = {
        "truncated": good[:-1],
        "header": b"not kvsvc at all" + good[16:],
        "layout": obj(name, "other", data),
        "name": obj(object_name("p", "ns", "L", b"other"), "L", data),
        "checksum": good[:-3] + bytes(b ^ 0xFF for b in good[-3:]),
    }
    for kind, raw in cases.items():
        with pytest.raises(Rejected) as ei:
            read_back(name, "L", raw)
        assert ei.value.kind == kind
    with pytest.raises(Rejected) as ei:
        header_length(good[:5])
    assert ei.value.kind == "truncated"


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def test_every_failure_has_a_kind() -> None:
    assert error_kind(client_error("NoSuchKey", 404)) == MISSING
    assert error_kind(client_error("404", 404)) == MISSING
    assert error_kind(client_error("NoSuchBucket", 404)) == BUCKET
    assert error_kind(client_error("SignatureDoesNotMatch", 403)) == AUTH
    assert error_kind(client_error("Forbidden", 403)) == AUTH
    assert error_kind(client_error("SlowDown", 503)) == SERVER
    assert error_kind(EndpointConnectionError(endpoint_url="http://x")) == CONNECTION
    assert error_kind(ReadTimeoutError(endpoint_url="http://x")) == TIMEOUT


def test_the_endpoint_takes_no_credentials_and_the_file_gives_them(tmp_path: Path) -> None:
    endpoint = SETTINGS["s3_endpoint"]
    with pytest.raises(ConfigError, match="credentials go in --s3-credentials-file"):
        endpoint.from_env({endpoint.env: "http://key:secret@host:9000"})
    with pytest.raises(ConfigError, match="not an S3 endpoint"):
        endpoint.from_env({endpoint.env: "ftp://host"})
    assert endpoint.from_env({endpoint.env: "https://s3.example:9000"}) == "https://s3.example:9000"
    path = tmp_path / "aws"
    path.write_text("[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
    config = ServerConfig.from_settings(s3_credentials_file=str(path))
    assert credentials(config) == {"aws_access_key_id": "AK", "aws_secret_access_key": "SK"}
    path.write_text("[other]\naws_access_key_id = AK\n")
    with pytest.raises(ConfigError, match="no \\[default\\] profile"):
        credentials(config)
    assert credentials(ServerConfig()) == {}  # boto3's standard chain


def test_without_boto3_the_tier_refuses_to_start_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from kvsvc.server.tiers.s3.client import require_boto3

    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"--s3-endpoint needs boto3: pip install 'kvsvc\[s3\]'"):
        require_boto3()
