"""The Python clients (sync ``KVCacheClient`` and ``AsyncKVCacheClient``): every
exception class from a real path with its fields intact, deadline validation,
servers that never answer or die mid-copy, leases that are released only when
the server proved a copy is over, re-mapping after a restart, futures under
injected failures, and channel lifetime."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import support
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import NOT_SERVING, SERVING, health_status, wait_inflight

from kvsvc.client import DEFAULT, AsyncKVCacheClient, KVCacheClient, MappingHandle
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.errors import (
    FINISHED,
    NO_TRANSFER,
    NOT_STARTED,
    UNKNOWN,
    Cancelled,
    CapacityExhausted,
    DeadlineExceeded,
    FatalServerError,
    InvalidDeadline,
    InvalidRequest,
    KVServiceError,
    LayoutMismatch,
    MappingLost,
    Miss,
    NotFound,
    RegionUnavailable,
    RemoteHandlerError,
    ServiceNotServing,
    ServiceUnavailable,
    TransferUnprovable,
    Unimplemented,
    UnsupportedRequest,
    from_grpc_error,
    from_remote_error,
)
from kvsvc.server.data.store import INLINE_LAYOUT, meta_bytes
from kvsvc.v1 import error_pb2
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts servers or subprocesses

HEX_ID = re.compile(r"^[0-9a-f]{32}$")  # the client's request ids (kvsvc.ids)
FP = "KVSVC_FAILPOINTS"


# --- helpers ---
def make_cache(shm_dir: Path, name: str, dtype: torch.dtype = torch.bfloat16) -> SharedKVCache:
    """The shared small cache, filled with random data seeded by its name."""
    return support.make_cache(shm_dir, name, dtype, seed=sum(name.encode()))


def block_bytes(cache: SharedKVCache, block_id: int) -> list[bytes]:
    return [
        layer.select(cache.block_dim, block_id).contiguous().view(torch.uint8).numpy().tobytes()
        for layer in cache.layers
    ]


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def check_fields(
    exc: BaseException | None,
    cls: type[KVServiceError],
    *,
    code: grpc.StatusCode,
    reason: str,
    type_name: str | None = None,
    metadata: dict[str, str] | None = None,
    request_id: str | re.Pattern[str] | None = HEX_ID,
    retryable: bool = False,
    transfer_state: int = NO_TRANSFER,
    message: str | None = None,
) -> None:
    """The exact class and every field a caller reads."""
    assert type(exc) is cls, f"{type(exc).__name__} is not {cls.__name__}: {exc}"
    assert isinstance(exc, KVServiceError)
    assert exc.code == code
    assert exc.reason == reason
    assert exc.type == (type_name or cls.__name__)
    assert isinstance(exc.message, str) and exc.message
    if message is not None:
        assert message in exc.message, exc.message
    assert exc.message in str(exc) and reason in str(exc)
    assert isinstance(exc.metadata, dict)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in exc.metadata.items())
    for k, v in (metadata or {}).items():
        assert exc.metadata.get(k) == v, (k, exc.metadata)
    if isinstance(request_id, re.Pattern):
        assert request_id.match(exc.request_id), exc.request_id
    elif request_id is not None:
        assert exc.request_id == request_id
    assert exc.retryable is retryable
    assert exc.transfer_state == transfer_state


def wait_ready(c: KVCacheClient, limit: float = 20) -> pb.GetServerInfoResult:
    """GetServerInfo until the channel has reconnected (ServiceUnavailable is retryable)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            return c.server_info(timeout=2)
        except ServiceUnavailable as exc:
            assert exc.retryable
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def wait_ready_async(c: AsyncKVCacheClient, limit: float = 20) -> pb.GetServerInfoResult:
    deadline = time.monotonic() + limit
    while True:
        try:
            return await c.server_info(timeout=2)
        except ServiceUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def raw_stub(address: str) -> tuple[grpc.Channel, pb_grpc.KVCacheServiceStub]:
    ch = grpc.insecure_channel(address)
    return ch, pb_grpc.KVCacheServiceStub(ch)


# --- every exception class from a real path ---
def test_invalid_request_from_the_server(client: KVCacheClient) -> None:
    with pytest.raises(InvalidRequest) as ei:
        client.put("", [(b"k", b"v")])
    check_fields(
        ei.value,
        InvalidRequest,
        code=grpc.StatusCode.INVALID_ARGUMENT,
        reason="INVALID_ARGUMENT",
        metadata={"field": "namespace"},
        transfer_state=NOT_STARTED,
        message="namespace is required",
    )


