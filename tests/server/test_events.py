"""The WatchEvents stream against a real server on a real socket: ordered batches
of the server's incarnation, lost + a paged snapshot + live events with no gap and
no duplicate, cursor resume from the ring, eviction as removed events, namespace
filters, a watcher that stops reading, tenants, and the end of the stream when the
server stops serving."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from redis_servers import RedisServer, require_redis
from support import SERVING, ServerThread, health_status

from kvsvc.client import KVCacheClient
from kvsvc.errors import FatalServerError
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

WAIT_S = 20.0  # a loaded 2-core host: generous, never a timing assertion


class Watch:
    """One WatchEvents stream read on its own thread into a queue (every read has a
    timeout); ``next()`` is the next response."""

    def __init__(
        self,
        address: str,
        *,
        namespaces: tuple[str, ...] = (),
        cursor: pb.EventCursor | None = None,
        page: int = 0,
        metadata: tuple[tuple[str, str], ...] = (),
        read: bool = True,
        options: tuple[tuple[str, int], ...] = (),
    ) -> None:
        self.channel = grpc.insecure_channel(address, options=options)
        request = pb.WatchEventsRequest(namespaces=namespaces, snapshot_page_keys=page)
        if cursor is not None:
            request.cursor.CopyFrom(cursor)
        self.call = pb_grpc.KVCacheServiceStub(self.channel).WatchEvents(
            request, timeout=120, metadata=metadata
        )
        #: (namespace, key, tier) of every key the last snapshot named
        self.tiers: set[tuple[str, bytes, int]] = set()
        self.responses: queue.Queue[pb.WatchEventsResponse | BaseException] = queue.Queue()
        self.go = threading.Event()
        if read:
            self.go.set()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            self.go.wait(120)
            for response in self.call:
                self.responses.put(response)
                self.go.wait(120)
            self.responses.put(EOFError("stream ended"))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.responses.put(exc)

    def next(self, timeout: float = WAIT_S) -> pb.WatchEventsResponse:
        item = self.responses.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def batch(self) -> pb.EventBatch:
        response = self.next()
        assert response.WhichOneof("outcome") == "batch", response
        return response.batch

    def resync(self) -> tuple[int, dict[tuple[str, bytes], int]]:
        """Read lost + snapshot: (S, {(namespace, key): its lowest tier number})."""
        lost = self.batch()
        assert lost.lost and not lost.events, lost
        present: dict[tuple[str, bytes], int] = {}
        seen: set[tuple[str, bytes, int]] = set()
        while True:
            b = self.batch()
            assert b.snapshot and b.sequence == lost.sequence, b
            for e in b.events:
                assert e.WhichOneof("kind") == "stored", e
                for k in e.stored.keys:
                    where = (e.stored.namespace, k, e.stored.tier)
                    assert where not in seen, "duplicate in snapshot"
                    seen.add(where)
                    tier = present.get((e.stored.namespace, k), e.stored.tier)
                    present[(e.stored.namespace, k)] = min(tier, e.stored.tier)
                    self.tiers.add(where)
            if b.snapshot_done:
                return lost.sequence, present

    def close(self) -> None:
        self.call.cancel()
        self.go.set()
        self.channel.close()
        self.thread.join(10)


@pytest.fixture
def watch(server: ServerThread) -> Iterator:
    opened: list[Watch] = []

    def open_(address: str | None = None, **kw: object) -> Watch:
        w = Watch(address or server.address, **kw)  # type: ignore[arg-type]
        opened.append(w)
        return w

    yield open_
    for w in opened:
        w.close()


def _live_keys(w: Watch, last: int, want: int) -> tuple[int, list[tuple[str, str, bytes]]]:
    """Read live batches until ``want`` keys arrived: (last sequence, [(kind, ns, key)]);
    each batch's sequence follows the one before it."""
    seen: list[tuple[str, str, bytes]] = []
    while len(seen) < want:
        b = w.batch()
        assert not b.lost and not b.snapshot, b
        assert b.sequence > last, (b.sequence, last)
        last = b.sequence
        for e in b.events:
            kind = e.WhichOneof("kind")
            if kind == "cleared":
                continue
            ev = getattr(e, kind)
            seen += [(kind, ev.namespace, k) for k in ev.keys]
    return last, seen


