"""Hypothesis fuzz of every RPC (issue 15): hostile but well-formed requests and raw
garbage frames against a real `kvsvc serve` with tenants. Every answer must be a
typed result or error, the server must stay SERVING and keep serving a healthy
client in parallel, and its log must stay bounded (no tracebacks, no ERROR, few
WARNINGs).

CI runs KVSVC_FUZZ_EXAMPLES (default 1000; Map a tenth, as each may wait out its short
deadline) examples per RPC; the long run is
``KVSVC_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q tests/server/test_security_fuzz.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.client import KVCacheClient
from kvsvc.errors import MALFORMED_LOG_INTERVAL_S, REASONS
from kvsvc.server.security.auth import AUTH_LOG_INTERVAL_S
from kvsvc.v1 import kv_cache_service_pb2 as pb

EXAMPLES = int(os.environ.get("KVSVC_FUZZ_EXAMPLES", "1000"))
TOKEN = secrets.token_hex(16)
OTHER = secrets.token_hex(16)
SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"]
F = FieldDescriptor

HOSTILE_STRINGS = st.one_of(
    st.sampled_from(["", ".", "..", "../x", "/etc/passwd", "a/b", "ns", "\x00", "*", "é" * 300]),
    st.text(max_size=40),
    st.text(min_size=1000, max_size=1100),
)
HOSTILE_INTS = st.one_of(
    st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (F.TYPE_STRING,):
        return HOSTILE_STRINGS
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.binary(min_size=1025, max_size=1100))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if t == F.TYPE_FLOAT else 64)
    if t == F.TYPE_ENUM:
        return st.integers(-3, 40)  # known and unknown values
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.integers(-(2**31), 2**31 - 1)
    return HOSTILE_INTS


def message(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Any message of ``desc``: each field set or not, oneofs with one member or none,
    repeated fields of up to 4 hostile values, nested to depth 3."""
    cls = GetMessageClass(desc)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.type == F.TYPE_MESSAGE:
            if depth >= 3 or f.message_type.full_name.startswith("google.protobuf"):
                continue
            value: st.SearchStrategy[Any] = st.deferred(
                lambda f=f: message(f.message_type, depth + 1)
            )
        else:
            value = _scalar(f)
        if f.is_repeated:
            value = st.lists(value, max_size=4)
        fields[f.name] = st.one_of(st.none(), value)

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        msg = cls()
        for name, strategy in fields.items():
            v = draw(strategy)
            if v is None:
                continue
            f = desc.fields_by_name[name]
            try:
                if f.is_repeated:
                    getattr(msg, name).extend(v)
                elif f.type == F.TYPE_MESSAGE:
                    getattr(msg, name).CopyFrom(v)
                else:
                    setattr(msg, name, v)
            except (ValueError, TypeError):
                pass  # a value this field cannot hold (an enum out of a closed range)
        return msg

    return build()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from support import ServerProcess

    d: Path = tmp_path_factory.mktemp("fuzz")
    shm = d / "shm"
    shm.mkdir()
    tenants = d / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": {
                    "fuzz": {"tokens": [TOKEN], "namespaces": ["*"]},
                    "other": {"tokens": [OTHER], "namespaces": ["ns"]},
                }
            }
        )
    )
    tenants.chmod(0o600)  # plaintext tokens: the owner's alone (else a warning at start)
    proc = ServerProcess(shm, "--auth-token-file", str(tenants), "--default-deadline", "2")
    stop = threading.Event()
    failures: list[BaseException] = []
    served = [0]

    def healthy() -> None:  # a well-behaved tenant, all along
        with KVCacheClient(proc.address, token=OTHER) as c:
            i = 0
            while not stop.is_set():
                try:
                    c.put("ns", [(b"h%d" % i, b"v" * 256)], timeout=10)
                    assert c.get("ns", b"h%d" % i, timeout=10) == b"v" * 256
                    served[0] += 1
                except BaseException as exc:  # noqa: BLE001 - collected for the assert
                    failures.append(exc)
                i += 1

    worker = threading.Thread(target=healthy)
    started = time.monotonic()
    worker.start()
    channel = grpc.insecure_channel(proc.address)
    yield proc, channel
    stop.set()
    worker.join(30)
    channel.close()
    out = proc.output()
    proc.kill()
    assert not failures, failures[:3]
    assert served[0] > 0
    assert "Traceback" not in out, out[out.index("Traceback") - 200 :][:2000]
    assert " ERROR " not in out, [line for line in out.splitlines() if " ERROR " in line][:3]
    # Two rate-bounded kinds (refused credentials, unparsable requests), at most one
    # line each per interval however many came; nothing else warns.
    warnings = [line for line in out.splitlines() if " WARNING " in line]
    bound = 2 * (
        (time.monotonic() - started) / min(AUTH_LOG_INTERVAL_S, MALFORMED_LOG_INTERVAL_S) + 1
    )
    assert len(warnings) <= bound, warnings[:5]
    allowed = ("kvsvc.server.security.auth: unauthenticated", "does not parse")
    assert all(any(a in w for a in allowed) for w in warnings), [
        w for w in warnings if not any(a in w for a in allowed)
    ][:3]