def test_unsupported_request_newer_envelope(server) -> None:
    ch, s = raw_stub(server.address)
    with ch:
        header = pb.RequestHeader(envelope_version=2, request_id="req-envelope-2")
        r = s.GetServerInfo(pb.GetServerInfoRequest(header=header), timeout=5)
        assert r.WhichOneof("outcome") == "error"
        exc = from_remote_error(r.error)
        check_fields(
            exc,
            UnsupportedRequest,
            code=grpc.StatusCode.INVALID_ARGUMENT,
            reason="UNSUPPORTED_ENVELOPE_VERSION",
            metadata={"envelopeVersion": "2", "supported": "1"},
            request_id="req-envelope-2",
            message="envelope version 2",
        )
        assert isinstance(exc, InvalidRequest)
        # a transfer RPC with the same envelope: refused before any copy
        r = s.Store(
            pb.StoreRequest(
                header=pb.RequestHeader(envelope_version=2, request_id="req-store-2"),
                inline=pb.InlineChunks(
                    namespace="ns", chunks=[pb.InlineChunk(key=b"k", data=b"v")]
                ),
            ),
            timeout=5,
        )
        exc = from_remote_error(r.error)
        check_fields(
            exc,
            UnsupportedRequest,
            code=grpc.StatusCode.INVALID_ARGUMENT,
            reason="UNSUPPORTED_ENVELOPE_VERSION",
            request_id="req-store-2",
            transfer_state=NOT_STARTED,
        )
        # an unset oneof through the same path
        r = s.Store(pb.StoreRequest(header=pb.RequestHeader(request_id="req-empty")), timeout=5)
        check_fields(
            from_remote_error(r.error),
            UnsupportedRequest,
            code=grpc.StatusCode.INVALID_ARGUMENT,
            reason="UNSUPPORTED_REQUEST",
            metadata={"field": "source"},
            request_id="req-empty",
            transfer_state=NOT_STARTED,
        )


def test_layout_mismatch(client: KVCacheClient, shm_dir: Path) -> None:
    cache = make_cache(shm_dir, "bf", torch.bfloat16)
    m = client.map("ns", [cache.rank_region()])
    client.store(m, [(b"k", [0, 1])])
    with pytest.raises(LayoutMismatch) as ei:
        client.retrieve(m, [(b"k", [5])])  # the chunk holds 2 blocks
    check_fields(
        ei.value,
        LayoutMismatch,
        code=grpc.StatusCode.FAILED_PRECONDITION,
        reason="BLOCK_COUNT_MISMATCH",
        metadata={"chunkIndex": "0", "listedBlocks": "1"},
        transfer_state=NOT_STARTED,
    )
    assert client.leased_blocks(m) == set()


def test_mapping_lost_and_not_found(server, client: KVCacheClient, shm_dir: Path) -> None:
    cache = make_cache(shm_dir, "gone")
    m = client.map("ns", [cache.rank_region()])
    client.unmap(m)
    with pytest.raises(MappingLost) as ei:
        client.store(m, [(b"k", [0, 1])])
    check_fields(
        ei.value,
        MappingLost,
        code=grpc.StatusCode.NOT_FOUND,
        reason="MAPPING_NOT_FOUND",
        metadata={"mappingId": m.mapping_id, "serverStartId": server.server.servicer.start_id},
        transfer_state=NOT_STARTED,
    )
    assert isinstance(ei.value, NotFound)
    assert client.leased_blocks(m) == set()  # NOT_STARTED: released at once
    with pytest.raises(MappingLost):
        client.fence(m)
    # plain NotFound: a real NOT_FOUND status from the same server (health, unknown service)
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as ri:
        health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5
        )
    exc = from_grpc_error(ri.value, request_id="rid-nf")
    check_fields(
        exc,
        NotFound,
        code=grpc.StatusCode.NOT_FOUND,
        reason="TRANSPORT_NOT_FOUND",
        metadata={"grpcCode": "NOT_FOUND"},
        request_id="rid-nf",
    )


def test_miss_from_get_of_an_absent_key(client: KVCacheClient) -> None:
    client.put("ns", [(b"present", b"v")])
    assert client.get("ns", b"present") == b"v"
    with pytest.raises(Miss) as ei:
        client.get("ns", b"absent")
    check_fields(
        ei.value,
        Miss,
        code=grpc.StatusCode.NOT_FOUND,
        reason="CHUNK_NOT_FOUND",
        metadata={"key": b"absent".hex(), "namespace": "ns"},
        request_id=None,  # see test_miss_carries_the_request_id_of_its_retrieve
    )
    assert isinstance(ei.value, NotFound)


def test_miss_carries_the_request_id_of_its_retrieve(client: KVCacheClient) -> None:
    with pytest.raises(Miss) as ei:
        client.get("ns", b"absent")
    assert HEX_ID.match(ei.value.request_id)


def test_capacity_exhausted_for_a_chunk_larger_than_the_store(make_server) -> None:
    srv = make_server(store_bytes=1 << 20)
    with KVCacheClient(srv.address) as c:
        with pytest.raises(CapacityExhausted) as ei:
            c.put("ns", [(b"huge", b"x" * (2 << 20))])
        check_fields(
            ei.value,
            CapacityExhausted,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            reason="REQUEST_EXCEEDS_CAPACITY",
            transfer_state=NOT_STARTED,
        )
        # Judged from the message's size before it is parsed (kvsvc.server.data.budget).
        assert ei.value.metadata["capacityBytes"] == str(1 << 20)
        assert 2 << 20 < int(ei.value.metadata["requestBytes"]) < (2 << 20) + 4096
        assert c.server_info().used_bytes == 0  # nothing was reserved
        # Below the size judged unparsed, the store's own check (keys and metadata count).
        with pytest.raises(CapacityExhausted) as ei:
            c.put("ns", [(b"big", b"x" * ((1 << 20) - 100))])
        assert ei.value.reason == "REQUEST_EXCEEDS_CAPACITY"
        need = (1 << 20) + meta_bytes("ns", b"big", (1 << 20) - 100)  # 4 KiB-aligned bytes
        assert ei.value.metadata["requestBytes"] == str(need)


