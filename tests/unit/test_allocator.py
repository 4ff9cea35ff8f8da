"""The chunk store without a server: the first-fit allocator and its coalescing
free list, reservations that are all-or-nothing, LRU eviction that steps around
chunks being read, presence by (namespace, key, layout), checksums."""

from __future__ import annotations

import random

import pytest

from kvsvc.errors import CapacityExhausted
from kvsvc.server.data.copies import SEGMENT_BYTES, checksum, segments
from kvsvc.server.data.store import (
    ALIGN,
    INLINE_LAYOUT,
    Chunk,
    ChunkStore,
    _first_fit,
    _free_range,
    meta_bytes,
)

P = ALIGN  # one page: the allocation unit


# --- the free list, on its own ---
def test_first_fit_takes_the_lowest_hole_that_fits_not_the_best_one() -> None:
    free = [(0, P), (4 * P, 4 * P), (10 * P, 2 * P)]
    assert _first_fit(free, 2 * P) == 4 * P  # the 2-page hole at 10 would fit exactly
    assert free == [(0, P), (6 * P, 2 * P), (10 * P, 2 * P)]


def test_first_fit_removes_a_hole_it_fills_exactly() -> None:
    free = [(0, P), (4 * P, 2 * P)]
    assert _first_fit(free, P) == 0
    assert free == [(4 * P, 2 * P)]


def test_first_fit_finds_nothing_and_leaves_the_list_alone() -> None:
    free = [(0, P), (4 * P, 2 * P)]
    assert _first_fit(free, 3 * P) is None
    assert free == [(0, P), (4 * P, 2 * P)]


@pytest.mark.parametrize(
    ("free", "offset", "size", "after"),
    [
        ([(4 * P, P)], 0, P, [(0, P), (4 * P, P)]),  # apart: inserted in order
        ([(0, P), (4 * P, P)], 2 * P, P, [(0, P), (2 * P, P), (4 * P, P)]),
        ([(2 * P, P)], P, P, [(P, 2 * P)]),  # touches the next
        ([(0, P)], P, P, [(0, 2 * P)]),  # touches the previous
        ([(0, P), (2 * P, 3 * P)], P, P, [(0, 5 * P)]),  # fills the gap: one range
    ],
)
def test_free_range_coalesces_with_its_neighbours(free, offset, size, after) -> None:
    _free_range(free, offset, size)
    assert free == after


