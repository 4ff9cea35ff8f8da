"""The events ring and log without a server: bounds by count and by bytes, cursors
it can and cannot serve, and publishing that coalesces one turn of the loop."""

from __future__ import annotations

import asyncio
import re

import pytest

from kvsvc.server.data.store import ChunkStore, StoreListener
from kvsvc.server.events.log import REMOVAL_REASONS, EventLog
from kvsvc.server.events.ring import REMOVED, STORED, Event, EventRing
from kvsvc.v1 import kv_cache_service_pb2 as pb


def _event(seq: int, key: bytes = b"k") -> Event:
    return Event(seq, STORED, "ns", (key,), "inline", 1, pb.TIER_MEMORY)


def test_ring_is_bounded_by_count_and_serves_what_it_holds() -> None:
    ring = EventRing(max_events=3, max_bytes=1 << 20)
    for seq in range(1, 6):
        ring.append(_event(seq))
    assert (ring.first, ring.last, len(ring)) == (3, 5, 3)
    assert [e.seq for e in ring.after(2, 10) or []] == [3, 4, 5]  # resumes right after
    assert ring.after(1, 10) is None  # event 2 is gone: the cursor is too old
    assert ring.after(5, 10) == []  # up to date
    assert ring.after(6, 10) is None  # a cursor this ring never gave out
    assert [e.seq for e in ring.after(3, 1) or []] == [4]


def test_ring_is_bounded_by_bytes_and_keeps_one_event() -> None:
    big = _event(1, b"x" * 10_000)
    ring = EventRing(max_events=100, max_bytes=big.cost + 500)
    ring.append(big)
    ring.append(_event(2, b"y" * 10_000))  # the first must go
    assert (ring.first, len(ring)) == (2, 1)
    assert ring.bytes <= ring.max_bytes or len(ring) == 1
    for seq in range(3, 3000):  # many small: compaction keeps indexes right
        ring.append(_event(seq))
    assert ring.bytes <= ring.max_bytes
    assert [e.seq for e in ring.after(ring.last - 2, 10) or []] == [ring.last - 1, ring.last]


def test_ring_refuses_a_gap() -> None:
    ring = EventRing(10, 1 << 20)
    ring.append(_event(1))
    with pytest.raises(ValueError, match="no gaps"):
        ring.append(_event(3))


def test_log_coalesces_one_turn_and_starts_with_cleared() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        log = EventLog(
            "inc", ChunkStore(1 << 20, prefault=False), loop,
            ring_events=100, ring_bytes=1 << 20, remote_keys=2,
        )  # fmt: skip
        changed = log.changed()
        for i in range(5):  # one Store's chunks, committed one by one in one turn
            log.stored("ns", [b"k%d" % i], "L", 10, pb.TIER_MEMORY)
        log.removed("ns", [b"k0"], "L", pb.REMOVAL_REASON_EVICTED, pb.TIER_MEMORY)
        await asyncio.wait_for(changed, 5)
        events = log.ring.after(0, 10) or []
        assert [e.kind for e in events][1:] == [STORED, REMOVED]
        assert events[0].value == pb.CLEAR_REASON_START
        assert events[1].keys == tuple(b"k%d" % i for i in range(5)) and events[1].value == 50
        # The remote tier: what was announced, bounded; the oldest forgotten loudly.
        for i in range(3):
            log.stored("ns", [b"r%d" % i], "L", 7, pb.TIER_REDIS)
        log.stored("ns", [b"r2"], "L", 7, pb.TIER_REDIS)  # already announced: no news
        log.removed("ns", [b"never"], "L", pb.REMOVAL_REASON_TIER_DROPPED, pb.TIER_REDIS)
        log.flush()
        point, chunks, below = log.snapshot()
        assert [tier for tier, _ in below] == [pb.TIER_REDIS]  # no disk tier here
        remote = below[0][1]
        assert chunks == [] and [k for (_, k, _), _ in remote] == [b"r1", b"r2"]
        tail = log.ring.after(3, 10) or []
        kinds = [(e.kind, e.keys) for e in tail]
        assert (REMOVED, (b"r0",)) in kinds and (REMOVED, (b"never",)) not in kinds
        assert point == log.ring.last

    asyncio.run(main())


def test_every_removal_reason_of_the_store_maps_to_the_contract() -> None:
    """Each reason data/store.py's StoreListener names has its pb enum value here."""
    doc = StoreListener.removed.__doc__ or ""
    named = set(re.findall(r'"([a-z_]+)"', doc))
    assert named and named <= set(REMOVAL_REASONS), named - set(REMOVAL_REASONS)
    assert REMOVAL_REASONS["check_failed"] == pb.REMOVAL_REASON_CHECK_FAILED
    assert REMOVAL_REASONS["evicted"] == pb.REMOVAL_REASON_EVICTED