def test_unimplemented_method(server) -> None:
    with grpc.insecure_channel(server.address) as ch:
        nope = ch.unary_unary("/kvsvc.v1.KVCacheService/Nope")
        with pytest.raises(grpc.RpcError) as ri:
            nope(b"", timeout=5)
    assert ri.value.code() == grpc.StatusCode.UNIMPLEMENTED
    check_fields(
        from_grpc_error(ri.value, request_id="rid-nope"),
        Unimplemented,
        code=grpc.StatusCode.UNIMPLEMENTED,
        reason="TRANSPORT_UNIMPLEMENTED",
        metadata={"grpcCode": "UNIMPLEMENTED"},
        request_id="rid-nope",
    )
    # a transfer the server has no method for never ran: not unprovable
    check_fields(
        from_grpc_error(ri.value, request_id="rid-nope", transfer_started=True),
        Unimplemented,
        code=grpc.StatusCode.UNIMPLEMENTED,
        reason="TRANSPORT_UNIMPLEMENTED",
        request_id="rid-nope",
    )


def test_service_unavailable_when_nothing_listens() -> None:
    c = KVCacheClient(f"127.0.0.1:{free_port()}")
    with c:
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable) as ei:
            c.lookup([b"k"], namespace="ns", timeout=5)
        assert time.monotonic() - t0 < 4  # refused, not waited out
        check_fields(
            ei.value,
            ServiceUnavailable,
            code=grpc.StatusCode.UNAVAILABLE,
            reason="TRANSPORT_UNAVAILABLE",
            metadata={"grpcCode": "UNAVAILABLE"},
            retryable=True,
        )
        assert isinstance(ei.value.__cause__, grpc.RpcError)
        # a transfer that never left the client: NOT_STARTED, its blocks are free again
        m = MappingHandle("m-1", "ns", "start", 12, 1536, "fp")
        with pytest.raises(ServiceUnavailable) as ei:
            c.store(m, [(b"k", [0, 1])], timeout=5)
        assert ei.value.transfer_state == NOT_STARTED and ei.value.retryable
        assert c.leased_blocks(m) == set() and c.leases.transfers(m.lease_key) == []
        # futures complete too
        futs = [c.store_async(m, [(b"k%d" % i, [i % 12])], timeout=5) for i in range(50)]
        done, pending = concurrent.futures.wait(futs, timeout=10)
        assert not pending
        assert all(isinstance(f.exception(), ServiceUnavailable) for f in done)
        assert c.leased_blocks(m) == set()


def test_service_not_serving_after_a_fatal_failure(spawn, shm_dir: Path) -> None:
    srv = spawn(env={FP: "transfer.before_copy=raise"})
    cache = make_cache(shm_dir, "fatal")
    with KVCacheClient(srv.address) as c:
        m = c.map("ns", [cache.rank_region()])
        with pytest.raises(FatalServerError) as ei:
            c.store(m, [(b"k", [0, 1])])
        check_fields(
            ei.value,
            FatalServerError,
            code=grpc.StatusCode.INTERNAL,
            reason="TRANSFER_WORKER_FAILED",
            metadata={"error": "FailpointError"},
            transfer_state=FINISHED,
            message="failpoint transfer.before_copy fired",
        )
        assert ei.value.metadata["transferId"] == ei.value.request_id
        assert isinstance(ei.value, RemoteHandlerError)
        assert c.leased_blocks(m) == set()  # FINISHED: proven over
        assert health_status(srv.address) == NOT_SERVING

        with pytest.raises(ServiceNotServing) as ei:
            c.store(m, [(b"k2", [2])])
        check_fields(
            ei.value,
            ServiceNotServing,
            code=grpc.StatusCode.UNAVAILABLE,
            reason="SERVICE_NOT_SERVING",
            metadata={"failureReason": "TRANSFER_WORKER_FAILED"},
            transfer_state=NOT_STARTED,
        )
        assert c.leased_blocks(m) == set()
        with pytest.raises(ServiceNotServing):
            c.put("ns", [(b"k3", b"v")])
        assert c.lookup([b"k"], mapping=m) == 0  # control RPCs still answer


def test_region_unavailable_after_truncation(server, client: KVCacheClient, shm_dir) -> None:
    cache = make_cache(shm_dir, "trunc")
    m = client.map("ns", [cache.rank_region()])
    os.truncate(cache.path, 0)
    with pytest.raises(RegionUnavailable) as ei:
        client.store(m, [(b"k", [3, 4])])
    check_fields(
        ei.value,
        RegionUnavailable,
        code=grpc.StatusCode.FAILED_PRECONDITION,
        reason="REGION_TRUNCATED",
        metadata={"name": "trunc"},
        transfer_state=FINISHED,
    )
    assert client.leased_blocks(m) == set()
    assert health_status(server.address) == SERVING


def test_remote_handler_error(spawn) -> None:
    srv = spawn(env={FP: "handler.enter=Lookup@raise"})
    with KVCacheClient(srv.address) as c:
        with pytest.raises(RemoteHandlerError) as ei:
            c.lookup([b"k"], namespace="ns")
        check_fields(
            ei.value,
            RemoteHandlerError,
            code=grpc.StatusCode.INTERNAL,
            reason="HANDLER_FAILED",
            type_name="FailpointError",
            message="failpoint handler.enter fired",
        )
        assert "Traceback" not in ei.value.message
        assert c.server_info().serving  # not fatal
    deadline = time.monotonic() + 5
    while ei.value.request_id not in srv.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ei.value.request_id in srv.output()  # the traceback is found by the id


