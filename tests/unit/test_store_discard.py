"""ChunkStore.discard: a chunk dropped (e.g. it failed its checksum) is unlisted at
once, listeners are told, and its bytes are freed only by its last reader."""

from __future__ import annotations

from kvsvc.server.data.store import Chunk, ChunkStore


class Told:
    def __init__(self) -> None:
        self.seen: list[tuple[bytes, str]] = []

    def stored(self, chunk: Chunk) -> None:
        pass

    def removed(self, chunk: Chunk, reason: str) -> None:
        self.seen.append((chunk.key[1], reason))


def test_discard_while_read_pinned_frees_on_the_last_release() -> None:
    store = ChunkStore(1 << 20, prefault=False)
    told = Told()
    store.listeners.append(told)
    (chunk,), _ = store.reserve("ns", [(b"k", 8192)], "L")
    assert store.commit(chunk, [0])
    used = store.used_bytes
    pinned = store.acquire_prefix("ns", [b"k"], "L")
    pinned2 = store.acquire_prefix("ns", [b"k"], "L")
    assert store.discard(chunk, "check_failed")
    assert not store.discard(chunk, "check_failed")  # once
    assert store.get("ns", b"k", "L") is None and store.lookup("ns", [b"k"], None) == 0
    assert told.seen == [(b"k", "check_failed")] and store.checksum_failures == 1
    store.release(pinned)
    assert store.used_bytes == used  # still read by one
    store.release(pinned2)
    assert store.used_bytes == used - chunk.charged
    # the range is free again: the whole store can be reserved
    (again,), _ = store.reserve("ns", [(b"k2", store.capacity - 4096)], "L")
    assert again.offset == 0


def test_discard_unpinned_frees_at_once() -> None:
    store = ChunkStore(1 << 20, prefault=False)
    (chunk,), _ = store.reserve("ns", [(b"k", 100)], "L")
    store.commit(chunk, [0])
    assert store.discard(chunk, "check_failed")
    assert store.used_bytes == 0 and len(store) == 0