def _check(method: str, response: Any) -> None:
    """A typed result, or a RemoteError the catalogue declares that is not a crash."""
    outcome = response.WhichOneof("outcome")
    assert outcome in ("result", "error"), (method, response)
    if outcome == "error":
        assert response.error.reason in REASONS, response.error
        assert response.error.reason not in ("HANDLER_FAILED", "FATAL_SERVER_ERROR"), response.error


def _check_session(raw: bytes, responses: list[pb.SessionResponse]) -> None:
    """One answer per request the frame carries (itself and those in ``more``, nested
    too), each in its own message (this client did not ask for batches): the
    request's own response, or an envelope error (a kind this server does not know,
    or bytes that did not parse: one answer, id 0)."""
    try:
        stack, carried = [pb.SessionRequest.FromString(raw)], 0
        while stack:
            carried += 1
            stack.extend(stack.pop().more)
    except DecodeError:
        carried = 1
    assert len(responses) == carried, responses
    for response in responses:
        assert not response.more, response
        kind = response.WhichOneof("response")
        assert kind is not None, response
        if kind == "error":
            assert response.error.reason in REASONS, response.error
            assert response.error.reason != "HANDLER_FAILED", response.error
        else:
            _check(kind, getattr(response, kind))


def _call(channel: grpc.Channel, method: str, raw: bytes, token: str | None) -> None:
    m = SERVICE.methods_by_name[method]
    response_cls = GetMessageClass(m.output_type)
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    path = f"/{SERVICE.full_name}/{method}"
    try:
        if m.client_streaming:  # Session: the frame as the stream's one request
            stream = channel.stream_stream(
                path, request_serializer=lambda b: b, response_deserializer=response_cls.FromString
            )
            _check_session(raw, list(stream(iter([raw]), timeout=5, metadata=metadata)))
            return
        if m.server_streaming:  # WatchEvents: its first answer, then hang up
            watch = channel.unary_stream(
                path, request_serializer=lambda b: b, response_deserializer=response_cls.FromString
            )
            call = watch(raw, timeout=5, metadata=metadata)
            try:
                first = next(call)  # a stream that ends with no answer is a failure
            finally:
                call.cancel()
            if first.WhichOneof("outcome") == "batch":
                assert first.batch.lost, first  # no cursor it could serve: a resync first
            else:
                _check(method, first)
            return
        rpc = channel.unary_unary(
            path, request_serializer=lambda b: b, response_deserializer=response_cls.FromString
        )
        response = rpc(raw, timeout=5 if method != "Map" else 0.5, metadata=metadata)
    except grpc.RpcError as exc:
        # Only these may come as a status: no credentials, or our own short deadline.
        assert exc.code() in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ), (method, exc.code(), exc.details())
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            assert token != TOKEN
        return
    _check(method, response)


METHODS = [m.name for m in SERVICE.methods]


@pytest.mark.parametrize("method", METHODS)
def test_fuzz_every_rpc_with_hostile_well_formed_requests(fuzz_server, method):
    _, channel = fuzz_server
    request = message(SERVICE.methods_by_name[method].input_type)
    # DropNamespace as OTHER may drop "ns", the healthy tenant's own namespace: its
    # right, and not what this fuzz is after (the healthy tenant's chunks disappear).
    own = [OTHER] if method != "DropNamespace" else []
    tokens = st.sampled_from([TOKEN, TOKEN, TOKEN, *own, None, "x" * 40])

    @settings(
        max_examples=EXAMPLES if method != "Map" else max(20, EXAMPLES // 10),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(request=request, token=tokens)
    def run(request: Any, token: str | None) -> None:
        _call(channel, method, request.SerializeToString(), token)

    run()


@pytest.mark.parametrize("method", METHODS)
def test_fuzz_every_rpc_with_garbage_frames(fuzz_server, method):
    _, channel = fuzz_server

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(raw=st.binary(max_size=256))
    def run(raw: bytes) -> None:
        _call(channel, method, raw, TOKEN)

    run()


def test_the_server_is_serving_after_the_fuzz(fuzz_server):
    proc, _ = fuzz_server
    with KVCacheClient(proc.address, token=TOKEN) as c:
        info = c.server_info(timeout=10)
        assert info.serving  # health needs credentials on this port: server_info says it
