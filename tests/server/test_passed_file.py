"""Plain shared-memory files passed by fd (``shared_file=True``): memory an engine
cannot seal (vLLM's /dev/shm offload file). The server never maps them: it copies
with positional I/O, so a truncate is a typed error, not a SIGBUS; the client
proves access by the fd it passes, and the lease bounds how long it is held."""

from __future__ import annotations

import os
import time

import pytest
import torch
from support import SERVING, health_status, make_cache

from kvsvc.client import KVCacheClient
from kvsvc.errors import InvalidRequest, RegionUnavailable
from kvsvc.v1 import kv_cache_service_pb2 as pb

pytestmark = pytest.mark.slow  # starts servers


def passed_region(cache, token: str) -> pb.RankRegion:
    """The cache's region, named by the token of its passed file instead of its name."""
    region = cache.rank_region()
    for t in region.tensors:
        t.handle.CopyFrom(
            pb.MemoryHandle(sealed_memfd=pb.SealedMemfdHandle(token=token, size_bytes=cache.size))
        )
    return region


def blocks(cache, ids: list[int]) -> list[torch.Tensor]:
    return [layer.index_select(cache.block_dim, torch.tensor(ids)) for layer in cache.layers]


def test_a_passed_shm_file_round_trips_bit_exact(server, client, shm_dir) -> None:
    src, dst = make_cache(shm_dir, "src", seed=5), make_cache(shm_dir, "dst")
    fds = [os.open(c.path, os.O_RDWR | os.O_CLOEXEC) for c in (src, dst)]
    try:
        tokens = [client.register_memfd(fd, shared_file=True) for fd in fds]
        m_src = client.map("ns", [passed_region(src, tokens[0])])
        m_dst = client.map("ns", [passed_region(dst, tokens[1])])
        assert client.store(m_src, [(b"a", [0, 1]), (b"b", [7])]).stored_chunks == 2
        assert client.retrieve(m_dst, [(b"a", [4, 2]), (b"b", [9])]).loaded_chunks == 2
        for x, y in zip(blocks(src, [0, 1, 7]), blocks(dst, [4, 2, 9]), strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        # The owner shrinks its file under the mapping: a typed error, the server serves on.
        os.ftruncate(fds[1], 4096)
        with pytest.raises(RegionUnavailable) as e:
            client.retrieve(m_dst, [(b"a", [10, 11])])
        assert e.value.reason == "REGION_TRUNCATED"
        assert health_status(server.address) == SERVING
    finally:
        for fd in fds:
            os.close(fd)


def test_only_regular_files_open_read_write_are_taken(server, client, shm_dir) -> None:
    cache = make_cache(shm_dir, "c")
    ro = os.open(cache.path, os.O_RDONLY | os.O_CLOEXEC)
    r, w = os.pipe()
    plain = os.open(cache.path, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in (ro, r):
            with pytest.raises(InvalidRequest) as e:
                client.register_memfd(fd, shared_file=True)
            assert e.value.reason == "FD_NOT_A_FILE"
        # Without shared_file a plain file is still refused: the server would map it.
        with pytest.raises(InvalidRequest) as e:
            client.register_memfd(plain)
        assert e.value.reason == "FD_NOT_SEALED"
    finally:
        for fd in (ro, r, w, plain):
            os.close(fd)
    assert health_status(server.address) == SERVING


def test_a_passed_file_is_released_when_its_lease_ends(server, shm_dir) -> None:
    cache = make_cache(shm_dir, "c", seed=2)
    fd = os.open(cache.path, os.O_RDWR | os.O_CLOEXEC)
    servicer = server.server.servicer
    try:
        with KVCacheClient(server.address) as owner:
            token = owner.register_memfd(fd, shared_file=True)
            m = owner.map("ns", [passed_region(cache, token)])
            owner.store(m, [(b"k", [3])])
            assert m.mapping_id in servicer.mappings and servicer.fds.leases == 1
        # The lease connection closed: the server lets go of the file and its mapping.
        end = time.monotonic() + 10
        while m.mapping_id in servicer.mappings and time.monotonic() < end:
            time.sleep(0.02)
        assert m.mapping_id not in servicer.mappings
        assert servicer.fds.leases == 0 and len(servicer.fds) == 0
    finally:
        os.close(fd)