def test_a_corrupted_chunk_is_a_miss_and_dropped_not_fatal(server, client: KVCacheClient) -> None:
    data = os.urandom(10_000)
    client.put("ns", [(b"j", b"fine"), (b"k", data)])
    store = server.server.servicer.store
    chunk = store.get("ns", b"k", INLINE_LAYOUT)
    assert chunk is not None
    store.view[chunk.offset + 1234] ^= 0xFF
    assert client.get_many("ns", [b"j", b"k"]) == [b"fine"]  # the prefix ends before it
    with pytest.raises(NotFound):
        client.get("ns", b"k")  # dropped: a miss from now on
    assert store.checksum_failures == 1
    assert health_status(server.address) == SERVING and client.server_info().serving
    client.put("ns", [(b"k", data)])
    assert client.get("ns", b"k") == data


def test_unknown_reason_and_code_from_a_newer_server() -> None:
    env = error_pb2.RemoteError(
        envelope_version=1,
        type="SomethingNewError",
        message="a failure this client has never heard of",
        code=99,  # type: ignore[arg-type]
        reason="SOMETHING_NEW",
        metadata={"newField": "x"},
        request_id="rid-new",
        retryable=True,
        transfer_state=NOT_STARTED,
    )
    exc = from_remote_error(env)
    assert isinstance(exc, KVServiceError)
    assert exc.type == "SomethingNewError" and exc.reason == "SOMETHING_NEW"
    assert exc.message == "a failure this client has never heard of"
    assert isinstance(exc.code, grpc.StatusCode)
    assert exc.metadata == {"newField": "x"} and exc.request_id == "rid-new"
    assert exc.retryable is True and exc.transfer_state == NOT_STARTED
    assert "SOMETHING_NEW" in str(exc) and "rid-new" in str(exc)
    # an unknown transfer state is readable too, and never treated as "done"
    env.transfer_state = 7  # type: ignore[assignment]
    exc = from_remote_error(env)
    assert isinstance(exc, KVServiceError) and exc.transfer_state == 7
    assert exc.transfer_state not in (NOT_STARTED, FINISHED)


# --- Cancelled and DeadlineExceeded ---
def test_cancelled_by_closing_the_channel_and_by_a_cancelled_future(spawn) -> None:
    # the reply comes after 10 s: the close below wins by seconds
    srv = spawn(env={FP: "handler.enter=Lookup@sleep(10000)"})
    c = KVCacheClient(srv.address)
    c.server_info()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        f = pool.submit(c.lookup, [b"k"], namespace="ns", timeout=30)
        time.sleep(1)  # the call is sent
        t0 = time.monotonic()
        c.close()  # in-flight calls are cancelled with the channel
        exc = f.exception(timeout=5)
    assert time.monotonic() - t0 < 5
    check_fields(
        exc,
        Cancelled,
        code=grpc.StatusCode.CANCELLED,
        reason="TRANSPORT_CANCELLED",
        metadata={"grpcCode": "CANCELLED"},
    )
    assert isinstance(exc.__cause__, grpc.RpcError)
    # a gRPC future cancelled by the application
    ch, s = raw_stub(srv.address)
    with ch:
        call = s.Lookup.future(pb.LookupRequest(namespace="ns", keys=[b"k"]), timeout=10)
        time.sleep(0.1)
        assert call.cancel()
        check_fields(
            from_grpc_error(call, request_id="rid-c"),
            Cancelled,
            code=grpc.StatusCode.CANCELLED,
            reason="TRANSPORT_CANCELLED",
            request_id="rid-c",
        )


async def test_async_call_cut_by_close_raises_cancelled(spawn) -> None:
    srv = spawn(env={FP: "handler.enter=Lookup@sleep(10000)"})  # the close wins by seconds
    ac = AsyncKVCacheClient(srv.address)
    await ac.server_info()
    task = asyncio.ensure_future(ac.lookup([b"k"], namespace="ns", timeout=30))
    await asyncio.sleep(0.3)
    await ac.close()
    try:
        await asyncio.wait_for(asyncio.shield(task), 5)
    except asyncio.CancelledError:
        pytest.fail("a task nobody cancelled raised CancelledError")
    except Cancelled as exc:
        assert exc.code == grpc.StatusCode.CANCELLED
    else:
        pytest.fail("no error")


async def test_async_task_cancel_keeps_the_lease_until_fenced(spawn, shm_dir: Path) -> None:
    srv = spawn(env={FP: "transfer.copy=sleep(4000)"})
    cache = make_cache(shm_dir, "acancel")
    async with AsyncKVCacheClient(srv.address) as ac:
        m = await ac.map("ns", [cache.rank_region()])
        task = ac.store_async(m, [(b"a", [0]), (b"b", [1])])
        end = time.monotonic() + 30  # cancelled while the copy runs (4 s), not before
        while (await ac.server_info(timeout=5)).inflight_transfers < 1:
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the copy may still run: blocks stay leased and the transfer is unprovable
        assert ac.leased_blocks(m) == {0, 1}
        assert len(ac.unproven_transfers(m)) == 1
        r = await ac.fence(m, timeout=10)
        # Waited for, or (on a loaded machine) already ended: known either way.
        assert r.waited_transfers <= 1 and r.barred_transfers == 0
        assert ac.leased_blocks(m) == set() and ac.unproven_transfers(m) == []
        assert await ac.lookup([b"a", b"b"], mapping=m) == 2


