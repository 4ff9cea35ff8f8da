"""The chunk store's promises under capacity pressure and mixed layouts: a Store
that fails evicts nothing, every byte a chunk costs the server is counted, keys
and namespaces are bounded, and presence is per (namespace, key, layout)."""

from __future__ import annotations

import os

import pytest
import torch
from support import make_cache

from kvsvc.client import KVCacheClient
from kvsvc.errors import CapacityExhausted, InvalidRequest
from kvsvc.limits import MAX_KEY_BYTES, MAX_NAMESPACE_BYTES
from kvsvc.server.data.store import ALIGN, ChunkStore, meta_bytes

pytestmark = pytest.mark.slow  # starts servers or subprocesses

MiB = 1 << 20


def test_a_store_that_can_never_fit_evicts_nothing_and_is_not_retryable(make_server) -> None:
    srv = make_server(store_bytes=16 * MiB)
    with KVCacheClient(srv.address) as c:
        held = [(b"held-%d" % i, os.urandom(200 << 10)) for i in range(50)]
        for i in range(0, 50, 10):
            c.put("ns", held[i : i + 10])
        assert c.lookup([k for k, _ in held], namespace="ns") == 50
        with pytest.raises(CapacityExhausted) as ei:
            c.put("ns", [(b"big-%d" % i, b"x" * MiB) for i in range(20)])
        assert ei.value.reason == "REQUEST_EXCEEDS_CAPACITY"
        assert ei.value.retryable is False
        assert int(ei.value.metadata["requestBytes"]) > 16 * MiB
        # Nothing was evicted for a request that was refused.
        assert c.lookup([k for k, _ in held], namespace="ns") == 50
        info = c.server_info()
        assert (info.stored_chunks, info.evicted_chunks) == (50, 0)
        assert all(c.get("ns", k) == v for k, v in held)


def test_evictions_are_counted_in_results_and_server_info(make_server) -> None:
    srv = make_server(store_bytes=4 * MiB)
    with KVCacheClient(srv.address) as c:
        first = [(b"a%d" % i, os.urandom(MiB - 4096)) for i in range(3)]
        assert c.put("ns", first).evicted_chunks == 0
        r = c.put("ns", [(b"b%d" % i, os.urandom(MiB - 4096)) for i in range(2)])
        assert r.stored_chunks == 2
        info = c.server_info()
        assert r.evicted_chunks >= 1
        assert info.evicted_chunks == r.evicted_chunks
        assert info.stored_chunks == 5 - r.evicted_chunks
        assert info.used_bytes <= info.capacity_bytes


def test_a_reservation_that_fails_evicts_nothing_even_when_eviction_would_start() -> None:
    """Room for the request exists only if pinned (being read) chunks went: refused as
    retryable, and the unpinned chunks that eviction would have taken are all still there."""
    store = ChunkStore(1 * MiB, prefault=False)
    quarter = 256 << 10
    keys = [b"k%d" % i for i in range(3)]
    chunks, evicted = store.reserve("ns", [(k, quarter - 4096) for k in keys], "inline")
    assert evicted == 0
    for chunk in chunks:
        assert store.commit(chunk, [0])
    pinned = store.acquire_prefix("ns", [keys[2]], "inline")
    assert len(pinned) == 1
    used = store.used_bytes
    # Two unpinned chunks could be evicted, but the request needs more than that frees.
    with pytest.raises(CapacityExhausted) as ei:
        store.reserve("ns", [(b"new", 3 * quarter)], "inline")
    assert ei.value.retryable is True
    assert (len(store), store.evicted_total, store.used_bytes) == (3, 0, used)
    assert store.lookup("ns", keys, "inline") == 3
    store.release(pinned)
    got, evicted = store.reserve("ns", [(b"new", 3 * quarter)], "inline")
    assert evicted == 3 and store.evicted_total == 3 and len(got) == 1


def test_keys_and_namespaces_count_against_capacity(make_server) -> None:
    capacity = 64 << 10
    srv = make_server(store_bytes=capacity)
    key_bytes = MAX_KEY_BYTES
    per_chunk = ALIGN + meta_bytes("ns", b"k" * key_bytes, 1)
    with KVCacheClient(srv.address) as c:
        for i in range(16):
            c.put("ns", [(b"%04d" % i + b"k" * (key_bytes - 4), b"v")])
        info = c.server_info()
        # Without counting keys, 16 one-byte chunks (16 x 4 KiB) would all fit.
        assert info.stored_chunks == capacity // per_chunk < 16
        assert info.used_bytes == info.stored_chunks * per_chunk <= capacity
        assert info.evicted_chunks == 16 - info.stored_chunks


@pytest.mark.parametrize("rpc", ["put", "get", "lookup"])
def test_oversized_keys_and_namespaces_are_refused(client: KVCacheClient, rpc: str) -> None:
    calls = {
        "put": lambda ns, key: client.put(ns, [(key, b"v")]),
        "get": lambda ns, key: client.get(ns, key),
        "lookup": lambda ns, key: client.lookup([key], namespace=ns),
    }
    call = calls[rpc]
    with pytest.raises(InvalidRequest) as ei:
        call("ns", b"k" * (MAX_KEY_BYTES + 1))
    assert ei.value.reason == "KEY_TOO_LONG"
    assert ei.value.metadata["keyBytes"] == str(MAX_KEY_BYTES + 1)
    with pytest.raises(InvalidRequest) as ei:
        call("n" * (MAX_NAMESPACE_BYTES + 1), b"k")
    assert ei.value.reason == "NAMESPACE_TOO_LONG"
    assert client.server_info().used_bytes == 0


def test_inline_chunk_does_not_block_a_block_chunk_of_the_same_key(client, shm_dir) -> None:
    cache = make_cache(shm_dir, "src", torch.bfloat16, seed=3)
    m = client.map("ns", [cache.rank_region()])
    client.put("ns", [(b"K", b"inline bytes")])
    r = client.store(m, [(b"K", [0, 1])])
    assert (r.stored_chunks, r.present_chunks) == (1, 0)
    assert client.lookup([b"K"], mapping=m) == 1
    assert client.retrieve(m, [(b"K", [4, 5])]).loaded_chunks == 1
    for layer in cache.layers:
        assert torch.equal(layer.select(1, 4), layer.select(1, 0))
    assert client.get("ns", b"K") == b"inline bytes"
    # Storing the same key in the same layout again is "present".
    assert client.store(m, [(b"K", [2, 3])]).present_chunks == 1