def test_free_list_stays_sorted_disjoint_and_coalesced_under_random_use() -> None:
    """Random allocations and frees against a page map: the free list always holds
    exactly the free pages, as maximal ranges in order."""
    pages = 64
    rng = random.Random(13)
    free = [(0, pages * P)]
    used: dict[int, int] = {}  # offset -> size
    for _ in range(2000):
        if used and (rng.random() < 0.45 or len(used) > 20):
            offset = rng.choice(sorted(used))
            _free_range(free, offset, used.pop(offset))
        else:
            size = rng.randint(1, 6) * P
            offset = _first_fit(free, size)
            if offset is None:
                continue
            assert all(offset + size <= o or o + s <= offset for o, s in used.items())
            used[offset] = size
        taken = [False] * pages
        for o, s in used.items():
            for p in range(o // P, (o + s) // P):
                taken[p] = True
        expected: list[tuple[int, int]] = []
        for p in range(pages):
            if taken[p]:
                continue
            if expected and sum(expected[-1]) == p * P:
                expected[-1] = (expected[-1][0], expected[-1][1] + P)
            else:
                expected.append((p * P, P))
        assert free == expected


# --- the store ---
def page_store(pages: int) -> ChunkStore:
    return ChunkStore(pages * P, prefault=False)


def put(store: ChunkStore, key: bytes, size: int = P, layout: str = INLINE_LAYOUT) -> Chunk:
    """Reserve, fill and commit one chunk, as a Store does."""
    [chunk], _ = store.reserve("ns", [(key, size)], layout)
    view = store.buffer(chunk).view
    view[:] = bytes([key[-1]]) * size
    digests = [checksum(view[lo:hi]) for lo, hi in segments(size)]
    assert store.commit(chunk, digests)
    return chunk


def keys_of(store: ChunkStore) -> set[bytes]:
    return {k for k in (b"c%d" % i for i in range(32)) if store.lookup("ns", [k], None)}


def test_reserve_charges_bytes_and_metadata_and_abort_gives_all_back() -> None:
    store = page_store(16)
    chunks, evicted = store.reserve("ns", [(b"a", 1), (b"b", P + 1)], INLINE_LAYOUT)
    assert evicted == 0
    assert [c.alloc_size for c in chunks] == [P, 2 * P]  # rounded up to whole pages
    assert [c.offset for c in chunks] == [0, P]
    assert store.used_bytes == 3 * P + meta_bytes("ns", b"a", 1) + meta_bytes("ns", b"b", P + 1)
    assert len(store) == 0 and store.lookup("ns", [b"a"], None) == 0  # invisible until commit
    for chunk in chunks:
        store.abort(chunk)
    assert store.used_bytes == 0
    assert store._free == [(0, 16 * P)]


def test_lookup_counts_the_leading_keys_per_layout_or_in_any_layout() -> None:
    store = page_store(16)
    put(store, b"k1", layout="A")
    put(store, b"k2", layout="A")
    put(store, b"k3", layout="B")
    assert store.lookup("ns", [b"k1", b"k2", b"k3"], "A") == 2
    assert store.lookup("ns", [b"k1", b"k2", b"k3"], None) == 3
    assert store.lookup("ns", [b"k3", b"k1"], "A") == 0  # a miss ends the prefix
    assert store.lookup("other", [b"k1"], None) == 0


def test_acquire_prefix_pins_the_leading_chunks_of_one_layout() -> None:
    store = page_store(16)
    put(store, b"k1", layout="A")
    put(store, b"k2", layout="B")  # another layout ends the prefix, as Lookup counts it
    put(store, b"k3", layout="A")
    got = store.acquire_prefix("ns", [b"k1", b"k2", b"k3"], "A")
    assert [c.key[1] for c in got] == [b"k1"]
    assert got[0].readers == 1
    store.release(got)
    assert got[0].readers == 0


def test_an_equal_key_that_commits_second_loses_and_is_freed() -> None:
    store = page_store(16)
    [first], _ = store.reserve("ns", [(b"k", P)], INLINE_LAYOUT)
    [second], _ = store.reserve("ns", [(b"k", P)], INLINE_LAYOUT)
    assert store.commit(first, [0])
    used = store.used_bytes
    assert not store.commit(second, [0])
    assert store.used_bytes == used - second.charged
    assert len(store) == 1 and store.get("ns", b"k", INLINE_LAYOUT) is first


def test_eviction_takes_the_least_recently_used_and_a_read_refreshes() -> None:
    store = page_store(5)  # room for 4 one-page chunks and their metadata
    for i in range(4):
        put(store, b"c%d" % i)
    store.release(store.acquire_prefix("ns", [b"c0"], INLINE_LAYOUT))  # c0 is now the newest
    put(store, b"c4")
    assert store.evicted_total == 1
    assert keys_of(store) == {b"c0", b"c2", b"c3", b"c4"}  # c1 was the least recent


def test_eviction_steps_around_pinned_chunks_until_a_hole_fits() -> None:
    """Evicting enough bytes is not enough: eviction goes on, in LRU order and past
    chunks being read, until first fit finds one contiguous hole."""
    store = page_store(8)
    chunks = [put(store, b"c%d" % i) for i in range(7)]  # pages 0..6
    pinned = store.acquire_prefix("ns", [b"c1"], INLINE_LAYOUT)
    pinned += store.acquire_prefix("ns", [b"c3"], INLINE_LAYOUT)
    # LRU now: c0 c2 c4 c5 c6 c1 c3. Two pages: c0, c2 and c4 leave single-page holes
    # between pinned chunks; c5 makes pages 4-5 one hole. c6 stays.
    [chunk], evicted = store.reserve("ns", [(b"two", 2 * P)], INLINE_LAYOUT)
    assert evicted == 4
    assert chunk.offset == chunks[4].offset == 4 * P
    assert keys_of(store) == {b"c1", b"c3", b"c6"}
    store.release(pinned)


def test_when_only_pinned_chunks_could_make_room_nothing_is_evicted() -> None:
    store = page_store(5)
    for i in range(4):
        put(store, b"c%d" % i)
    pinned = store.acquire_prefix("ns", [b"c0", b"c1", b"c2", b"c3"], INLINE_LAYOUT)
    free_before, used_before = list(store._free), store.used_bytes
    with pytest.raises(CapacityExhausted) as ei:
        store.reserve("ns", [(b"x", P)], INLINE_LAYOUT)
    assert ei.value.retryable is True
    assert ei.value.reason == "CAPACITY_EXHAUSTED"
    assert (store._free, store.used_bytes, store.evicted_total) == (free_before, used_before, 0)
    store.release(pinned)
    _, evicted = store.reserve("ns", [(b"x", P)], INLINE_LAYOUT)  # unpinned: room
    assert evicted == 1


def test_a_request_is_placed_whole_or_evicts_nothing() -> None:
    store = page_store(8)
    for i in range(6):
        put(store, b"c%d" % i)
    pinned = store.acquire_prefix("ns", [b"c%d" % i for i in range(4)], INLINE_LAYOUT)
    # Evicting c4 and c5 leaves room for four of the five pages: refused, nothing evicted.
    with pytest.raises(CapacityExhausted):
        store.reserve("ns", [(b"x%d" % i, P) for i in range(5)], INLINE_LAYOUT)
    assert keys_of(store) == {b"c%d" % i for i in range(6)}
    assert store.evicted_total == 0
    store.release(pinned)


def test_a_request_larger_than_the_store_is_refused_as_never_fitting() -> None:
    store = page_store(4)
    put(store, b"c0")
    with pytest.raises(CapacityExhausted) as ei:
        store.reserve("ns", [(b"big", 4 * P)], INLINE_LAYOUT)  # 4 pages + metadata
    assert ei.value.reason == "REQUEST_EXCEEDS_CAPACITY"
    assert ei.value.retryable is False
    assert int(ei.value.metadata["capacityBytes"]) == 4 * P
    assert keys_of(store) == {b"c0"}


def test_a_chunk_of_one_key_in_two_layouts_is_two_chunks() -> None:
    store = page_store(8)
    a = put(store, b"k", layout="A")
    b = put(store, b"k", layout="B")
    assert a.offset != b.offset and len(store) == 2
    assert store.lookup("ns", [b"k"], None) == 1
    store.reserve("ns", [(b"fill%d" % i, P) for i in range(5)], INLINE_LAYOUT)
    [_], evicted = store.reserve("ns", [(b"more", P)], INLINE_LAYOUT)  # evicts layout A's
    assert evicted == 1
    assert store.lookup("ns", [b"k"], "A") == 0
    assert store.lookup("ns", [b"k"], None) == 1  # still present in layout B


def test_checksum_segments_and_a_mismatch_is_a_failed_segment() -> None:
    assert segments(0) == [(0, 0)]  # an empty chunk still has one (empty) segment
    assert segments(2 * SEGMENT_BYTES + 1) == [
        (0, SEGMENT_BYTES),
        (SEGMENT_BYTES, 2 * SEGMENT_BYTES),
        (2 * SEGMENT_BYTES, 2 * SEGMENT_BYTES + 1),
    ]
    store = page_store(4)
    chunk = put(store, b"k1", size=100)
    buf = store.buffer(chunk)
    assert buf.check(3, 0, checksum(buf.view)) == []
    buf.view[0] ^= 0xFF
    bad = checksum(buf.view)
    assert buf.check(3, 0, bad) == [(3, 0, bad)]
    assert store.checksum_failures == 0  # counted when the handler discards the chunk