def test_snapshot_then_live_with_no_gap_or_duplicate(server, client, watch) -> None:
    client.put("ns", [(b"a", b"1"), (b"b", b"2")])
    w = watch()
    point, present = w.resync()
    assert present == {("ns", b"a"): pb.TIER_MEMORY, ("ns", b"b"): pb.TIER_MEMORY}
    client.put("ns", [(b"c", b"3")])
    last, seen = _live_keys(w, point, 1)
    assert seen == [("stored", "ns", b"c")]
    assert last == point + 1  # the next event after the snapshot point
    info = client.server_info()
    w2 = watch()
    assert w2.batch().incarnation == info.server_start_id


def test_cursor_resumes_right_after_it(server, client, watch) -> None:
    w = watch()
    point, _ = w.resync()
    client.put("ns", [(b"k1", b"v")])
    first, _ = _live_keys(w, point, 1)
    w.close()
    client.put("ns", [(b"k2", b"v")])
    client.put("ns", [(b"k3", b"v")])
    info = client.server_info()
    cursor = pb.EventCursor(incarnation=info.server_start_id, sequence=first)
    w2 = watch(cursor=cursor)
    _, seen = _live_keys(w2, first, 2)
    assert seen == [("stored", "ns", b"k2"), ("stored", "ns", b"k3")]  # nothing before, no gap


def test_cursor_of_another_incarnation_or_too_old_is_lost(make_server, watch) -> None:
    st = make_server(events_ring=4)
    with KVCacheClient(st.address) as c:
        start = c.server_info().server_start_id
        other = watch(st.address, cursor=pb.EventCursor(incarnation="gone", sequence=1))
        assert other.resync()[1] == {}
        for i in range(10):  # each Store one event: the ring keeps only the last 4
            c.put("ns", [(b"k%d" % i, b"v")])
        old = watch(st.address, cursor=pb.EventCursor(incarnation=start, sequence=1))
        _, present = old.resync()
        assert present == {("ns", b"k%d" % i): pb.TIER_MEMORY for i in range(10)}
        ahead = watch(st.address, cursor=pb.EventCursor(incarnation=start, sequence=10**6))
        ahead.resync()


def test_eviction_is_a_removed_event(make_server, watch) -> None:
    st = make_server(store_bytes=1 << 20)
    with KVCacheClient(st.address) as c:
        w = watch(st.address)
        point, _ = w.resync()
        value = b"x" * (200 << 10)
        for i in range(8):  # 8 x 200 KiB into 1 MiB: the oldest are evicted
            c.put("ns", [(b"k%d" % i, value)])
        removed: list[bytes] = []
        stored: list[bytes] = []
        last = point
        while len(stored) < 8:
            last, seen = _live_keys(w, last, 1)
            for kind, _, key in seen:
                (stored if kind == "stored" else removed).append(key)
        assert stored == [b"k%d" % i for i in range(8)]
        assert removed and removed == [b"k%d" % i for i in range(len(removed))]
        # The reason and tier travel with the event.
        start = c.server_info().server_start_id
        w2 = watch(st.address, cursor=pb.EventCursor(incarnation=start, sequence=point))
        found = False
        while not found:
            b = w2.batch()
            for e in b.events:
                if e.WhichOneof("kind") == "removed":
                    assert e.removed.reason == pb.REMOVAL_REASON_EVICTED
                    assert e.removed.tier == pb.TIER_MEMORY
                    found = True


def test_namespace_filter(server, client, watch) -> None:
    client.put("other", [(b"x", b"1")])
    client.put("mine", [(b"y", b"1")])
    w = watch(namespaces=("mine",))
    point, present = w.resync()
    assert present == {("mine", b"y"): pb.TIER_MEMORY}
    client.put("other", [(b"x2", b"1")])
    client.put("mine", [(b"y2", b"1")])
    _, seen = _live_keys(w, point, 1)
    assert seen == [("stored", "mine", b"y2")]


def test_snapshot_pages_are_bounded(server, client, watch) -> None:
    client.put("ns", [(b"k%03d" % i, b"v") for i in range(50)])
    w = watch(page=8)
    lost = w.batch()
    assert lost.lost
    keys = 0
    while True:
        b = w.batch()
        n = sum(len(e.stored.keys) for e in b.events)
        assert n <= 8
        keys += n
        if b.snapshot_done:
            break
    assert keys == 50


def _error(w: Watch) -> pb.WatchEventsResponse:
    """Skip batches until the error batch; then the stream ends."""
    while True:
        response = w.next()
        if response.WhichOneof("outcome") == "error":
            with pytest.raises(EOFError):
                w.next()
            return response


