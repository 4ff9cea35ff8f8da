"""A Store or Retrieve too big to copy on the event loop alone, over sealed memfds:
the loop's thread copies one share while a copy thread copies the other (issue 18).
The bytes land bit for bit, and a chunk gone bad in either share is DATA_LOSS with
the same health change, wherever the bad segment was read."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from conftest import NOT_SERVING, health_status

from kvsvc import copies
from kvsvc.client import KVCacheClient
from kvsvc.errors import DataLoss, TransferUnprovable
from kvsvc.kvcache import SharedKVCache, rank_context

pytestmark = pytest.mark.slow  # starts servers

#: 24 blocks of 256 KiB: a 6 MiB chunk, 6 checksum segments, copied as two tasks of
#: 3 segments (above the default 4 MiB --inline-copy-bytes): segments 0-2 on the
#: loop's thread, 3-5 on a copy thread.
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
    """(thread, first segment, end segment) of every span of a chunk copied."""
    seen: list[tuple[str, int, int]] = []
    run = copies._BlockCopy.run

    def recording(self: copies._BlockCopy, a: int, b: int) -> list[copies.Digest]:
        seen.append((threading.current_thread().name, a, b))
        return run(self, a, b)

    monkeypatch.setattr(copies._BlockCopy, "run", recording)
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
        assert sorted((a, b) for t, a, b in spans if t == loop) == [(0, 3)]
        assert [(a, b) for t, a, b in spans if t != loop] == [(3, 6)]
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


@pytest.mark.parametrize(("share", "segment"), [("loop", 1), ("copy thread", 4)])
def test_a_bad_segment_in_either_share_is_data_loss_and_stops_serving(
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
        # DataLoss when the other share had ended by then; else, as when a copy
        # thread fails beside a running one, the call is answered at once as
        # unprovable (same reason) and a Fence proves the end.
        with pytest.raises((DataLoss, TransferUnprovable)) as ei:
            client.retrieve(m_dst, [(b"k", list(range(BLOCKS, 2 * BLOCKS)))])
        assert ei.value.reason == "CHECKSUM_MISMATCH"
        if isinstance(ei.value, DataLoss):
            assert ei.value.metadata["segment"] == str(segment)
        (reader,) = [t for t, a, b in spans if a <= segment < b]
        assert (reader == server.thread.name) == (share == "loop")
        assert health_status(server.address) == NOT_SERVING
        info = client.server_info()
        assert not info.serving and info.failure_reason == "CHECKSUM_MISMATCH"
        assert client.fence(m_dst).server_start_id == info.server_start_id
        assert not client.leased_blocks(m_dst)
    finally:
        src.close()
        dst.close()
