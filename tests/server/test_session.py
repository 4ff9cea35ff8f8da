"""The Session stream: Lookup, Store, Retrieve and Fence multiplexed on one
bidirectional stream with per-request ids and deadlines, answered in any order,
each request handled by its unary RPC's wrapper; a broken stream ends every
pending request at once with its typed error; a server without the RPC gets the
same calls as unary ones. Real servers (in-process or `kvsvc serve`), real sockets."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time
from pathlib import Path

import grpc
import pytest
from support import ServerThread, make_cache

from kvsvc.client import AsyncKVCacheClient, KVCacheClient
from kvsvc.client.session import AsyncSession, SyncSession
from kvsvc.errors import (
    NOT_STARTED,
    DeadlineExceeded,
    InvalidRequest,
    MappingLost,
    ServiceUnavailable,
    TransferUnprovable,
)
from kvsvc.framing import SESSION_BATCH, speaks_batches
from kvsvc.server.ops.lifecycle import Server
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts servers or subprocesses
FP = "KVSVC_FAILPOINTS"


def test_calls_go_over_one_session_and_mean_what_they_mean_on_unary(client, shm_dir) -> None:
    src, dst = make_cache(shm_dir, "s", seed=1), make_cache(shm_dir, "d")
    m_src, m_dst = client.map("ns", [src.rank_region()]), client.map("ns", [dst.rank_region()])
    assert client.store(m_src, [(b"a", [0, 1]), (b"b", [2])]).stored_chunks == 2
    session = client._session
    assert isinstance(session, SyncSession) and session.failure is None
    assert client.lookup([b"a", b"b", b"c"], mapping=m_dst) == 2
    assert client.retrieve(m_dst, [(b"a", [5, 6]), (b"b", [7])]).loaded_chunks == 2
    assert dst.layers[0][:, 5:8].equal(src.layers[0][:, 0:3])
    fut = client.store_async(m_src, [(b"c", [3])])
    assert fut.result(30).stored_chunks == 1
    assert client.fence(m_src).server_start_id
    assert client._session is session  # the same stream carried every one
    # typed errors come back as on unary calls
    with pytest.raises(MappingLost):
        client.lookup([b"a"], mapping=type(m_src)(**{**m_src.__dict__, "mapping_id": "nope"}))


def test_a_future_s_callback_can_call_the_client(server, shm_dir) -> None:
    """Callbacks of futures answered over the session run off its reader thread:
    a call made there (a blocking one, or another future's result) is answered,
    not stuck until its deadline behind the callback that waits for it."""
    src = make_cache(shm_dir, "cb", seed=3)
    with KVCacheClient(server.address, control_timeout=5, transfer_timeout=5) as c:
        m = c.map("ns", [src.rank_region()])
        seen: concurrent.futures.Future[object] = concurrent.futures.Future()

        def then(_: object) -> None:
            try:
                hits = c.lookup([b"cb-a", b"cb-b"], mapping=m)
                nested = c.store_async(m, [(b"cb-b", [2])]).result(30).stored_chunks
                seen.set_result((hits, nested))
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                seen.set_result(exc)

        c.store_async(m, [(b"cb-a", [1])]).add_done_callback(then)
        assert seen.result(60) == (1, 1)
        assert c._session is not None and c._session.failure is None


def test_a_slow_request_does_not_hold_up_a_fast_one(spawn, shm_dir) -> None:
    srv = spawn(env={FP: "transfer.copy=sleep(3000)"})
    cache = make_cache(shm_dir, "slow", seed=2)
    with KVCacheClient(srv.address) as c:
        m = c.map("ns", [cache.rank_region()])
        c.store(m, [(b"k", [0])])  # one piece: the failpoint (second piece) does not fire
        slow = c.store_async(m, [(b"x", [1]), (b"y", [2])])  # sleeps 3 s mid-copy
        end = time.monotonic() + 30
        while c.server_info().inflight_transfers < 1:
            assert time.monotonic() < end
            time.sleep(0.02)
        assert c.lookup([b"k"], mapping=m) == 1  # answered while the Store still copies
        assert not slow.done()
        assert slow.result(30).stored_chunks == 2
        assert c._session is not None and c._session.failure is None


def test_a_broken_stream_ends_every_pending_request_at_once(spawn, shm_dir) -> None:
    srv = spawn(env={FP: "transfer.copy=sleep(20000);handler.enter=Lookup@sleep(20000)"})
    cache = make_cache(shm_dir, "brk", seed=3)
    c = KVCacheClient(srv.address)
    try:
        m = c.map("ns", [cache.rank_region()])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            store = pool.submit(c.store, m, [(b"x", [1]), (b"y", [2])], timeout=60)
            lookup = pool.submit(c.lookup, [b"x"], namespace="ns", timeout=60)
            with KVCacheClient(srv.address, session=False) as probe:
                end = time.monotonic() + 30
                while probe.server_info().inflight_transfers < 1:
                    assert time.monotonic() < end
                    time.sleep(0.05)
            time.sleep(1)  # the Lookup reached the server too
            t0 = time.monotonic()
            srv.proc.kill()
            with pytest.raises(TransferUnprovable):
                store.result(30)
            with pytest.raises(ServiceUnavailable) as ei:
                lookup.result(30)
            assert time.monotonic() - t0 < 10  # at once, not at the 60 s deadlines
        assert "session stream broke" in ei.value.message
        assert c.leased_blocks(m) == {1, 2}  # the copy may have run: kept until a fence
    finally:
        c.close()


def test_each_request_has_its_own_deadline(spawn) -> None:
    srv = spawn(env={FP: "handler.enter=Lookup@hang"})
    with KVCacheClient(srv.address) as c:
        c.put("ns", [(b"k", b"v")])
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.lookup([b"k"], namespace="ns", timeout=0.5)
        assert time.monotonic() - t0 < 0.5 + 3
        assert c.get("ns", b"k") == b"v"  # the same session goes on
        assert c._session is not None and c._session.failure is None


def without_session(monkeypatch) -> None:
    """Servers made after this lack the Session RPC, like servers before it existed."""
    add = Server._add_service

    def older(self, service, servicer) -> None:
        if service.full_name == "kvsvc.v1.KVCacheService":

            class Old:
                full_name = service.full_name
                methods = [m for m in service.methods if m.name != "Session"]

            service = Old
        add(self, service, servicer)

    monkeypatch.setattr(Server, "_add_service", older)


def test_a_server_without_sessions_gets_unary_calls(monkeypatch, config, shm_dir) -> None:
    without_session(monkeypatch)
    srv = ServerThread(config)
    try:
        with KVCacheClient(srv.address) as c:
            c.put("ns", [(b"k", b"v")])
            assert c.lookup([b"k"], namespace="ns") == 1
            assert not c.use_session
            assert c.get("ns", b"k") == b"v"

        async def go() -> int:
            async with AsyncKVCacheClient(srv.address) as ac:
                hits = await ac.lookup([b"k"], namespace="ns")
                assert not ac.use_session
                return hits

        assert asyncio.run(go()) == 1
    finally:
        srv.stop()


def test_a_request_of_an_unknown_kind_is_answered_under_its_id(server) -> None:
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        requests = [
            pb.SessionRequest(id=7),  # no kind set (a newer client's kind)
            pb.SessionRequest(id=8, lookup=pb.LookupRequest(namespace="ns", keys=[b"k"])),
        ]
        got = {r.id: r for r in stub.Session(iter(requests), timeout=30)}
    assert got[7].WhichOneof("response") == "error"
    assert got[7].error.reason == "UNSUPPORTED_REQUEST"
    assert got[8].lookup.result.hit_chunks == 0


@pytest.mark.parametrize("client_batches", [True, False])
def test_every_request_of_a_batch_is_answered_under_its_id(server, client, client_batches) -> None:
    """Requests carried in ``more`` (nested too) are each answered as if sent alone;
    answers come back batched only to a client that said it reads batches."""
    client.put("ns", [(b"k", b"v")])
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        hit = pb.LookupRequest(namespace="ns", keys=[b"k"])
        batch = pb.SessionRequest(id=1, lookup=hit)
        batch.more.add(id=2, lookup=pb.LookupRequest(namespace="ns", keys=[b"x"]))
        batch.more.add(id=3)  # a kind this server does not know
        nested = batch.more.add(id=4, fence=pb.FenceRequest())  # fence needs a target
        nested.more.add(id=5, lookup=hit)
        metadata = ((SESSION_BATCH, "1"),) if client_batches else ()
        call = stub.Session(iter([batch]), timeout=30, metadata=metadata)
        messages = list(call)
        assert speaks_batches(call.initial_metadata())
    got = {r.id: r for m in messages for r in (m, *m.more)}
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert got[1].lookup.result.hit_chunks == 1 and got[5].lookup.result.hit_chunks == 1
    assert got[2].lookup.result.hit_chunks == 0
    assert got[3].error.reason == "UNSUPPORTED_REQUEST"
    assert got[4].fence.error.reason == "INVALID_ARGUMENT"
    if not client_batches:
        assert len(messages) == 5 and not any(m.more for m in messages)


async def test_many_callers_on_one_session_each_get_their_own_answer(server, client) -> None:
    """Under load answers share messages; each still reaches its own caller."""
    client.put("ns", [(b"%d" % i, b"v") for i in range(0, 400, 2)])
    async with AsyncKVCacheClient(server.address) as ac:
        hits = await asyncio.wait_for(
            asyncio.gather(*[ac.lookup([b"%d" % i], namespace="ns") for i in range(400)]), 120
        )
        assert ac.use_session
    assert hits == [1 - i % 2 for i in range(400)]


def test_a_request_past_its_deadline_is_not_started(server) -> None:
    """The per-request timeout is the unary deadline: a copy that cannot finish in
    it is refused NOT_STARTED by the server itself."""
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        req = pb.SessionRequest(
            id=1,
            store=pb.StoreRequest(
                inline=pb.InlineChunks(
                    namespace="ns", chunks=[pb.InlineChunk(key=b"k", data=b"v" * (8 << 20))]
                )
            ),
        )
        req.timeout.FromNanoseconds(1000)  # 1 µs
        (answer,) = list(stub.Session(iter([req]), timeout=30))
    assert answer.id == 1 and answer.store.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert answer.store.error.transfer_state == NOT_STARTED


async def test_async_client_uses_a_session_and_a_break_ends_its_requests(
    spawn, shm_dir: Path
) -> None:
    srv = spawn(env={FP: "transfer.copy=sleep(20000);handler.enter=Lookup@sleep(20000)"})
    cache = make_cache(shm_dir, "abrk", seed=4)
    ac = AsyncKVCacheClient(srv.address)
    try:
        m = await ac.map("ns", [cache.rank_region()])
        assert (await ac.store(m, [(b"k", [0])])).stored_chunks == 1
        assert isinstance(ac._session, AsyncSession)
        store = ac.store_async(m, [(b"x", [1]), (b"y", [2])], timeout=60)
        lookup = asyncio.ensure_future(ac.lookup([b"x"], namespace="ns", timeout=60))
        await asyncio.sleep(2)  # both reached the server
        t0 = time.monotonic()
        srv.proc.kill()
        with pytest.raises(TransferUnprovable):
            await asyncio.wait_for(store, 30)
        with pytest.raises(ServiceUnavailable):
            await asyncio.wait_for(lookup, 30)
        assert time.monotonic() - t0 < 10
        assert ac.leased_blocks(m) == {1, 2}
    finally:
        await ac.close()


def test_store_many_and_retrieve_many_answer_each_request(server, client, shm_dir) -> None:
    src, dst = make_cache(shm_dir, "ms", seed=5), make_cache(shm_dir, "md")
    m_src, m_dst = client.map("ns", [src.rank_region()]), client.map("ns", [dst.rank_region()])
    stored = client.store_many(m_src, [[(b"a", [0])], [(b"b", [1, 2])], [(b"c", [99])]])
    assert [r.stored_chunks for r in stored[:2]] == [1, 1]
    assert isinstance(stored[2], InvalidRequest) and stored[2].reason == "BLOCK_OUT_OF_RANGE"
    assert client.leased_blocks(m_src) == set()  # every outcome proven, each lease settled
    got = client.retrieve_many(m_dst, [[(b"a", [5])], [(b"b", [6, 7])]])
    assert [r.loaded_chunks for r in got] == [1, 1]
    assert dst.layers[1][:, 5:8].equal(src.layers[1][:, 0:3])

    async def go() -> list:
        async with AsyncKVCacheClient(server.address) as ac:
            m = await ac.map("ns", [src.rank_region()])
            out = await ac.store_many(m, [[(b"d", [3])], [(b"e", [40])]])
            assert ac.leased_blocks(m) == set()
            return out

    out = asyncio.run(go())
    assert out[0].stored_chunks == 1
    assert isinstance(out[1], InvalidRequest) and out[1].reason == "BLOCK_OUT_OF_RANGE"


def test_sigterm_ends_open_sessions_cleanly(spawn) -> None:
    srv = spawn()
    with KVCacheClient(srv.address) as c:
        assert c.lookup([b"k"], namespace="ns") == 0  # a session is open
        srv.signal(signal.SIGTERM)
        assert srv.wait(30) == 0
        with pytest.raises(ServiceUnavailable):  # the stream ended; no server to reopen it
            c.lookup([b"k"], namespace="ns", timeout=5)
    log = srv.output()
    assert "Traceback" not in log and "Exception not handled" not in log, log
