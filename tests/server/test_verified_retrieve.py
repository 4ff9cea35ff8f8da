"""A Retrieve checks every segment in the pass that copies it into the engine's
blocks: bits flipped in the store's copy of a chunk end the loaded prefix before
that chunk, whatever its size and however it is asked for (unary, on the session,
several at once, inline, streamed with the Redis tier). The chunks reported loaded
are bit-exact; the bad one is dropped from the store, counted, announced as
removed on the events stream, and the server keeps serving."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redis_servers import RedisServer, require_redis
from support import SERVING, ServerThread, flip, health_status

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.client.kvcache import SharedKVCache, rank_context
from kvsvc.server.config import ServerConfig
from kvsvc.server.data import copies
from kvsvc.v1 import kv_cache_service_pb2 as pb

pytestmark = pytest.mark.slow  # starts servers

BLOCKS = 96  # 256 KiB per block (4 layers, K and V): 24 MiB per cache
WAIT_S = 20.0  # for the events stream, on a loaded CI host


def cache(name: str, seed: int | None) -> SharedKVCache:
    c = SharedKVCache(name, num_layers=4, num_blocks=BLOCKS, memfd=True)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in c.layers:
            u8 = layer.view(torch.uint8)
            u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8))
    return c


def chunk_bytes(c: SharedKVCache, ids: list[int]) -> list[torch.Tensor]:
    idx = torch.tensor(ids)
    return [layer.index_select(c.block_dim, idx).view(torch.uint8) for layer in c.layers]


def same(a: SharedKVCache, a_ids: list[int], b: SharedKVCache, b_ids: list[int]) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(chunk_bytes(a, a_ids), chunk_bytes(b, b_ids), strict=True)
    )


class Removals:
    """Keys the events stream announced as removed after a failed check (a presence
    index's batches, read on its thread)."""

    def __init__(self, client: KVCacheClient, namespace: str) -> None:
        self.keys: set[bytes] = set()
        self._cond = threading.Condition()
        self.index = client.presence(namespace, on_batch=self._batch)
        assert self.index.wait_fresh(WAIT_S)

    def _batch(self, batch: pb.EventBatch) -> None:
        with self._cond:
            for e in batch.events:
                if e.HasField("removed") and e.removed.reason == pb.REMOVAL_REASON_CHECK_FAILED:
                    self.keys.update(e.removed.keys)
            self._cond.notify_all()

    def wait(self, key: bytes) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: key in self.keys, WAIT_S)


@pytest.fixture(params=["native", "python"])
def loop(request, monkeypatch) -> str:
    if request.param == "native":
        assert copies.NATIVE is not None, "the native copy loop is not built: run `make native`"
    else:
        monkeypatch.setattr(copies, "NATIVE", None)
    return str(request.param)


@pytest.fixture
def caches() -> Iterator[tuple[SharedKVCache, SharedKVCache]]:
    src, dst = cache("src", seed=30), cache("dst", seed=None)
    yield src, dst
    src.close()
    dst.close()


def mapped(client: KVCacheClient, c: SharedKVCache) -> MappingHandle:
    return client.map("ns", [c.rank_region(rank_context(), token=client.register_memfd(c.fd))])


