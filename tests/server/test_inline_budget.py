"""Large inline requests against a real server: one that can never fit the store is
refused from its size before it is parsed, and the bytes concurrent large requests
hold are bounded by --inline-budget-bytes (beyond it: INLINE_BUDGET_EXHAUSTED at
once, retryable), given back when the request has been answered; unary calls and
the session stream alike."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support import ServerThread

from kvsvc.client import KVCacheClient
from kvsvc.errors import CapacityExhausted, KVServiceError
from kvsvc.framing import REQUEST_BYTES
from kvsvc.limits import channel_options
from kvsvc.server.config import ServerConfig
from kvsvc.server.data import budget as budget_module
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts servers

MiB = 1 << 20
HOLD_MS = 6000  # how long the failpoint holds the first Store in its handler


@pytest.mark.parametrize("session", [False, True], ids=["unary", "session"])
def test_an_inline_store_larger_than_the_store_is_refused_unparsed(
    shm_dir: Path, session: bool
) -> None:
    config = ServerConfig.from_settings(
        listen="127.0.0.1:0", store_bytes=16 * MiB, shm_dir=str(shm_dir)
    )
    st = ServerThread(config)
    try:
        budget = st.server.servicer.budget
        with KVCacheClient(st.address, session=session) as client:
            with pytest.raises(CapacityExhausted) as ei:
                client.put("ns", [(b"big", os.urandom(24 * MiB))])
            assert ei.value.reason == "REQUEST_EXCEEDS_CAPACITY" and not ei.value.retryable
            assert "before it was parsed" in ei.value.message
            assert budget.refused == 1 and budget.held_bytes == 0
            # Many chunks that add up to more than the store: refused the same way.
            chunks = [(b"c%d" % i, os.urandom(2 * MiB)) for i in range(9)]
            with pytest.raises(CapacityExhausted) as ei:
                client.put("ns", chunks)
            assert ei.value.reason == "REQUEST_EXCEEDS_CAPACITY"
            assert st.server.servicer.store.used_bytes == 0
            # One that fits is parsed and stored; its bytes are given back once answered.
            data = os.urandom(12 * MiB)
            assert client.put("ns", [(b"fits", data)]).stored_chunks == 1
            assert client.get("ns", b"fits") == data
            assert client.server_info().serving
    finally:
        st.stop()


@pytest.mark.parametrize("session", [False, True], ids=["unary", "session"])
def test_large_requests_beyond_the_budget_are_refused_at_once(spawn, session: bool) -> None:
    """Two 6 MiB Stores at once under an 8 MiB budget: the one that comes second while
    the failpoint holds the first in its handler is refused at once; once the first
    is answered its bytes are given back and the same Store is taken."""
    srv = spawn(
        "--inline-budget-bytes",
        "8MiB",
        env={"KVSVC_FAILPOINTS": f"handler.enter=Store@sleep({HOLD_MS})"},
    )
    values = [os.urandom(6 * MiB) for _ in range(2)]
    outcomes: list[tuple[float, pb.StoreResult | KVServiceError]] = [(0.0, pb.StoreResult())] * 2
    go = threading.Barrier(2, timeout=30)

    def put(i: int) -> None:
        with KVCacheClient(srv.address, session=session) as client:
            client.lookup([b"warm"], namespace="ns")  # connected before the race
            go.wait()
            t0 = time.monotonic()
            try:
                result: pb.StoreResult | KVServiceError = client.put(
                    "ns", [(b"v%d" % i, values[i])]
                )
            except KVServiceError as exc:
                result = exc
            outcomes[i] = (time.monotonic() - t0, result)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    refused = [(s, r) for s, r in outcomes if isinstance(r, KVServiceError)]
    stored = [(s, r) for s, r in outcomes if isinstance(r, pb.StoreResult)]
    assert len(refused) == 1 and len(stored) == 1, outcomes
    (took, error), ((held, result),) = refused[0], stored
    assert isinstance(error, CapacityExhausted)
    assert error.reason == "INLINE_BUDGET_EXHAUSTED" and error.retryable
    assert result.stored_chunks == 1 and held >= HOLD_MS / 1000 * 0.9
    assert took < HOLD_MS / 1000 / 2  # at once, not after the held one
    # The first was answered: its bytes are given back, the refused Store is taken now.
    i = outcomes.index(refused[0])
    with KVCacheClient(srv.address, session=session) as client:
        assert client.put("ns", [(b"v%d" % i, values[i])]).stored_chunks == 1
        assert client.get_many("ns", [b"v0", b"v1"]) == values


def test_a_session_message_is_read_for_its_ids_without_parsing_it() -> None:
    """A refused session message is answered under each request id it carries."""
    first = pb.SessionRequest(id=7)
    first.store.inline.chunks.add(key=b"k", data=b"x" * 3000)
    first.more.add(id=9).lookup.keys.append(b"k")
    first.more.add(id=11)
    ids, largest = budget_module.session_ids(first.SerializeToString())
    assert sorted(ids) == [7, 9, 11] and largest == first.store.ByteSize()
    assert budget_module.session_ids(b"\xff\xff") == ([], 0)  # not a message: nothing read


def _vm_hwm(pid: int) -> int:
    """Peak resident bytes of process ``pid`` so far (/proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_declared_inline_store_is_refused_before_the_server_receives_it(spawn) -> None:
    """kvsvc's client sends a large inline Store unary with its size declared; the
    server refuses one that can never fit before asking gRPC for the message, so
    its bytes stay with the client (HTTP/2 flow control): the server's peak memory
    does not grow by the message (it grew by two of them, gRPC's and Python's copy,
    when the whole message was received before the size gate)."""
    srv = spawn("--store-bytes", "32MiB")
    big = b"\x01" * (160 * MiB)
    with KVCacheClient(srv.address, session=True) as client:
        client.lookup([b"warm"], namespace="ns")
        before = _vm_hwm(srv.proc.pid)
        for i in range(3):
            with pytest.raises(CapacityExhausted) as ei:
                client.put("ns", [(b"big%d" % i, big)], timeout=60)
            assert ei.value.reason == "REQUEST_EXCEEDS_CAPACITY" and not ei.value.retryable
        grew = _vm_hwm(srv.proc.pid) - before
        assert grew < 64 * MiB, f"the server's peak RSS grew by {grew >> 20} MiB"
        data = os.urandom(12 * MiB)  # a large one that fits is read, stored, given back
        assert client.put("ns", [(b"fits", data)]).stored_chunks == 1
        assert client.get("ns", b"fits") == data


def _inline_store(data: bytes) -> pb.StoreRequest:
    return pb.StoreRequest(
        header=pb.RequestHeader(envelope_version=1, request_id="r" * 32),
        inline=pb.InlineChunks(namespace="ns", chunks=[pb.InlineChunk(key=b"k", data=data)]),
    )


def test_a_declared_size_gates_before_the_bytes_and_the_real_size_still_counts(
    shm_dir: Path,
) -> None:
    """Any client may declare (kvsvc.framing.REQUEST_BYTES): a size that cannot fit is
    refused whatever follows it; one that says less than it sends is judged by what
    it sends; and the session stream's frames are still gated by their raw size."""
    config = ServerConfig.from_settings(
        listen="127.0.0.1:0", store_bytes=16 * MiB, shm_dir=str(shm_dir)
    )
    st = ServerThread(config)
    try:
        budget = st.server.servicer.budget
        with grpc.insecure_channel(st.address, options=channel_options()) as ch:
            stub = pb_grpc.KVCacheServiceStub(ch)
            small, big = _inline_store(b"s" * 1024), _inline_store(os.urandom(24 * MiB))
            declared = [(REQUEST_BYTES, str(64 * MiB))]
            r = stub.Store(small, metadata=declared, timeout=30)
            assert r.WhichOneof("outcome") == "error", r
            assert r.error.reason == "REQUEST_EXCEEDS_CAPACITY"
            r = stub.Store(big, metadata=[(REQUEST_BYTES, str(2 * MiB))], timeout=30)
            assert r.error.reason == "REQUEST_EXCEEDS_CAPACITY"
            r = stub.Store(_inline_store(os.urandom(2 * MiB)), timeout=30)  # undeclared
            assert r.result.stored_chunks == 1
            frame = pb.SessionRequest(id=7, store=big)
            (answer,) = list(stub.Session(iter([frame]), timeout=30))
            assert answer.id == 7 and answer.error.reason == "REQUEST_EXCEEDS_CAPACITY"
        assert budget.refused == 3
        with budget._lock:  # given back: swept when the next large request comes
            budget._sweep()
        assert budget.held_bytes == 0
    finally:
        st.stop()


def test_a_declared_store_that_never_sends_gives_its_budget_back(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that declares a size and sends nothing, without a deadline, holds the
    budget it reserved no longer than a held message may (HELD_MAX_S, short here):
    it is answered DEADLINE_EXCEEDED and the bytes are given back."""
    monkeypatch.setattr(budget_module, "HELD_MAX_S", 1.0)
    config = ServerConfig.from_settings(
        listen="127.0.0.1:0", store_bytes=16 * MiB, shm_dir=str(shm_dir)
    )
    st = ServerThread(config)
    release = threading.Event()

    def nothing() -> Iterator[bytes]:
        release.wait(60)  # sends no message until the test is over
        return
        yield b""

    try:
        budget = st.server.servicer.budget
        with grpc.insecure_channel(st.address, options=channel_options()) as ch:
            store = ch.stream_unary(
                "/kvsvc.v1.KVCacheService/Store",
                response_deserializer=pb.StoreResponse.FromString,
            )
            fut = store.future(nothing(), metadata=[(REQUEST_BYTES, str(4 * MiB))])
            r = fut.result(60)
            assert r.error.reason == "DEADLINE_EXCEEDED", r
            release.set()
        assert budget.held_bytes == 0
    finally:
        release.set()
        st.stop()
