"""The WatchEvents stream against a real server on a real socket: ordered batches
of the server's incarnation, lost + a paged snapshot + live events with no gap and
no duplicate, cursor resume from the ring, eviction as removed events, namespace
filters, a watcher that stops reading, tenants, and the end of the stream when the
server stops serving."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
from support import ServerThread

from kvsvc.client import KVCacheClient
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
    ) -> None:
        self.channel = grpc.insecure_channel(address)
        request = pb.WatchEventsRequest(namespaces=namespaces, snapshot_page_keys=page)
        if cursor is not None:
            request.cursor.CopyFrom(cursor)
        self.call = pb_grpc.KVCacheServiceStub(self.channel).WatchEvents(
            request, timeout=120, metadata=metadata
        )
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
        """Read lost + snapshot: (S, {(namespace, key): tier})."""
        lost = self.batch()
        assert lost.lost and not lost.events, lost
        present: dict[tuple[str, bytes], int] = {}
        while True:
            b = self.batch()
            assert b.snapshot and b.sequence == lost.sequence, b
            for e in b.events:
                assert e.WhichOneof("kind") == "stored", e
                for k in e.stored.keys:
                    assert (e.stored.namespace, k) not in present, "duplicate in snapshot"
                    present[(e.stored.namespace, k)] = e.stored.tier
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