# --- deadline validation ---
BAD_DEADLINES = [math.nan, math.inf, -math.inf, -1, 0, True, False, "5", None]
VALID_DEADLINES = [0.5, 3]


@pytest.mark.parametrize("value", BAD_DEADLINES, ids=repr)
@pytest.mark.parametrize("setting", ["transfer_timeout", "control_timeout"])
def test_constructor_rejects_bad_deadlines(setting: str, value: object) -> None:
    target = f"127.0.0.1:{free_port()}"
    with pytest.raises(InvalidDeadline, match=rf"^{setting} must be"):
        KVCacheClient(target, **{setting: value})
    with pytest.raises(InvalidDeadline, match=rf"^{setting} must be"):
        AsyncKVCacheClient(target, **{setting: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, 0, -1.5, "5"], ids=repr)
def test_a_bad_deadline_is_a_kvsvc_error_and_still_a_value_error(value: object) -> None:
    """One hierarchy: `except KVServiceError` catches it, `except ValueError` still does."""
    with KVCacheClient(f"127.0.0.1:{free_port()}") as c, pytest.raises(KVServiceError) as ei:
        c.lookup([b"k"], namespace="ns", timeout=value)  # type: ignore[arg-type]
    exc = ei.value
    assert isinstance(exc, InvalidDeadline) and isinstance(exc, InvalidRequest)
    assert isinstance(exc, ValueError)
    assert exc.reason == "INVALID_DEADLINE" and exc.code == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.metadata == {"setting": "timeout", "value": repr(value)}
    assert not exc.retryable and exc.transfer_state == NO_TRANSFER


def _sync_calls(c: KVCacheClient, m: MappingHandle) -> dict[str, Callable[[Any], Any]]:
    chunks = [(b"k", [0, 1])]
    return {
        "map": lambda t: c.map("ns", m.ranks, timeout=t),
        "unmap": lambda t: c.unmap(m, timeout=t),
        "store": lambda t: c.store(m, chunks, timeout=t),
        "retrieve": lambda t: c.retrieve(m, chunks, timeout=t),
        "store_async": lambda t: c.store_async(m, chunks, timeout=t),
        "retrieve_async": lambda t: c.retrieve_async(m, chunks, timeout=t),
        "lookup": lambda t: c.lookup([b"k"], namespace="ns", timeout=t),
        "fence": lambda t: c.fence(m, timeout=t),
        "server_info": lambda t: c.server_info(timeout=t),
        "put": lambda t: c.put("ns", [(b"k", b"v")], timeout=t),
        "get_many": lambda t: c.get_many("ns", [b"k"], timeout=t),
        "get": lambda t: c.get("ns", b"k", timeout=t),
    }


@pytest.mark.parametrize("value", BAD_DEADLINES, ids=repr)
def test_per_call_timeout_rejects_bad_deadlines(value: object) -> None:
    m = MappingHandle("m-1", "ns", "start", 12, 1536, "fp")
    with KVCacheClient(f"127.0.0.1:{free_port()}") as c:
        for name, call in _sync_calls(c, m).items():
            with pytest.raises(InvalidDeadline, match=r"^timeout must be"):
                call(value)
            assert c.leased_blocks(m) == set(), name  # refused before anything was leased


async def test_async_per_call_timeout_rejects_bad_deadlines() -> None:
    m = MappingHandle("m-1", "ns", "start", 12, 1536, "fp")
    chunks = [(b"k", [0, 1])]
    async with AsyncKVCacheClient(f"127.0.0.1:{free_port()}") as c:
        calls: dict[str, Callable[[Any], Any]] = {
            "map": lambda t: c.map("ns", [], timeout=t),
            "unmap": lambda t: c.unmap(m, timeout=t),
            "store": lambda t: c.store(m, chunks, timeout=t),
            "retrieve": lambda t: c.retrieve(m, chunks, timeout=t),
            "lookup": lambda t: c.lookup([b"k"], namespace="ns", timeout=t),
            "fence": lambda t: c.fence(m, timeout=t),
            "server_info": lambda t: c.server_info(timeout=t),
            "put": lambda t: c.put("ns", [(b"k", b"v")], timeout=t),
            "get_many": lambda t: c.get_many("ns", [b"k"], timeout=t),
            "get": lambda t: c.get("ns", b"k", timeout=t),
        }
        for value in BAD_DEADLINES:
            for name, call in calls.items():
                with pytest.raises(InvalidDeadline, match=r"^timeout must be"):
                    await call(value)
                assert c.leased_blocks(m) == set(), (name, value)
            for call_async in (c.store_async, c.retrieve_async):
                with pytest.raises(InvalidDeadline, match=r"^timeout must be"):
                    call_async(m, chunks, timeout=value)
            assert c.leased_blocks(m) == set(), value
        # nothing listens there: a valid call fails fast and retryably
        with pytest.raises(ServiceUnavailable) as ei:
            await asyncio.wait_for(c.lookup([b"k"], namespace="ns", timeout=5), 5)
        assert ei.value.retryable and isinstance(ei.value.__cause__, grpc.RpcError)


@pytest.mark.parametrize("value", VALID_DEADLINES)
def test_valid_deadlines_are_accepted(client: KVCacheClient, value: float) -> None:
    with KVCacheClient(client.target, transfer_timeout=value, control_timeout=value) as c:
        assert c.transfer_timeout == float(value) and c.control_timeout == float(value)
        assert c.server_info(timeout=value).serving
        assert c.put("ns", [(b"k", b"v")], timeout=value).stored_chunks in (0, 1)
        assert c.lookup([b"k"], namespace="ns", timeout=value) == 1
        assert c.get("ns", b"k", timeout=DEFAULT) == b"v"