async def _fatal(st: ServerThread) -> None:
    st.server.servicer.fatal(FatalServerError("injected by the test", reason="TEST_FATAL"))


def test_fatal_failure_sends_cleared_then_ends_streams_with_not_serving(make_server, watch) -> None:
    st = make_server()
    with KVCacheClient(st.address) as c:
        c.put("ns", [(b"k", b"v")])
        w = watch(st.address)
        point, _ = w.resync()
        st.run(_fatal(st))
        b = w.batch()
        assert [e.cleared.reason for e in b.events] == [pb.CLEAR_REASON_FATAL]
        assert b.sequence == point + 1
        error = _error(w).error
        assert error.reason == "SERVICE_NOT_SERVING"
        assert error.metadata["failureReason"] == "TEST_FATAL"
        late = watch(st.address)  # a stream opened afterwards is answered at once
        assert _error(late).error.reason == "SERVICE_NOT_SERVING"


def test_shutdown_ends_streams_with_an_error_before_the_server_stops(config) -> None:
    st = ServerThread(config)
    try:
        w = Watch(st.address)
        w.resync()
        stopped = threading.Thread(target=st.stop)
        stopped.start()
        error = _error(w).error
        assert error.reason == "SERVICE_NOT_SERVING"
        assert error.metadata["failureReason"] == "SHUTTING_DOWN"
        stopped.join(30)
        assert not stopped.is_alive()
        w.close()
    finally:
        if st.thread.is_alive():
            st.stop()


