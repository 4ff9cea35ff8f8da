"""A Store or Retrieve too big to copy on the event loop alone, over sealed memfds:
the loop's thread copies one share while a copy thread copies the other (issue 18).
The bytes land bit for bit, and a chunk gone bad in either share is not loaded and
dropped, with no health change, wherever the bad segment was read."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from support import SERVING, health_status

from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache, rank_context
from kvsvc.server.data import copies

pytestmark = pytest.mark.slow  # starts servers

#: 24 blocks of 256 KiB: a 6 MiB chunk, 6 checksum segments, copied as two tasks of
#: 3 segments (above the default 4 MiB --inline-copy-bytes): segments 0-2 are the
#: loop's thread's, 3-5 a copy thread's; the one that ends first helps the other
#: with the rest of its range, from its back (copies.Claims), so segment 0 is
#: always read on the loop's thread and segment 3 on a copy thread.
BLOCKS = 24


def cache(name: str, seed: int | None) -> SharedKVCache:
    kv = SharedKVCache(name, num_layers=4, num_blocks=2 * BLOCKS, memfd=True)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in kv.layers:
            raw = layer.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return kv


@pytest.fixture
def spans(monkeypatch) -> Iterator[list[tuple[str, int, int]]]:
    """(thread, first segment, end segment) of every span of a chunk copied, and of
    every segment a task of a shared chunk copied (recorded as its task ends)."""
    seen: list[tuple[str, int, int]] = []
    run, run_claimed = copies._BlockCopy.run, copies._BlockCopy.run_claimed

    def recording(self: copies._BlockCopy, a: int, b: int) -> list[copies.Digest]:
        seen.append((threading.current_thread().name, a, b))
        return run(self, a, b)

    def recording_claimed(
        self: copies._BlockCopy, claims: copies.Claims, me: int
    ) -> list[copies.Digest]:
        try:
            return run_claimed(self, claims, me)
        finally:
            seen.extend((threading.current_thread().name, s, s + 1) for s in claims.mine(me))

    monkeypatch.setattr(copies._BlockCopy, "run", recording)
    monkeypatch.setattr(copies._BlockCopy, "run_claimed", recording_claimed)
    yield seen


def test_a_copy_is_shared_by_the_loop_and_a_copy_thread_bit_exact(
    server, client: KVCacheClient, spans
) -> None:
    src, dst = cache("src", seed=3), cache("dst", seed=None)
    try:
        m_src = client.map(
            "ns", [src.rank_region(rank_context(), token=client.register_memfd(src.fd))]
        )
        m_dst = client.map(
            "ns", [dst.rank_region(rank_context(), token=client.register_memfd(dst.fd))]
        )
        ids = [int(i) for i in torch.randperm(2 * BLOCKS)[:BLOCKS]]  # scattered runs
        assert client.store(m_src, [(b"k", ids)]).stored_chunks == 1
        loop = server.thread.name
        # every segment copied once, by the loop's thread or a copy thread; each
        # range's first by its own task
        assert sorted(s for _, a, b in spans for s in range(a, b)) == list(range(6))
        assert (loop, 0, 1) in spans
        assert next(t for t, a, _ in spans if a == 3).startswith("kvsvc-copy-")
        assert all(t.startswith("kvsvc-copy-") for t, _, _ in spans if t != loop)
        spans.clear()
        out = list(range(BLOCKS, 2 * BLOCKS))
        assert client.retrieve(m_dst, [(b"k", out)]).loaded_chunks == 1
        assert {t == loop for t, _, _ in spans} == {True, False}
        for s_layer, d_layer in zip(src.layers, dst.layers, strict=True):
            want = s_layer.index_select(src.block_dim, torch.tensor(ids)).view(torch.uint8)
            got = d_layer.index_select(dst.block_dim, torch.tensor(out)).view(torch.uint8)
            assert torch.equal(want, got)
        assert not client.leased_blocks(m_src) and not client.leased_blocks(m_dst)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize(("share", "segment"), [("loop", 0), ("copy thread", 3)])
def test_a_bad_segment_in_either_share_fails_its_chunk_and_only_it(
    server, client: KVCacheClient, spans, share: str, segment: int
) -> None:
    src, dst = cache("src", seed=4), cache("dst", seed=None)
    try:
        m_src = client.map(
            "ns", [src.rank_region(rank_context(), token=client.register_memfd(src.fd))]
        )
        m_dst = client.map(
            "ns", [dst.rank_region(rank_context(), token=client.register_memfd(dst.fd))]
        )
        client.store(m_src, [(b"k", list(range(BLOCKS)))])
        store = server.server.servicer.store
        (chunk,) = [c for key, c in store._chunks.items() if key[:2] == ("ns", b"k")]
        store.view[chunk.offset + segment * copies.SEGMENT_BYTES + 7] ^= 0xFF
        spans.clear()
        got = client.retrieve(m_dst, [(b"k", list(range(BLOCKS, 2 * BLOCKS)))])
        assert (got.loaded_chunks, got.loaded_bytes) == (0, 0)
        (reader,) = [t for t, a, b in spans if a <= segment < b]
        assert (reader == server.thread.name) == (share == "loop")
        assert store.checksum_failures == 1 and not store.lookup("ns", [b"k"], chunk.layout)
        assert health_status(server.address) == SERVING
        assert client.server_info().serving
        assert not client.leased_blocks(m_dst)
    finally:
        src.close()
        dst.close()


def test_the_thread_that_ends_first_copies_the_rest_of_the_others_range(
    server, client: KVCacheClient, spans, monkeypatch
) -> None:
    """A copy thread that is slow on its first segment (late, preempted): the loop's
    thread, done with its own range, copies the rest of the copy thread's, from
    its back, so the call no longer waits for a whole share of one thread. Made
    deterministic with events on the Python copy loop (the native one claims the
    same way, in C: tests/unit/test_checksum.py)."""
    monkeypatch.setattr(copies, "NATIVE", None)
    began, release = threading.Event(), threading.Event()
    copy_range = copies.copy_range

    def gated(plan, buf, addr, lo, hi, *, to_store):  # type: ignore[no-untyped-def]
        segment = lo // copies.SEGMENT_BYTES
        if segment == 0:  # the loop's first: wait until the copy thread has begun
            assert began.wait(10)
        if segment == 3:  # the copy thread's first: held until the loop took the rest
            began.set()
            assert release.wait(10)
        try:
            return copy_range(plan, buf, addr, lo, hi, to_store=to_store)
        finally:
            if segment == 4:  # the last one the loop's thread takes (from the back)
                release.set()

    monkeypatch.setattr(copies, "copy_range", gated)
    src, dst = cache("src", seed=5), cache("dst", seed=None)
    try:
        m_src = client.map(
            "ns", [src.rank_region(rank_context(), token=client.register_memfd(src.fd))]
        )
        m_dst = client.map(
            "ns", [dst.rank_region(rank_context(), token=client.register_memfd(dst.fd))]
        )
        for op in ("store", "retrieve"):
            spans.clear()
            began.clear()
            release.clear()
            if op == "store":
                assert client.store(m_src, [(b"k", list(range(BLOCKS)))]).stored_chunks == 1
            else:
                out = list(range(BLOCKS, 2 * BLOCKS))
                assert client.retrieve(m_dst, [(b"k", out)]).loaded_chunks == 1
            loop = server.thread.name
            assert sorted(a for t, a, _ in spans if t == loop) == [0, 1, 2, 4, 5], op
            (other,) = {t for t, _, _ in spans if t != loop}
            assert other.startswith("kvsvc-copy-")
            assert [a for t, a, _ in spans if t == other] == [3], op
        for s_layer, d_layer in zip(src.layers, dst.layers, strict=True):
            want = s_layer[:, :BLOCKS] if src.block_dim == 1 else s_layer[:BLOCKS]
            got = d_layer[:, BLOCKS:] if dst.block_dim == 1 else d_layer[BLOCKS:]
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    finally:
        src.close()
        dst.close()
