"""The presence index against real servers on real sockets: it follows stores and
evictions, equals Lookup's truth at quiescent points, stays fresh while nothing
happens, turns unknown when the server is killed and resyncs on the new
incarnation; the asyncio client's index does the same."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable

from kvsvc.client import AsyncKVCacheClient, KVCacheClient
from kvsvc.client.presence import PresenceIndex
from kvsvc.v1 import kv_cache_service_pb2 as pb

NS = "model-a"


def _eventually(cond: Callable[[], bool], limit: float = 15.0) -> bool:
    """Poll ``cond`` until it holds or ``limit`` seconds passed (bounded)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _truth(client: KVCacheClient, keys: list[bytes]) -> list[bool]:
    """What the server holds, one Lookup per key (the authority)."""
    return [client.lookup([k], namespace=NS) == 1 for k in keys]


def test_the_index_follows_stores_and_evictions_and_equals_lookup(make_server) -> None:
    """Puts under capacity pressure (so the store evicts), checked at quiescent
    points against Lookup for every key ever written: zero divergences."""
    server = make_server(store_bytes=2 << 20)
    rng = random.Random(29)
    written: list[bytes] = []
    with KVCacheClient(server.address) as client, client.presence(NS) as index:
        assert index.wait_fresh(15), f"never fresh: {index.error}"
        assert index.hits([b"nothing"]) == [False] and index.prefix_hits([b"x"]) == 0
        for round_ in range(6):
            batch = [os.urandom(16) for _ in range(rng.randint(5, 20))]
            client.put(NS, [(k, os.urandom(64 << 10)) for k in batch])
            written += batch
            client.put("model-b", [(b"other-" + k, b"v") for k in batch[:2]])
            truth = _truth(client, written)
            keys = list(written)

            def agrees(keys: list[bytes] = keys, truth: list[bool] = truth) -> bool:
                return index.hits(keys) == truth

            assert _eventually(agrees), (
                f"round {round_}: index {index.hits(written)} != truth {truth}"
            )
        assert not all(_truth(client, written)), "capacity pressure evicted nothing"
        assert index.hits([b"other-" + written[0]]) == [False]  # another namespace's
        present = [k for k, t in zip(written, _truth(client, written), strict=True) if t]
        assert index.prefix_hits([*present, b"absent", *present]) == len(present)
        assert index.fresh and index.lag_s <= index.stale_after_s
        assert index.nbytes > 0 and len(index) == len(present)


def test_the_index_stays_fresh_while_nothing_happens(server) -> None:
    """No events for several times stale_after_s: probes prove the stream current."""
    with KVCacheClient(server.address) as client:
        client.put(NS, [(b"k", b"v")])
        with client.presence(NS, stale_after_s=0.5) as index:
            assert index.wait_fresh(15)
            fresh_checks = []
            for _ in range(30):
                time.sleep(0.05)
                fresh_checks.append(index.hits([b"k"]))
            # A loaded CI may delay one probe past the bound; most answers stand.
            assert fresh_checks.count([True]) >= 20, fresh_checks
            assert index.wait_fresh(5) and index.hits([b"k"]) == [True]


def test_a_killed_server_turns_the_index_unknown_then_it_resyncs(spawn) -> None:
    first = spawn()
    port = int(first.address.rsplit(":", 1)[1])
    with KVCacheClient(first.address) as client:
        client.put(NS, [(b"old", b"v")])
        index: PresenceIndex = client.presence(NS, stale_after_s=0.5)
        with index:
            assert index.wait_fresh(15) and index.hits([b"old"]) == [True]
            before = index.cursor
            assert before is not None
            first.signal(signal.SIGKILL)
            killed = time.monotonic()
            assert _eventually(lambda: index.hits([b"old"]) is None, limit=10)
            unknown_after = time.monotonic() - killed
            print(f"index unknown {unknown_after * 1e3:.0f} ms after kill -9")
            assert unknown_after < 5  # stale_after_s is 0.5; a loaded host gets room
            assert not index.fresh and index.error is not None
            first.kill()
            second = spawn(port=port)
            assert index.wait_fresh(30), f"no resync: {index.error}"
            assert index.cursor is not None and index.cursor[0] != before[0]
            assert index.hits([b"old"]) == [False]  # the new incarnation holds nothing
            client.put(NS, [(b"new", b"v")])
            assert _eventually(lambda: index.hits([b"new", b"old"]) == [True, False])
            second.kill()


def test_a_closed_index_answers_none_and_ends_its_threads(server) -> None:
    with KVCacheClient(server.address) as client:
        index = client.presence(NS)
        assert index.wait_fresh(15)
        index.close()
        assert index.hits([b"k"]) is None and not index.fresh
        assert not any(t.is_alive() for t in index._threads)


def test_the_batches_applied_reach_on_batch(server) -> None:
    seen: list[pb.EventBatch] = []
    with KVCacheClient(server.address) as client, client.presence(NS, on_batch=seen.append) as ix:
        assert ix.wait_fresh(15)
        client.put(NS, [(b"k1", b"v"), (b"k2", b"v")])
        assert _eventually(lambda: ix.hits([b"k1", b"k2"]) == [True, True])
    assert seen[0].lost and any(b.snapshot_done for b in seen)
    stored = [k for b in seen for e in b.events if e.HasField("stored") for k in e.stored.keys]
    assert {b"k1", b"k2"} <= set(stored)


def test_the_async_client_index_follows_the_stream(server) -> None:
    async def main() -> None:
        async with AsyncKVCacheClient(server.address) as client:
            await client.put(NS, [(b"a", b"v")])
            async with client.presence(NS) as index:
                assert await index.wait_fresh(15), f"never fresh: {index.error}"
                assert index.hits([b"a", b"b"]) == [True, False]
                await client.put(NS, [(b"b", b"v")])
                end = time.monotonic() + 15
                while index.prefix_hits([b"a", b"b"]) != 2 and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                assert index.prefix_hits([b"a", b"b"]) == 2
            assert index.hits([b"a"]) is None and all(t.done() for t in index._tasks)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_closing_the_client_closes_its_indexes(server) -> None:
    client = KVCacheClient(server.address)
    index = client.presence(NS)
    assert index.wait_fresh(15)
    client.close()
    assert index.closed and index.hits([b"k"]) is None
    assert not any(t.is_alive() for t in index._threads)


def test_a_quiet_resume_is_proven_by_a_fresh_snapshot(server) -> None:
    """A break of the stream alone (same server, nothing stored since): resumed from
    the cursor, the server has nothing to send, so the index reopens without it and
    answers again from lost + snapshot, with no Store needed."""
    with KVCacheClient(server.address) as client:
        client.put(NS, [(b"k", b"v")])
        with client.presence(NS, stale_after_s=0.5) as index:
            assert index.wait_fresh(15) and index.resyncs == 1
            index._cancel()  # the stream breaks; the follower resumes with its cursor
            assert _eventually(lambda: not index.fresh, limit=5)
            assert index.wait_fresh(15), f"never fresh again: {index.error}"
            assert index.resyncs == 2 and index.hits([b"k"]) == [True]
