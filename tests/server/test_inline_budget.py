"""Large inline requests against a real server: one that can never fit the store is
refused from its size before it is parsed, and the bytes concurrent large requests
hold are bounded by --inline-budget-bytes (beyond it: INLINE_BUDGET_EXHAUSTED at
once, retryable), given back when the request has been answered; unary calls and
the session stream alike."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from support import ServerThread

from kvsvc.client import KVCacheClient
from kvsvc.errors import CapacityExhausted, KVServiceError
from kvsvc.server.config import ServerConfig
from kvsvc.server.data import budget as budget_module
from kvsvc.v1 import kv_cache_service_pb2 as pb

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