def test_a_huge_finite_deadline_is_rejected_or_works(client: KVCacheClient) -> None:
    for value in (1e10, 1e300):
        try:
            assert client.lookup([b"k"], namespace="ns", timeout=value) == 0
        except ValueError as exc:
            assert str(exc).startswith("timeout")
        try:
            with KVCacheClient(client.target, control_timeout=value) as c:
                assert c.lookup([b"k"], namespace="ns") == 0
        except ValueError as exc:
            assert str(exc).startswith("control_timeout")


def test_default_deadline_is_the_configured_one(spawn) -> None:
    srv = spawn(env={FP: "handler.enter=Lookup@sleep(10000)"})  # outlasts 0.3 s by seconds
    with KVCacheClient(srv.address, control_timeout=0.3) as c:
        c.server_info()  # connected: the timing below is the deadline alone
        for kwargs in ({}, {"timeout": DEFAULT}):
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded) as ei:
                c.lookup([b"k"], namespace="ns", **kwargs)
            assert time.monotonic() - t0 < 0.3 + 3
            check_fields(
                ei.value,
                DeadlineExceeded,
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
                reason="TRANSPORT_DEADLINE_EXCEEDED",
                metadata={"grpcCode": "DEADLINE_EXCEEDED"},
            )
            assert isinstance(ei.value.__cause__, grpc.RpcError)


# --- a server that accepts the call and never answers ---
def test_hung_request_ends_at_its_deadline_and_others_still_run(spawn) -> None:
    srv = spawn(env={FP: "handler.enter=Lookup@hang"})
    with KVCacheClient(srv.address) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.lookup([b"k"], namespace="ns", timeout=0.5)
        assert time.monotonic() - t0 < 0.5 + 3
        assert c.server_info(timeout=2).serving  # only that request hangs


def test_hung_server_sync_call_ends_at_its_deadline(spawn, shm_dir: Path) -> None:
    srv = spawn(env={FP: "loop.stall=Lookup@hang"})
    cache = make_cache(shm_dir, "hung")
    with KVCacheClient(srv.address) as c:
        m = c.map("ns", [cache.rank_region()])
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.lookup([b"k"], namespace="ns", timeout=0.5)
        assert time.monotonic() - t0 < 0.5 + 3
        # the server's loop is now stuck: every call still ends at its deadline
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.server_info(timeout=0.5)
        assert time.monotonic() - t0 < 0.5 + 3
        t0 = time.monotonic()
        with pytest.raises(TransferUnprovable) as ei:
            c.store(m, [(b"k", [0, 1])], timeout=0.5)
        assert time.monotonic() - t0 < 0.5 + 3
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert c.leased_blocks(m) == {0, 1}  # nothing proved the store never ran
        fut = c.store_async(m, [(b"k2", [2])], timeout=0.5)
        assert isinstance(fut.exception(timeout=0.5 + 3), TransferUnprovable)


async def test_hung_server_async_call_ends_at_its_deadline(spawn) -> None:
    srv = spawn(env={FP: "loop.stall=Lookup@hang"})
    async with AsyncKVCacheClient(srv.address) as ac:
        await ac.server_info()
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as ei:
            await asyncio.wait_for(ac.lookup([b"k"], namespace="ns", timeout=0.5), 5)
        assert time.monotonic() - t0 < 0.5 + 3
        assert isinstance(ei.value.__cause__, grpc.RpcError)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(ac.server_info(timeout=0.5), 5)
        assert time.monotonic() - t0 < 0.5 + 3


# --- leases across server death, slow copies and restarts ---
def test_server_killed_during_retrieve_keeps_blocks_leased(spawn, shm_dir: Path) -> None:
    srv = spawn(env={FP: "transfer.copy=sleep(3000)"})
    port = port_of(srv.address)
    cache = make_cache(shm_dir, "killed")
    with KVCacheClient(srv.address) as c:
        m = c.map("ns", [cache.rank_region()])
        for key, block in ((b"a", 0), (b"b", 1), (b"c", 2)):  # one chunk per store: no sleep
            c.store(m, [(key, [block])])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            f = pool.submit(c.retrieve, m, [(b"a", [5]), (b"b", [6]), (b"c", [7])], timeout=10)
            wait_inflight(srv.address, 1)  # the copy runs (3 s)
            assert not f.done()
            srv.signal(signal.SIGKILL)
            srv.wait(10)
            exc = f.exception(timeout=5)
        assert isinstance(exc, TransferUnprovable), exc
        assert exc.transfer_state == UNKNOWN and exc.code == grpc.StatusCode.UNAVAILABLE
        assert c.unproven_transfers(m) == [exc.request_id]
        assert c.leased_blocks(m) == {5, 6, 7}
        # nobody answers: still leased
        with pytest.raises(ServiceUnavailable):
            c.fence(m, timeout=2)
        assert c.leased_blocks(m) == {5, 6, 7}

        restarted = spawn(port=port)
        assert restarted.address == srv.address
        info = wait_ready(c)
        assert info.server_start_id != m.server_start_id
        with pytest.raises(MappingLost) as ei:
            c.fence(m, timeout=5)
        assert ei.value.metadata["serverStartId"] == info.server_start_id
        assert c.leased_blocks(m) == {5, 6, 7}  # not a false release
        assert c.unproven_transfers(m) == [exc.request_id]


