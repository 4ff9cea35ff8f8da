"""Plain shared-memory files passed by fd (``shared_file=True``): memory an engine
cannot seal (LMCache's L1 arena, vLLM's /dev/shm offload file). The native loop
copies them mapped, inside guarded copies that turn the SIGBUS of a page its owner
truncated away into REGION_TRUNCATED; the Python loop with positional I/O. Either
way a truncate is a typed error and the server serves on; the client proves access
by the fd it passes, and the lease bounds how long it is held."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from support import SERVING, health_status, make_cache

from kvsvc.client import KVCacheClient
from kvsvc.errors import InvalidRequest, RegionUnavailable
from kvsvc.server.data import copies
from kvsvc.server.data.checksum import SEGMENT_BYTES
from kvsvc.server.data.claims import Claims
from kvsvc.server.data.nativecopy import TRUNCATED
from kvsvc.v1 import kv_cache_service_pb2 as pb

pytestmark = pytest.mark.slow  # starts servers


@pytest.fixture(params=["native", "python"])
def loop(request, monkeypatch) -> str:
    """Copies on the native loop (mapped, guarded) or the Python loop (positional I/O)."""
    if request.param == "native":
        native = copies.NATIVE
        assert native is not None, "the native copy loop is not built: run `make native`"
        assert native.guards, "this build of the native loop has no guarded copies"
    else:
        monkeypatch.setattr(copies, "NATIVE", None)
    return str(request.param)


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


def test_a_passed_shm_file_round_trips_bit_exact(loop, server, client, shm_dir) -> None:
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


def test_a_truncated_passed_file_fails_store_and_retrieve_typed(loop, server, shm_dir) -> None:
    """The owner truncates its file under a live mapping: Store (reads the pages
    past the end) and Retrieve (would write them) fail REGION_TRUNCATED, nothing
    is stored from it, and the server process serves another client on."""
    src, other = make_cache(shm_dir, "src", seed=3), make_cache(shm_dir, "other", seed=4)
    fd = os.open(src.path, os.O_RDWR | os.O_CLOEXEC)
    try:
        with KVCacheClient(server.address) as owner:
            m = owner.map("ns", [passed_region(src, owner.register_memfd(fd, shared_file=True))])
            assert owner.store(m, [(b"kept", [10, 11])]).stored_chunks == 1
            os.ftruncate(fd, 4096)
            with pytest.raises(RegionUnavailable) as e:
                owner.store(m, [(b"lost", [10, 11])])
            assert e.value.reason == "REGION_TRUNCATED"
            with pytest.raises(RegionUnavailable) as e:
                owner.retrieve(m, [(b"kept", [10, 11])])
            assert e.value.reason == "REGION_TRUNCATED"
            assert owner.lookup(m, [b"lost"]) == 0
        with KVCacheClient(server.address) as c:
            dst = make_cache(shm_dir, "dst")
            m2 = c.map("ns2", [other.rank_region()])
            m3 = c.map("ns2", [dst.rank_region()])
            assert c.store(m2, [(b"x", [5, 6])]).stored_chunks == 1
            assert c.retrieve(m3, [(b"x", [1, 2])]).loaded_chunks == 1
            for x, y in zip(blocks(other, [5, 6]), blocks(dst, [1, 2]), strict=True):
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        assert health_status(server.address) == SERVING
    finally:
        os.close(fd)


def mapped_file(shm_dir, size: int) -> tuple[int, mmap.mmap, int]:
    fd = os.open(shm_dir / "f", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    return fd, mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


@pytest.mark.parametrize("to_store", [True, False], ids=["store", "retrieve"])
def test_the_native_guarded_copy_catches_the_sigbus_of_a_truncated_page(
    shm_dir, to_store: bool
) -> None:
    """Below the server's checks: a guarded copy (one span, and tasks sharing a
    chunk by claims) over pages truncated away returns TRUNCATED, in this process."""
    native = copies.NATIVE
    assert native is not None and native.guards, "run `make native`"
    size = 3 * SEGMENT_BYTES
    fd, mm, base = mapped_file(shm_dir, size)
    chunk = (ctypes.c_char * size)()
    try:
        runs = np.array([[base, 0, size]], dtype=np.uint64)
        digests = (ctypes.c_uint32 * 3)()
        failed, _ = native.copy(
            runs, ctypes.addressof(chunk), 0, size, digests, to_store=to_store, guarded=True
        )
        assert failed == (-1 if to_store else 0)  # a Retrieve of zeros fails its check
        os.ftruncate(fd, SEGMENT_BYTES + 4096)
        failed, _ = native.copy(
            runs, ctypes.addressof(chunk), 0, size, digests, to_store=True, guarded=True
        ) if to_store else native.copy(
            runs, ctypes.addressof(chunk), SEGMENT_BYTES, size, digests, to_store=False,
            guarded=True,
        )  # fmt: skip
        assert failed == TRUNCATED
        claims = Claims([(1, 2), (2, 3)], None if to_store else [0, 0, 0])
        results = [
            native.claim(runs, ctypes.addressof(chunk), size, claims, me, to_store=to_store,
                         guarded=True)[0]
            for me in range(2)
        ]  # fmt: skip
        assert TRUNCATED in results
    finally:
        mm.close()
        os.close(fd)


def test_a_sigbus_outside_a_guarded_copy_still_kills(shm_dir) -> None:
    """The handler takes only faults of a guarded copy's pages: any other SIGBUS
    ends the process as it would without it."""
    code = f"""
import ctypes, mmap, os
from kvsvc.server.data import copies
assert copies.NATIVE is not None and copies.NATIVE.guards
fd = os.open({str(shm_dir / "g")!r}, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 16)
mm = mmap.mmap(fd, 1 << 16)
os.ftruncate(fd, 0)
print("touching", flush=True)
ctypes.string_at(ctypes.addressof(ctypes.c_char.from_buffer(mm)), 16)
print("survived", flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert "touching" in out.stdout, out.stderr
    assert "survived" not in out.stdout
    assert out.returncode == -signal.SIGBUS, (out.returncode, out.stderr)
