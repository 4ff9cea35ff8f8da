"""The wire contract and the server's spine: every request ends in a result or
an explicit error envelope, health tells the truth, SIGTERM drains."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import NOT_SERVING, SERVING, health_status, wait_health, wait_inflight

from kvsvc.client import KVCacheClient
from kvsvc.errors import MAX_MESSAGE_BYTES, from_remote_error, to_remote_error, truncate_utf8
from kvsvc.server.ops.health import SERVICE_NAME
from kvsvc.v1 import error_pb2
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts servers or subprocesses


def stub(address: str) -> tuple[grpc.Channel, pb_grpc.KVCacheServiceStub]:
    ch = grpc.insecure_channel(address)
    return ch, pb_grpc.KVCacheServiceStub(ch)


def test_inline_round_trip_is_bit_exact(client: KVCacheClient) -> None:
    data = [os.urandom(n) for n in (1, 4096, 1 << 20)]
    keys = [b"k%d" % i for i in range(3)]
    r = client.put("ns", list(zip(keys, data, strict=True)))
    assert (r.stored_chunks, r.present_chunks) == (3, 0)
    assert client.lookup([*keys, b"missing"], namespace="ns") == 3
    assert client.lookup([b"missing", *keys], namespace="ns") == 0
    assert client.get_many("ns", keys) == data
    # another namespace never sees them
    assert client.lookup(keys, namespace="other") == 0
    # storing again is reported as present, not silently re-written
    assert client.put("ns", [(keys[0], data[0])]).present_chunks == 1


def test_success_carries_result_and_errors_carry_envelope(server) -> None:
    ch, s = stub(server.address)
    with ch:
        ok = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        assert ok.WhichOneof("outcome") == "result"
        assert ok.result.envelope_version == 1 and ok.result.serving
        bad = s.Store(pb.StoreRequest(inline=pb.InlineChunks(namespace="", chunks=[])), timeout=5)
        assert bad.WhichOneof("outcome") == "error"
        e = bad.error
        assert (e.envelope_version, e.type, e.code) == (
            1,
            "InvalidRequest",
            error_pb2.CODE_INVALID_ARGUMENT,
        )
        assert e.reason == "INVALID_ARGUMENT" and e.request_id
        assert e.transfer_state == error_pb2.TRANSFER_STATE_NOT_STARTED


def test_raising_handler_gives_envelope_and_traceback_stays_in_log(spawn) -> None:
    srv = spawn(env={"KVSVC_FAILPOINTS": "handler.enter=Lookup@raise"})
    ch, s = stub(srv.address)
    with ch:
        r = s.Lookup(pb.LookupRequest(namespace="ns", keys=[b"a"]), timeout=5)
        e = r.error
        assert e.type == "FailpointError"
        assert e.code == error_pb2.CODE_INTERNAL and e.reason == "HANDLER_FAILED"
        assert "Traceback" not in e.message and "failpoint handler.enter fired" in e.message
        # the next request on the same channel succeeds; health is unchanged
        assert s.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).result.serving
    assert health_status(srv.address) == SERVING
    deadline = time.monotonic() + 5
    while e.request_id not in srv.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = srv.output()
    assert e.request_id in log and "Traceback" in log


def test_message_is_cut_to_4096_bytes_on_a_character_boundary(server) -> None:
    label = "ключ€😀" * 800  # > 10,000 bytes of multi-byte UTF-8
    assert len(label.encode()) > 10_000
    tensor = pb.KVTensor(name=label, shape=[4], strides=[1], dtype=99)
    ch, s = stub(server.address)
    with ch:
        r = s.Map(pb.MapRequest(namespace="ns", ranks=[pb.RankRegion(tensors=[tensor])]), timeout=5)
    e = r.error
    raw = e.message.encode("utf-8")
    assert len(raw) <= MAX_MESSAGE_BYTES and e.message_truncated
    raw.decode("utf-8", errors="strict")
    assert e.message.startswith("tp_rank=0 pp_rank=0 group_id='' (ranks[0]) layer 'ключ€😀")


def test_truncate_utf8_never_splits_a_character() -> None:
    for text in ("a" * 5000, "€" * 5000, "😀" * 3000, "x€" * 3000):
        cut, truncated = truncate_utf8(text)
        assert truncated and len(cut.encode()) <= MAX_MESSAGE_BYTES
        assert text.startswith(cut) and len(cut.encode()) > MAX_MESSAGE_BYTES - 4
    assert truncate_utf8("short") == ("short", False)


def test_envelope_round_trips_into_the_same_exception_class() -> None:
    from kvsvc.errors import LayoutMismatch

    exc = LayoutMismatch("x", metadata={"a": 1})
    back = from_remote_error(to_remote_error(exc, "rid"))
    assert type(back) is LayoutMismatch and back.metadata == {"a": "1"}
    assert back.request_id == "rid" and back.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    "request_fn, reason",
    [
        (lambda s: s.Store(pb.StoreRequest(), timeout=5), "UNSUPPORTED_REQUEST"),
        (lambda s: s.Retrieve(pb.RetrieveRequest(), timeout=5), "UNSUPPORTED_REQUEST"),
        (lambda s: s.Lookup(pb.LookupRequest(keys=[b"a"]), timeout=5), "UNSUPPORTED_REQUEST"),
        (
            lambda s: s.GetServerInfo(
                pb.GetServerInfoRequest(header=pb.RequestHeader(envelope_version=2)), timeout=5
            ),
            "UNSUPPORTED_ENVELOPE_VERSION",
        ),
        (
            lambda s: s.Map(
                pb.MapRequest(
                    namespace="ns",
                    ranks=[pb.RankRegion(tensors=[pb.KVTensor(shape=[1], strides=[1], dtype=42)])],
                ),
                timeout=5,
            ),
            "INVALID_ARGUMENT",
        ),
        (
            lambda s: s.Map(
                pb.MapRequest(
                    namespace="ns",
                    ranks=[pb.RankRegion(tensors=[pb.KVTensor(shape=[1], strides=[1], dtype=1)])],
                ),
                timeout=5,
            ),
            "INVALID_ARGUMENT",  # memory handle oneof unset
        ),
    ],
)
def test_unknown_requests_get_explicit_errors_and_the_channel_survives(
    server, request_fn, reason
) -> None:
    ch, s = stub(server.address)
    with ch:
        r = request_fn(s)
        assert r.WhichOneof("outcome") == "error"
        assert r.error.reason == reason
        assert r.error.code == error_pb2.CODE_INVALID_ARGUMENT
        assert (
            s.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).WhichOneof("outcome") == "result"
        )


def test_unknown_enum_value_is_named(server) -> None:
    ch, s = stub(server.address)
    with ch:
        t = pb.KVTensor(name="layer.0", shape=[1], strides=[1], dtype=42)
        r = s.Map(pb.MapRequest(namespace="ns", ranks=[pb.RankRegion(tensors=[t])]), timeout=5)
    assert "unsupported dtype 42" in r.error.message


def test_health_serving_then_fatal_flips_both_names_and_watch_sees_it(spawn) -> None:
    srv = spawn(env={"KVSVC_FAILPOINTS": "transfer.before_copy=raise"})
    assert health_status(srv.address, "") == SERVING
    assert health_status(srv.address, SERVICE_NAME) == SERVING
    with grpc.insecure_channel(srv.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            h.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND

        seen: queue.Queue[int] = queue.Queue()
        stream = h.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=20)

        def drain() -> None:
            try:
                for msg in stream:
                    seen.put(msg.status)
            except grpc.RpcError:
                pass

        threading.Thread(target=drain, daemon=True).start()
        assert seen.get(timeout=5) == SERVING
        with KVCacheClient(srv.address) as c:
            from kvsvc.errors import FatalServerError, ServiceNotServing

            with pytest.raises(FatalServerError) as fe:
                c.put("ns", [(b"k", b"v")])
            assert fe.value.reason == "TRANSFER_WORKER_FAILED"
            assert seen.get(timeout=5) == NOT_SERVING
            assert health_status(srv.address, "") == NOT_SERVING
            # sticky, and transfer RPCs are refused
            with pytest.raises(ServiceNotServing):
                c.put("ns", [(b"k2", b"v")])
            info = c.server_info()
            assert not info.serving and info.failure_reason == "TRANSFER_WORKER_FAILED"
            assert info.failure_time.seconds > 0
        stream.cancel()
    assert health_status(srv.address, SERVICE_NAME) == NOT_SERVING


def test_sigterm_drains_in_flight_call_and_exits_zero(spawn) -> None:
    srv = spawn(
        "--shutdown-grace", "10", env={"KVSVC_FAILPOINTS": "transfer.before_copy=sleep(4000)"}
    )
    results: queue.Queue[object] = queue.Queue()

    def slow_store() -> None:
        with KVCacheClient(srv.address) as c:
            try:
                results.put(c.put("ns", [(b"k", b"x" * 1000)]))
            except Exception as exc:  # noqa: BLE001 - reported to the test thread
                results.put(exc)

    t = threading.Thread(target=slow_store)
    t.start()
    wait_inflight(srv.address, 1)  # the store is now sleeping (4 s) inside the worker
    srv.signal(signal.SIGTERM)
    wait_health(srv.address, NOT_SERVING)
    t.join(15)
    result = results.get(timeout=1)
    assert isinstance(result, pb.StoreResult) and result.stored_chunks == 1
    assert srv.wait(15) == 0


def test_unix_socket_listen(spawn, shm_dir) -> None:
    import subprocess
    import sys

    path = shm_dir.parent / "kvsvc.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsvc",
            "serve",
            "--listen",
            f"unix:{path}",
            "--shm-dir",
            str(shm_dir),
            "--store-bytes",
            "16M",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with KVCacheClient(f"unix:{path}") as c:
            c.put("ns", [(b"k", b"v")])
            assert c.get("ns", b"k") == b"v"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_eviction_under_capacity_pressure_is_reported(make_server) -> None:
    srv = make_server(store_bytes=1 << 20)
    with KVCacheClient(srv.address) as c:
        blob = os.urandom(400 << 10)
        assert c.put("ns", [(b"a", blob)]).evicted_chunks == 0
        assert c.put("ns", [(b"b", blob)]).evicted_chunks == 0
        r = c.put("ns", [(b"c", blob)])
        assert r.stored_chunks == 1 and r.evicted_chunks == 1
        assert c.lookup([b"a"], namespace="ns") == 0  # the least recently used went
        assert c.get("ns", b"c") == blob
        assert c.server_info().evicted_chunks == 1
        from kvsvc.errors import CapacityExhausted

        with pytest.raises(CapacityExhausted):
            c.put("ns", [(b"huge", b"x" * (2 << 20))])