def test_remap_after_a_kill_keeps_the_unprovable_lease(spawn, shm_dir: Path) -> None:
    srv = spawn(env={FP: "transfer.copy=sleep(3000)"})
    port = port_of(srv.address)
    cache = make_cache(shm_dir, "killremap")
    with KVCacheClient(srv.address, remap_on_restart=True) as c:
        m = c.map("ns", [cache.rank_region()])
        c.store(m, [(b"a", [0])])
        c.store(m, [(b"b", [1])])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            f = pool.submit(c.retrieve, m, [(b"a", [5]), (b"b", [6])], timeout=10)
            wait_inflight(srv.address, 1)  # the copy runs (3 s)
            srv.signal(signal.SIGKILL)
            srv.wait(10)
            exc = f.exception(timeout=5)
        assert isinstance(exc, TransferUnprovable), exc
        assert c.leased_blocks(m) == {5, 6}
        spawn(port=port)
        wait_ready(c)
        assert c.store(m, [(b"new", [0])]).stored_chunks == 1  # re-mapped transparently
        assert {5, 6} <= c.leased_blocks(m)  # still not proven free


@pytest.mark.parametrize("how", ["sync", "future"])
def test_slow_copy_past_the_deadline_then_fence_releases(spawn, shm_dir: Path, how: str) -> None:
    # the copy starts well within the deadline and outlasts it by seconds
    srv = spawn(env={FP: "transfer.copy=sleep(5000)"})
    cache = make_cache(shm_dir, "slow")
    with KVCacheClient(srv.address, transfer_timeout=1.5) as c:
        m = c.map("ns", [cache.rank_region()])
        c.store(m, [(b"a", [0])])
        c.store(m, [(b"b", [1])])
        targets = [(b"a", [4]), (b"b", [5])]
        t0 = time.monotonic()
        if how == "sync":
            with pytest.raises(TransferUnprovable) as ei:
                c.retrieve(m, targets)  # DEFAULT: the configured 1.5 s transfer deadline
            exc = ei.value
        else:
            exc = c.retrieve_async(m, targets).exception(timeout=10)
        assert time.monotonic() - t0 < 1.5 + 3  # at the deadline, not when the copy ends
        check_fields(
            exc,
            TransferUnprovable,
            code=grpc.StatusCode.DEADLINE_EXCEEDED,
            reason="TRANSFER_UNPROVABLE",
            metadata={"grpcCode": "DEADLINE_EXCEEDED"},
            transfer_state=UNKNOWN,
        )
        assert isinstance(exc.__cause__, grpc.RpcError)
        assert c.leased_blocks(m) == {4, 5}
        assert c.unproven_transfers(m) == [exc.request_id]
        r = c.fence(m, timeout=10)
        assert r.waited_transfers == 1
        assert c.leased_blocks(m) == set() and c.unproven_transfers(m) == []
        # the copy did finish: the blocks hold the chunks
        assert block_bytes(cache, 4) == block_bytes(cache, 0)
        assert block_bytes(cache, 5) == block_bytes(cache, 1)


async def test_remap_on_restart(spawn, shm_dir: Path) -> None:
    srv = spawn()
    port = port_of(srv.address)
    cache = make_cache(shm_dir, "remap")
    region = cache.rank_region()
    with (
        KVCacheClient(srv.address, remap_on_restart=True) as remapping,
        KVCacheClient(srv.address, remap_on_restart=False) as plain,
    ):
        async with AsyncKVCacheClient(srv.address, remap_on_restart=True) as ac:
            m_sync = remapping.map("ns", [region])
            m_plain = plain.map("ns", [region])
            m_async = await ac.map("ns", [region])
            assert m_sync.mapping_id == m_plain.mapping_id == m_async.mapping_id
            remapping.store(m_sync, [(b"before", [0])])
            old_id, old_start = m_sync.mapping_id, m_sync.server_start_id

            srv.signal(signal.SIGKILL)
            srv.wait(10)
            restarted = spawn(port=port)
            assert restarted.address == srv.address
            new_start = wait_ready(remapping).server_start_id
            wait_ready(plain)
            await wait_ready_async(ac)
            assert new_start != old_start

            r = remapping.store(m_sync, [(b"after-sync", [1])])
            assert r.stored_chunks == 1 and r.server_start_id == new_start
            assert m_sync.server_start_id == new_start and m_sync.mapping_id != old_id
            assert remapping.leased_blocks(m_sync) == set()
            assert remapping.lookup([b"after-sync"], mapping=m_sync) == 1
            assert remapping.lookup([b"before"], mapping=m_sync) == 0  # the old store is gone

            r = await ac.store(m_async, [(b"after-async", [2])])
            assert r.stored_chunks == 1 and m_async.server_start_id == new_start
            assert m_async.mapping_id == m_sync.mapping_id  # Map is idempotent
            assert ac.leased_blocks(m_async) == set()

            with pytest.raises(MappingLost) as ei:
                plain.store(m_plain, [(b"after-plain", [3])])
            assert ei.value.transfer_state == NOT_STARTED
            assert m_plain.mapping_id == old_id and m_plain.server_start_id == old_start
            assert plain.leased_blocks(m_plain) == set()


