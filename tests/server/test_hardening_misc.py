"""Issue 12 hardening: a Retrieve never re-grows a truncated file, a clean stop
never logs a fake fatal, a request that does not parse gets a typed reply
without flooding the log, a CUDA handle on a CPU-only server is named as such,
and health runs on public gRPC API only."""

from __future__ import annotations

import ast
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import NOT_SERVING, SERVING, ServerThread, health_status, make_cache, truncating

from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import rank_context
from kvsvc.errors import (
    FINISHED,
    NO_TRANSFER,
    NOT_STARTED,
    CudaUnavailable,
    InvalidRequest,
    MalformedRequest,
    RegionUnavailable,
    from_remote_error,
)
from kvsvc.server.config import ServerConfig
from kvsvc.server.ops import health as health_module
from kvsvc.server.ops.health import SERVICE_NAME
from kvsvc.server.ops.lifecycle import Server
from kvsvc.server.ops.watchdog import Watchdog
from kvsvc.v1 import kv_cache_service_pb2 as pb

pytestmark = pytest.mark.slow  # starts servers or subprocesses

SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"]
# Field 1, length-delimited, 255 bytes long, in a 2-byte message: no parser accepts it.
GARBAGE = b"\x0a\xff"


# --- defect 7: writing never extends a client's file ---
@pytest.mark.parametrize("keep", [0, 4096])
def test_retrieve_into_a_truncated_file_never_regrows_it(
    server, client: KVCacheClient, shm_dir: Path, keep: int
) -> None:
    cache = make_cache(shm_dir, "regrow", seed=7)
    m = client.map("ns", [cache.rank_region()])
    client.store(m, [(b"k", [10, 11])])
    os.truncate(cache.path, keep)  # the owner shrinks its region after Map
    with pytest.raises(RegionUnavailable) as ei:
        client.retrieve(m, [(b"k", [10, 11])])
    assert ei.value.reason == "REGION_TRUNCATED"
    assert ei.value.transfer_state == FINISHED
    assert ei.value.metadata["name"] == "regrow"
    assert os.stat(cache.path).st_size == keep  # not re-grown, not even in part
    assert client.leased_blocks(m) == set()
    assert health_status(server.address) == SERVING
    # Given its size back, the same mapping works again.
    os.truncate(cache.path, cache.size)
    assert client.retrieve(m, [(b"k", [10, 11])]).loaded_chunks == 1


def test_retrieve_while_the_owner_truncates_never_leaves_the_file_grown(
    server, client: KVCacheClient, shm_dir: Path
) -> None:
    """Truncates racing Retrieves: whatever each call answers, once the owner's last
    truncate is done the file has the size the owner gave it."""
    cache = make_cache(shm_dir, "race", layers=4, seed=3)
    m = client.map("ns", [cache.rank_region()])
    client.store(m, [(b"k", list(range(12)))])
    with truncating(cache):
        for _ in range(30):
            try:
                client.retrieve(m, [(b"k", list(range(12)))])
            except RegionUnavailable as exc:
                assert exc.reason == "REGION_TRUNCATED" and exc.transfer_state == FINISHED
    os.truncate(cache.path, 4096)
    with pytest.raises(RegionUnavailable):
        client.retrieve(m, [(b"k", list(range(12)))])
    assert os.stat(cache.path).st_size == 4096
    assert health_status(server.address) == SERVING


# --- defect 9: a clean stop never logs a fake fatal ---
def _fatal_records(records: list[logging.LogRecord]) -> list[str]:
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in records
        if r.levelno >= logging.ERROR or "fatal" in r.getMessage().lower()
    ]


def test_fifty_stops_log_no_fatal_and_leave_no_watchdog(
    config: ServerConfig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    # A watchdog that looks often, and threads that switch often: more chances for
    # it to look while the server stops.
    monkeypatch.setattr(Watchdog, "PERIOD_S", 0.001)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for i in range(50):
            st = ServerThread(config.replace(store_bytes=4 << 20))
            server = st.server
            assert not st.run(_stop_then_watchdog_alive(server)), f"stop {i}"
            st.loop.call_soon_threadsafe(st.loop.stop)
            st.thread.join(10)
            assert server.health.failure_reason == "", f"stop {i}"
    finally:
        sys.setswitchinterval(interval)
    assert _fatal_records(caplog.records) == []
    assert [t for t in threading.enumerate() if t.name == "kvsvc-watchdog"] == []


async def _stop_then_watchdog_alive(server: Server) -> bool:
    """Stop the server; is its watchdog thread still running when stop() returns?"""
    watchdog = server.watchdog
    await server.stop(0)
    return watchdog._thread.is_alive()


def test_sigterm_exits_zero_without_a_fatal_line(spawn) -> None:
    for _ in range(3):
        srv = spawn()
        with grpc.insecure_channel(srv.address) as ch:
            stream = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30
            )
            seen = [next(stream).status]
            srv.signal(signal.SIGTERM)
            try:
                for msg in stream:  # ends when the server stops
                    seen.append(msg.status)
            except grpc.RpcError:
                pass
        assert srv.wait(30) == 0
        assert seen[0] == SERVING and NOT_SERVING in seen, seen
        log = srv.output()
        for bad in ("CRITICAL", "fatal failure", "watchdog", "Traceback"):
            assert bad not in log, log
        assert "stopped" in log