def test_a_watcher_that_stops_reading_bounds_the_server_and_resyncs(make_server, watch) -> None:
    """The client reads nothing while thousands of Stores go on: Stores are answered,
    health stays SERVING, the ring stays within its bounds; once it reads again the
    watcher gets lost, a snapshot equal to the store, then live events."""
    ring_bytes = 256 << 10
    st = make_server(events_ring=256, events_ring_bytes=ring_bytes)
    events = st.server.servicer.events
    # A small receive window (no BDP growth) so the server's writes wait soon.
    small = (("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20))
    stuck = watch(st.address, options=small)
    stuck.resync()
    stuck.go.clear()  # from here on it reads nothing (one message may still be taken)
    key = b"k" * 900
    with KVCacheClient(st.address) as c:
        c.put("warm", [(b"w", b"v")])
        seconds = []
        # ~16 MB of events: far past the stream's window, loopback's socket buffers
        # (a few MB) and the ring
        for i in range(2000):
            t = time.perf_counter()
            c.put("ns", [(key + b"%05d-%d" % (i, j), b"v") for j in range(8)])
            seconds.append(time.perf_counter() - t)
            assert events.ring.bytes <= ring_bytes or len(events.ring) == 1
        assert health_status(st.address) == SERVING
        assert events.watching == 1
        seconds.sort()
        print(
            f"Store p50 {1e3 * seconds[len(seconds) // 2]:.2f} ms, p99 "
            f"{1e3 * seconds[int(len(seconds) * 0.99)]:.2f} ms with a stuck watcher; "
            f"load {os.getloadavg()[0]:.1f}"
        )
        resyncs = events.resyncs
        stuck.go.set()  # it reads again
        # Whatever it had in flight arrives first; then lost and the snapshot.
        while not (b := stuck.batch()).lost:
            assert not b.snapshot
        present: set[tuple[str, bytes]] = set()
        while True:
            b = stuck.batch()
            assert b.snapshot
            present |= {(e.stored.namespace, k) for e in b.events for k in e.stored.keys}
            if b.snapshot_done:
                break
        truth = {(ns, k) for ns, k, _ in (ch.key for ch in st.server.servicer.store.chunks())}
        assert present == truth
        assert events.resyncs == resyncs + 1
        c.put("ns", [(b"after", b"v")])  # the store is full by now: it may evict
        last, seen = b.sequence, []
        while ("stored", "ns", b"after") not in seen:
            last, more = _live_keys(stuck, last, 1)
            seen += more
        assert {kind for kind, _, _ in seen} <= {"stored", "removed"}
        assert [k for kind, _, k in seen if kind == "stored"] == [b"after"]


def _tenants(path: Path) -> tuple[Path, str, str]:
    a, b = "a" * 32, "b" * 32
    spec = {
        "team-a": {"tokens": [a], "namespaces": ["a/*"]},
        "team-b": {"tokens": [b], "namespaces": ["b/*", "a/shared"]},
    }
    path.write_text(json.dumps({"tenants": spec}))
    path.chmod(0o600)
    return path, a, b


def test_a_tenant_sees_only_its_own_keys_and_names(make_server, watch, tmp_path) -> None:
    path, token_a, token_b = _tenants(tmp_path / "tenants.json")
    st = make_server(auth_token_file=str(path))
    auth_a = (("authorization", f"Bearer {token_a}"),)
    auth_b = (("authorization", f"Bearer {token_b}"),)
    with (
        KVCacheClient(st.address, token=token_a) as ca,
        KVCacheClient(st.address, token=token_b) as cb,
    ):
        ca.put("a/x", [(b"secret-a", b"v")])
        ca.put("a/shared", [(b"a-shared", b"v")])
        cb.put("a/shared", [(b"b-shared", b"v")])  # b's own store under a name a uses too
        wa, wb = watch(st.address, metadata=auth_a), watch(st.address, metadata=auth_b)
        pa, present_a = wa.resync()
        pb_, present_b = wb.resync()
        assert present_a == {("a/x", b"secret-a"): 1, ("a/shared", b"a-shared"): 1}
        assert present_b == {("a/shared", b"b-shared"): 1}  # unscoped, and only b's
        ca.put("a/x", [(b"more-a", b"v")])
        cb.put("b/y", [(b"more-b", b"v")])
        _, seen_b = _live_keys(wb, pb_, 1)
        assert seen_b == [("stored", "b/y", b"more-b")]
        _, seen_a = _live_keys(wa, pa, 1)
        assert seen_a == [("stored", "a/x", b"more-a")]
        denied = watch(st.address, metadata=auth_a, namespaces=("b/y",))
        assert _error(denied).error.reason == "PERMISSION_DENIED"
        nobody = watch(st.address)
        with pytest.raises(grpc.RpcError) as info:
            nobody.next()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_metrics_count_watchers_events_and_resyncs(server, client, watch) -> None:
    w = watch()
    w.resync()
    client.put("ns", [(b"k", b"v")])
    _live_keys(w, 0, 1)
    text = generate_latest(server.server.servicer.metrics.registry).decode()
    assert "kvsvc_event_watchers 1.0" in text
    assert "kvsvc_event_resyncs_total 1.0" in text
    assert "kvsvc_events_published_total" in text


def _tier_events(w: Watch, last: int, want: set[tuple[str, bytes, int]]) -> int:
    """Read live batches until every (namespace, key, tier) of ``want`` was stored."""
    while want:
        b = w.batch()
        assert b.sequence > last
        last = b.sequence
        for e in b.events:
            if e.WhichOneof("kind") == "stored":
                want -= {(e.stored.namespace, k, e.stored.tier) for k in e.stored.keys}
    return last


def test_the_redis_tier_as_far_as_this_server_saw_it(make_server, watch, tmp_path) -> None:
    """A's write-behind announces its keys in the Redis tier (and A's snapshot says
    so); B's fetch that finds a key announces it in Redis and in B's memory."""
    require_redis()
    redis = RedisServer(tmp_path / "redis")
    try:
        a = make_server(remote=redis.url)
        b = make_server(remote=redis.url)
        wa, wb = watch(a.address), watch(b.address)
        pa, _ = wa.resync()
        pb_, _ = wb.resync()
        with KVCacheClient(a.address) as ca:
            ca.put("ns", [(b"k", b"value")])
        _tier_events(wa, pa, {("ns", b"k", pb.TIER_MEMORY), ("ns", b"k", pb.TIER_REDIS)})
        again = watch(a.address)
        again.resync()
        assert again.tiers == {("ns", b"k", pb.TIER_MEMORY), ("ns", b"k", pb.TIER_REDIS)}
        remote = b.server.servicer.tiers.named("redis")
        assert remote is not None

        async def fetch() -> int:
            return await remote.fetch("ns", "inline", [b"k"], 10.0)

        assert b.run(fetch()) == 1
        _tier_events(wb, pb_, {("ns", b"k", pb.TIER_MEMORY), ("ns", b"k", pb.TIER_REDIS)})
    finally:
        redis.kill()


def test_shutdown_is_not_held_by_a_watcher_that_reads_nothing(config) -> None:
    st = ServerThread(config.replace(events_ring=64))
    small = (("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20))
    stuck = Watch(st.address, options=small)
    try:
        stuck.resync()
        stuck.go.clear()
        with KVCacheClient(st.address) as c:
            for i in range(600):  # ~2 MB of events: its window is full
                c.put("ns", [(b"k" * 900 + b"%05d-%d" % (i, j), b"v") for j in range(4)])
        t = time.monotonic()
        st.stop()
        print(f"stop took {time.monotonic() - t:.2f} s with a watcher reading nothing")
        assert not st.thread.is_alive()
        stuck.go.set()
        last = None
        with pytest.raises((grpc.RpcError, EOFError)) as ended:
            while True:
                last = stuck.next()
        if isinstance(ended.value, EOFError):  # a clean end only after an error batch
            assert last is not None and last.WhichOneof("outcome") == "error"
    finally:
        stuck.close()
        if st.thread.is_alive():
            st.stop()


def _removed_from_redis(w: Watch, last: int, want: set[tuple[str, bytes]]) -> int:
    """Read live batches until every (namespace, key) of ``want`` left the Redis tier."""
    while want:
        b = w.batch()
        assert b.sequence > last
        last = b.sequence
        for e in b.events:
            if e.WhichOneof("kind") == "removed" and e.removed.tier == pb.TIER_REDIS:
                assert e.removed.reason == pb.REMOVAL_REASON_TIER_DROPPED
                want -= {(e.removed.namespace, k) for k in e.removed.keys}
    return last


def test_a_restarted_redis_withdraws_what_was_announced_in_it(make_server, watch, tmp_path) -> None:
    """Redis without persistence restarts empty and redis-py reconnects silently:
    the keys this server announced in the Redis tier are withdrawn (a new run id),
    and a snapshot no longer names them; a Lookup that finds one missing (FLUSHALL,
    same run) withdraws it too."""
    require_redis()
    redis = RedisServer(tmp_path / "redis")
    try:
        a = make_server(remote=redis.url)
        w = watch(a.address)
        last, _ = w.resync()
        with KVCacheClient(a.address) as c:
            c.put("ns", [(b"k1", b"one"), (b"k2", b"two")])
            want = {("ns", k, t) for k in (b"k1", b"k2") for t in (pb.TIER_MEMORY, pb.TIER_REDIS)}
            last = _tier_events(w, last, want)
            redis.kill()
            redis.start(port=redis.port)  # a new run, empty
            last = _removed_from_redis(w, last, {("ns", b"k1"), ("ns", b"k2")})
            again = watch(a.address)
            again.resync()
            assert {t for _, _, t in again.tiers} == {pb.TIER_MEMORY}

            c.put("ns", [(b"k3", b"three")])
            last = _tier_events(w, last, {("ns", b"k3", pb.TIER_REDIS)})
            redis.cli("FLUSHALL")  # same run: only a miss can tell
            remote = a.server.servicer.tiers.named("redis")
            assert remote is not None

            async def ask() -> list[bool]:
                return await remote.present("ns", "inline", [b"k3"])

            assert a.run(ask()) == [False]
            _removed_from_redis(w, last, {("ns", b"k3")})
    finally:
        redis.kill()


def test_a_linger_coalesces_a_burst_into_few_writes(config, watch) -> None:
    """--events-linger-ms: batches of one stream are at least the linger apart, so a
    burst of Stores reaches the watcher in few writes, every key in order. The bound
    counts from the burst's own measured length, never from a guess at timing."""
    linger = 0.3
    st = ServerThread(config.replace(events_linger_ms=int(linger * 1000)))
    try:
        w = watch(st.address)
        point, _ = w.resync()
        n = 40
        with KVCacheClient(st.address) as c:
            t0 = time.monotonic()
            for i in range(n):
                c.put("ns", [(b"burst-%03d" % i, b"v")])
            burst = time.monotonic() - t0
        keys: list[bytes] = []
        writes = 0
        while len(keys) < n:
            b = w.batch()
            if not b.events:
                continue  # progress: no key
            writes += 1
            assert b.sequence > point
            point = b.sequence
            keys += [k for e in b.events for k in e.stored.keys]
        assert keys == [b"burst-%03d" % i for i in range(n)]
        # one write may go out at once, then one per linger while the burst lasts
        assert writes <= 2 + int(burst / linger), (writes, burst)
    finally:
        st.stop()