# --- futures under injected failures ---
def test_thousand_store_futures_with_injected_failures(spawn, shm_dir: Path) -> None:
    srv = spawn(env={FP: "handler.enter=Store@0.05*raise"})
    src, dst = make_cache(shm_dir, "fsrc"), make_cache(shm_dir, "fdst")
    with KVCacheClient(srv.address) as c:
        m, m_dst = c.map("ns", [src.rank_region()]), c.map("ns", [dst.rank_region()])
        keys = [b"key-%04d" % i for i in range(1000)]
        t0 = time.monotonic()
        futs = [c.store_async(m, [(k, [i % 12])], timeout=30) for i, k in enumerate(keys)]
        _, pending = concurrent.futures.wait(futs, timeout=45)
        assert not pending and time.monotonic() - t0 < 45
        assert all(f.done() for f in futs)
        ok = [k for k, f in zip(keys, futs, strict=True) if f.exception() is None]
        errors = [f.exception() for f in futs if f.exception() is not None]
        assert len(ok) + len(errors) == 1000
        assert 0 < len(errors) < 150  # ~5% of 1000
        for e in errors:
            check_fields(
                e,
                RemoteHandlerError,
                code=grpc.StatusCode.INTERNAL,
                reason="HANDLER_FAILED",
                type_name="FailpointError",
                transfer_state=NOT_STARTED,
            )
        assert all(futs[keys.index(k)].result().stored_chunks == 1 for k in ok)
        assert c.leased_blocks(m) == set()
        assert c.lookup(ok, mapping=m) == len(ok)
        failed = [k for k, f in zip(keys, futs, strict=True) if f.exception() is not None]
        assert all(c.lookup([k], mapping=m) == 0 for k in failed[:10])
        # successful chunks come back bit-exact
        picks = [(k, keys.index(k) % 12) for k in ok[:6]]
        r = c.retrieve(m_dst, [(k, [i]) for i, (k, _) in enumerate(picks)])
        assert r.loaded_chunks == len(picks)
        for i, (_, b) in enumerate(picks):
            assert block_bytes(dst, i) == block_bytes(src, b)


async def test_async_store_tasks_with_injected_failures(spawn, shm_dir: Path) -> None:
    srv = spawn(env={FP: "handler.enter=Store@0.05*raise"})
    cache = make_cache(shm_dir, "asrc")
    async with AsyncKVCacheClient(srv.address) as ac:
        m = await ac.map("ns", [cache.rank_region()])
        keys = [b"akey-%03d" % i for i in range(200)]
        tasks = [ac.store_async(m, [(k, [i % 12])], timeout=30) for i, k in enumerate(keys)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 45)
        assert all(t.done() for t in tasks)
        ok = [k for k, r in zip(keys, results, strict=True) if isinstance(r, pb.StoreResult)]
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(ok) + len(errors) == 200
        assert len(errors) < 50
        for e in errors:
            check_fields(
                e,
                RemoteHandlerError,
                code=grpc.StatusCode.INTERNAL,
                reason="HANDLER_FAILED",
                type_name="FailpointError",
                transfer_state=NOT_STARTED,
            )
        assert ac.leased_blocks(m) == set()
        assert await ac.lookup(ok, mapping=m) == len(ok)


# --- channel lifetime ---
def test_context_manager_closes_the_channel(server) -> None:
    with KVCacheClient(server.address) as c:
        c.put("ns", [(b"k", b"v")])
        assert c.get("ns", b"k") == b"v"
    t0 = time.monotonic()
    with pytest.raises(Exception) as ei:  # any refusal, promptly
        c.server_info(timeout=5)
    assert time.monotonic() - t0 < 3  # not at the 5 s deadline
    assert "closed" in str(ei.value).lower()


async def test_async_client_with_async_with(server) -> None:
    async with AsyncKVCacheClient(server.address) as ac:
        await ac.put("ns", [(b"k", b"v")])
        assert await ac.get("ns", b"k") == b"v"
        assert await ac.lookup([b"k"], namespace="ns") == 1
        with pytest.raises(Miss):
            await ac.get("ns", b"absent")
    t0 = time.monotonic()
    with pytest.raises(Exception) as ei:  # any refusal, promptly
        await asyncio.wait_for(ac.server_info(timeout=5), 5)
    assert time.monotonic() - t0 < 3  # not at the 5 s deadline
    assert "closed" in str(ei.value).lower()


def test_store_on_a_closed_client_is_a_kvsvc_error_and_leases_nothing(server, shm_dir) -> None:
    cache = make_cache(shm_dir, "closed")
    with KVCacheClient(server.address) as c:
        m = c.map("ns", [cache.rank_region()])
    with pytest.raises(KVServiceError) as ei:
        c.store(m, [(b"k", [0, 1])])
    assert ei.value.transfer_state == NOT_STARTED
    assert c.leased_blocks(m) == set()


def test_threads_share_one_client(client: KVCacheClient) -> None:
    """The sync client is used from many engine threads at once."""
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            client.put("ns", [(b"t%d" % i, b"v%d" % i)])
            assert client.get("ns", b"t%d" % i) == b"v%d" % i
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors and not any(t.is_alive() for t in threads)


def test_request_ids_are_unique_in_a_process_and_across_a_fork() -> None:
    from kvsvc.ids import new_request_id

    ids = [new_request_id() for _ in range(10_000)]
    assert all(HEX_ID.match(i) for i in ids)
    assert len(set(ids)) == len(ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's ids must not repeat the parent's
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert HEX_ID.match(child)
    assert child[:16] != new_request_id()[:16]  # a fresh random prefix