# 1 block: one segment; 9 blocks: 2.25 MiB, a partial last segment; 24 blocks:
# 6 MiB, shared by the copy threads.
@pytest.mark.parametrize("blocks", [1, 9, 24])
@pytest.mark.parametrize("shape", ["unary", "session", "retrieve_many"])
def test_a_flipped_bit_is_never_loaded(
    loop: str, server: ServerThread, caches, blocks: int, shape: str
) -> None:
    src, dst = caches
    rng = random.Random(f"{loop}-{blocks}-{shape}")
    with KVCacheClient(server.address, session=shape != "unary") as client:
        m_src, m_dst = mapped(client, src), mapped(client, dst)
        ids = [list(range(i * blocks, (i + 1) * blocks)) for i in range(3)]
        keys = [b"c%d" % i for i in range(3)]
        assert client.store(m_src, list(zip(keys, ids, strict=True))).stored_chunks == 3
        removals = Removals(client, "ns")
        store = server.server.servicer.store
        bad = rng.randrange(3)
        flip(store, "ns", keys[bad], rng)
        out = [list(range(BLOCKS - (i + 1) * blocks, BLOCKS - i * blocks)) for i in range(3)]
        request = list(zip(keys, out, strict=True))
        if shape == "retrieve_many":  # beside it, a Retrieve of the good chunks before it
            got, other = client.retrieve_many(m_dst, [request, request[:bad]])
            assert isinstance(other, pb.RetrieveResult) and other.loaded_chunks == bad
        else:
            got = client.retrieve(m_dst, request)
        assert isinstance(got, pb.RetrieveResult)
        assert got.loaded_chunks == bad  # the prefix ends before the bad chunk
        assert got.loaded_bytes == bad * blocks * m_src.block_bytes
        assert all(same(src, ids[i], dst, out[i]) for i in range(bad))
        assert store.checksum_failures == 1
        assert store.get("ns", keys[bad], m_dst.layout_fingerprint) is None
        assert removals.wait(keys[bad]), removals.keys
        # Dropped: a miss from now on, until stored again.
        assert client.lookup(keys, mapping=m_dst) == bad
        assert client.retrieve(m_dst, request).loaded_chunks == bad
        assert client.store(m_src, list(zip(keys, ids, strict=True))).stored_chunks == 1
        assert client.retrieve(m_dst, request).loaded_chunks == 3
        assert all(same(src, ids[i], dst, out[i]) for i in range(3))
        assert not client.leased_blocks(m_src) and not client.leased_blocks(m_dst)
        assert health_status(server.address) == SERVING and client.server_info().serving


@pytest.mark.parametrize("size", [1, 5000, (2 << 20) + 7])
def test_an_inline_get_never_returns_a_flipped_bit(server: ServerThread, size: int) -> None:
    rng = random.Random(size)
    values = [rng.randbytes(size) for _ in range(3)]
    keys = [b"i%d" % i for i in range(3)]
    with KVCacheClient(server.address) as client:
        client.put("ns", list(zip(keys, values, strict=True)))
        removals = Removals(client, "ns")
        flip(server.server.servicer.store, "ns", keys[1], rng)
        assert client.get_many("ns", keys) == values[:1]
        assert removals.wait(keys[1])
        assert client.get_many("ns", keys) == values[:1]
        assert client.server_info().serving


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    r = RedisServer(tmp_path / "redis")
    yield r
    r.kill()


def written(st: ServerThread, n: int) -> None:
    """Wait until the server's Redis write-behind has written ``n`` chunks."""
    tier = st.server.servicer.tiers.named("redis")
    assert tier is not None
    end = time.monotonic() + WAIT_S
    while tier.writes < n and time.monotonic() < end:
        time.sleep(0.02)
    assert tier.writes == n


def test_a_streamed_retrieve_ends_before_a_bad_local_chunk(
    redis_server: RedisServer, shm_dir: Path, caches
) -> None:
    """The local prefix and the keys fetched from Redis are one streamed copy: a bad
    local chunk ends the prefix there, and no later part is copied in."""
    src, dst = caches
    config = ServerConfig.from_settings(
        listen="127.0.0.1:0",
        store_bytes=64 << 20,
        shm_dir=str(shm_dir),
        remote=redis_server.url,
        remote_lookup_budget=5.0,
    )
    writer, reader = ServerThread(config), ServerThread(config)
    try:
        ids = [list(range(i * 4, (i + 1) * 4)) for i in range(4)]
        keys = [b"r%d" % i for i in range(4)]
        with KVCacheClient(writer.address) as cw:
            assert cw.store(mapped(cw, src), list(zip(keys, ids, strict=True))).stored_chunks == 4
            written(writer, 4)
        with KVCacheClient(reader.address) as client:
            m_src, m_dst = mapped(client, src), mapped(client, dst)
            local = list(zip(keys[:2], ids[:2], strict=True))
            assert client.store(m_src, local).stored_chunks == 2  # r2, r3 only in Redis
            written(reader, 2)  # before the flip: a write-behind would carry it
            store = reader.server.servicer.store
            flip(store, "ns", keys[1], random.Random(1))
            out = [list(range(40 + i * 4, 44 + i * 4)) for i in range(4)]
            got = client.retrieve(m_dst, list(zip(keys, out, strict=True)))
            assert got.loaded_chunks == 1
            assert same(src, ids[0], dst, out[0])
            assert store.checksum_failures == 1
            assert client.server_info().serving
            # Redis still holds a good copy: the next Retrieve loads everything.
            assert client.retrieve(m_dst, list(zip(keys, out, strict=True))).loaded_chunks == 4
            assert all(same(src, ids[i], dst, out[i]) for i in range(4))
    finally:
        writer.stop()
        reader.stop()
