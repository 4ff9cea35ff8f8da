"""Store and Retrieve of multi-segment chunks over sealed memfds through a real
server, with the native copy loop and with the Python loop it falls back to,
copied on the event loop's thread and on the copy threads: the same bytes land,
and a chunk that went bad in the store is never reported loaded: it is dropped."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache, rank_context
from kvsvc.server.config import ServerConfig
from kvsvc.server.data import copies

pytestmark = pytest.mark.slow  # starts servers


def big_cache(name: str, seed: int | None) -> SharedKVCache:
    """4 layers x 48 blocks of 256 KiB (all layers): 12 MiB on a sealed memfd."""
    cache = SharedKVCache(name, num_layers=4, num_blocks=48, memfd=True)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in cache.layers:
            layer.view(torch.uint8).copy_(
                torch.randint(0, 256, layer.view(torch.uint8).shape, generator=g, dtype=torch.uint8)
            )
    return cache


def chunk_bytes(cache: SharedKVCache, ids: list[int]) -> list[torch.Tensor]:
    return [layer.index_select(cache.block_dim, torch.tensor(ids)) for layer in cache.layers]


@pytest.fixture(params=["native", "python"])
def loop(request, monkeypatch) -> str:
    if request.param == "native":
        assert copies.NATIVE is not None, "the native copy loop is not built: run `make native`"
    else:
        monkeypatch.setattr(copies, "NATIVE", None)
    return str(request.param)


@pytest.fixture(params=["on the loop", "on copy threads"])
def config(request, config: ServerConfig) -> ServerConfig:
    """Every copy here inline (up to 64 MiB), or none."""
    return config.replace(inline_copy_bytes=(64 << 20) if request.param == "on the loop" else 0)


@pytest.fixture
def copied_on(monkeypatch, server, config: ServerConfig) -> Iterator[set[str]]:
    """Names of the threads that ran chunk copies; checked against the setting."""
    names: set[str] = set()
    run = copies._BlockCopy.run

    def recording(self: copies._BlockCopy, a: int, b: int) -> list[copies.Digest]:
        names.add(threading.current_thread().name)
        return run(self, a, b)

    monkeypatch.setattr(copies._BlockCopy, "run", recording)
    yield names
    if config.data.inline_copy_bytes:
        assert names == {server.thread.name}
    else:
        assert names and all(n.startswith("kvsvc-copy-") for n in names)


def test_multi_segment_chunks_round_trip_bit_exact(loop, copied_on, client: KVCacheClient) -> None:
    src, dst = big_cache("src", seed=1), big_cache("dst", seed=None)
    try:
        m_src = client.map(
            "ns", [src.rank_region(rank_context(), token=client.register_memfd(src.fd))]
        )
        m_dst = client.map(
            "ns", [dst.rank_region(rank_context(), token=client.register_memfd(dst.fd))]
        )
        # 3 MiB and 2.75 MiB chunks: runs cross segment boundaries; 5.75 MiB in
        # all is copied by both threads; scattered block order.
        a, b = [5, 0, 17, 3, 9, 40, 41, 42, 30, 31, 2, 1], [7, 6, 8, 20, 21, 22, 33, 34, 47, 46, 45]
        assert client.store(m_src, [(b"a", a), (b"b", b)]).stored_chunks == 2
        a2, b2 = list(range(12)), list(range(20, 31))
        assert client.retrieve(m_dst, [(b"a", a2), (b"b", b2)]).loaded_chunks == 2
        for x, y in zip(chunk_bytes(src, a + b), chunk_bytes(dst, a2 + b2), strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    finally:
        src.close()
        dst.close()


def test_a_chunk_corrupted_in_the_store_is_not_loaded_and_dropped(
    loop, copied_on, server, client: KVCacheClient
) -> None:
    src, dst = big_cache("src", seed=2), big_cache("dst", seed=None)
    try:
        m_src = client.map(
            "ns", [src.rank_region(rank_context(), token=client.register_memfd(src.fd))]
        )
        m_dst = client.map(
            "ns", [dst.rank_region(rank_context(), token=client.register_memfd(dst.fd))]
        )
        # 2 MiB chunks: 2 segments each; the second's second segment goes bad
        client.store(m_src, [(b"a", list(range(8))), (b"k", list(range(8, 16)))])
        store = server.server.servicer.store
        (chunk,) = [c for key, c in store._chunks.items() if key[:2] == ("ns", b"k")]
        store.view[chunk.offset + copies.SEGMENT_BYTES + 5] ^= 0xFF
        got = client.retrieve(m_dst, [(b"a", list(range(16, 24))), (b"k", list(range(24, 32)))])
        assert (got.loaded_chunks, got.loaded_bytes) == (1, chunk.size)
        for x, y in zip(
            chunk_bytes(src, list(range(8))), chunk_bytes(dst, list(range(16, 24))), strict=True
        ):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        assert store.checksum_failures == 1 and store.get("ns", b"k", chunk.layout) is None
        assert client.lookup([b"a", b"k"], mapping=m_dst) == 1  # dropped: a miss now
        assert client.server_info().serving  # a request's failure, not the server's
    finally:
        src.close()
        dst.close()