# --- defect 11a: a request that does not parse ---
def _raw_call(ch: grpc.Channel, service: str, method: str) -> grpc.UnaryUnaryMultiCallable:
    # No serializers: the bytes go out as given and come back unparsed.
    return ch.unary_unary(f"/{service}/{method}")


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
def test_unparsable_request_gets_a_typed_invalid_argument(server, method: str) -> None:
    response_cls = getattr(pb, SERVICE.methods_by_name[method].output_type.name)
    with grpc.insecure_channel(server.address) as ch:
        raw = _raw_call(ch, SERVICE.full_name, method)(GARBAGE, timeout=10)
    err = response_cls.FromString(raw).error
    assert err.reason == "MALFORMED_REQUEST"
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert err.request_id  # the server assigned one
    assert err.metadata["messageType"] == SERVICE.methods_by_name[method].input_type.full_name
    assert err.metadata["sizeBytes"] == str(len(GARBAGE))
    transfer = method in ("Store", "Retrieve")
    assert err.transfer_state == (NOT_STARTED if transfer else NO_TRANSFER)
    exc = from_remote_error(err)
    assert isinstance(exc, MalformedRequest) and isinstance(exc, InvalidRequest)


def test_a_flood_of_unparsable_requests_logs_a_few_lines(
    server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.address) as ch:
        store = _raw_call(ch, SERVICE.full_name, "Store")
        check = _raw_call(ch, "grpc.health.v1.Health", "Check")
        caplog.clear()
        for _ in range(200):
            err = pb.StoreResponse.FromString(store(GARBAGE, timeout=10)).error
            assert err.reason == "MALFORMED_REQUEST"
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as ei:
                check(GARBAGE, timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records]
        assert len(lines) <= 3, lines
        assert not any(r.exc_info for r in caplog.records)
        # the channel and the server are fine
        good = pb.LookupRequest(namespace="ns", keys=[b"k"])
        raw = _raw_call(ch, SERVICE.full_name, "Lookup")(good.SerializeToString(), timeout=10)
        assert pb.LookupResponse.FromString(raw).result.hit_chunks == 0
    assert health_status(server.address) == SERVING


# --- defect 11b: a CUDA handle on a server without CUDA ---
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
@pytest.mark.parametrize("size", [0, 1 << 20])
def test_cuda_handle_on_a_cpu_server_says_so_at_once(client: KVCacheClient, size: int) -> None:
    handle = pb.MemoryHandle(
        cuda_ipc=pb.CudaIpcHandle(
            device_uuid="GPU-00000000-0000-0000-0000-000000000000",
            ipc_handle=b"\x01" * 64,
            storage_size_bytes=size,
        )
    )
    tensor = pb.KVTensor(
        name="layer.0",
        shape=[2, 4, 16],
        strides=[64, 16, 1],
        dtype=pb.DTYPE_BFLOAT16,
        block_dim=1,
        handle=handle,
    )
    rank = pb.RankRegion(context=rank_context(tp_rank=1, tp_size=2), tensors=[tensor])
    started = time.monotonic()
    with pytest.raises(CudaUnavailable) as ei:
        client.map("ns", [rank], timeout=30)
    # fails fast: not retried until the 30 s deadline (large margin for a busy host)
    assert time.monotonic() - started < 15
    exc = ei.value
    assert exc.reason == "CUDA_UNAVAILABLE" and exc.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no CUDA" in exc.message and "beyond the handle" not in exc.message
    assert exc.metadata["tpRank"] == "1" and exc.metadata["rankIndex"] == "0"
    assert not exc.retryable


# --- defect 11d: health on public API ---
def test_health_module_touches_no_private_attribute_of_another_object() -> None:
    """grpcio's servicer internals change between releases; our health owns its state."""
    tree = ast.parse(Path(health_module.__file__).read_text())
    private = [
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert private == []


def test_health_check_watch_and_list(server) -> None:
    with grpc.insecure_channel(server.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            assert h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == (
                SERVING
            )
        with pytest.raises(grpc.RpcError) as ei:
            h.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        unknown = h.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
        listed = h.List(health_pb2.HealthListRequest(), timeout=5).statuses
        assert {k: v.status for k, v in listed.items()} == {"": SERVING, SERVICE_NAME: SERVING}
        stream = h.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(stream).status == SERVING
        # a fatal failure, as the watchdog reports one, reaches Check and Watch
        from kvsvc.errors import FatalServerError

        server.run(_fatal(server, FatalServerError("test", reason="TEST_FATAL")))
        assert h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == (NOT_SERVING)
        assert next(stream).status == NOT_SERVING
        stream.cancel()


async def _fatal(server: ServerThread, exc: Exception) -> None:
    server.server.servicer.fatal(exc)  # type: ignore[arg-type]
