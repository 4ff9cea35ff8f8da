"""ChunkStore's namespaces: namespace shares that eviction respects, and
drop_namespace (chunks being read freed by their last reader, chunks being written
not kept)."""

from __future__ import annotations

from kvsvc.server.data.store import Chunk, ChunkStore

MB = 1 << 20


class Told:
    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, str]] = []

    def stored(self, chunk: Chunk) -> None:
        pass

    def removed(self, chunk: Chunk, reason: str) -> None:
        self.seen.append((chunk.key[0], chunk.key[1], reason))


def put(store: ChunkStore, ns: str, key: bytes, size: int = MB // 4, owner: str = "t") -> int:
    chunks, evicted = store.reserve(ns, [(key, size)], "L", owner)
    assert store.commit(chunks[0], [0] * 1)
    return evicted


def test_a_namespace_over_its_share_is_evicted_first_and_accounts_balance() -> None:
    store = ChunkStore(4 * MB, prefault=False)
    store.namespace_shares["t"] = 2 * MB
    for i in range(4):
        put(store, "a", b"a%d" % i)  # 1 MiB, within its share
    for i in range(40):
        put(store, "b", b"b%d" % i)
    assert store.lookup("a", [b"a%d" % i for i in range(4)], None) == 4
    assert store.used_in[("t", "b")] <= 3 * MB
    assert sum(store.used_in.values()) == store.used_bytes == store.used_by["t"]
    # Within its share, a namespace's own chunks are not preferred over LRU: with no
    # one over, the oldest go first (a's, here).
    store.namespace_shares["t"] = 4 * MB
    put(store, "c", b"c0", 2 * MB)
    assert store.lookup("a", [b"a0"], None) == 0


def test_the_share_of_another_owner_is_its_own() -> None:
    """An owner with no namespace share is weighed as before (plain LRU here)."""
    store = ChunkStore(2 * MB, prefault=False)
    store.namespace_shares["capped"] = MB
    put(store, "x", b"x0", owner="free")
    put(store, "y", b"y0", MB, owner="capped")
    put(store, "y", b"y1", 3 * MB // 4, owner="capped")  # y over its share: its own go
    assert store.lookup("x", [b"x0"], None) == 1
    assert store.lookup("y", [b"y0"], None) == 0


def test_drop_namespace_unlists_frees_after_readers_and_refuses_late_commits() -> None:
    store = ChunkStore(4 * MB, prefault=False)
    told = Told()
    store.listeners.append(told)
    for i in range(3):
        put(store, "a", b"k%d" % i)
    put(store, "b", b"k0")
    writing, _ = store.reserve("a", [(b"late", 4096)], "L", "t")  # a Store's copy runs
    reading = store.acquire_prefix("a", [b"k0"], "L")
    used = store.used_bytes
    assert store.drop_namespace("a") == (3, 3 * (MB // 4))
    assert sorted(told.seen) == [("a", b"k%d" % i, "dropped") for i in range(3)]
    assert store.lookup("a", [b"k0"], None) == 0 and store.lookup("b", [b"k0"], None) == 1
    assert store.used_bytes == used - 2 * reading[0].charged  # k0 still read
    assert not store.commit(writing[0], [0])  # its namespace went while it was written
    store.release(reading)
    assert store.used_bytes == store.used_in[("t", "b")] == store.used_by["t"]
    assert ("t", "a") not in store.used_in
    # A Store reserved after the drop is kept.
    put(store, "a", b"k9")
    assert store.lookup("a", [b"k9"], None) == 1
    assert not store._dropped_at  # nothing reserved now: no drop is remembered
