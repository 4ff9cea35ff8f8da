"""Sealed memfd regions passed over the server's fd socket: the fast CPU region
kind. The server maps them, so what makes that safe (the shrink seal) and what
bounds the fds it holds (tokens, expiry) is tested here, on real sockets."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import time

import pytest
import torch
from support import LAYOUTS, SERVING, ServerThread, fill_random, health_status, make_cache

from kvsvc.client import AsyncKVCacheClient, KVCacheClient, fdpass
from kvsvc.client.kvcache import rank_context
from kvsvc.errors import CapacityExhausted, InvalidRequest, Unimplemented
from kvsvc.server.data import fdbroker
from kvsvc.v1 import kv_cache_service_pb2 as pb

pytestmark = pytest.mark.slow  # starts servers or subprocesses


def blocks(cache, ids: list[int]) -> list[torch.Tensor]:
    return [layer.index_select(cache.block_dim, torch.tensor(ids)) for layer in cache.layers]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def memfd_region(token: str, size: int = 4096) -> pb.RankRegion:
    """One uint8 tensor of 4 blocks of 1 KiB on a sealed memfd handle."""
    return pb.RankRegion(
        context=rank_context(),
        tensors=[
            pb.KVTensor(
                handle=pb.MemoryHandle(
                    sealed_memfd=pb.SealedMemfdHandle(token=token, size_bytes=size)
                ),
                shape=[4, 1024],
                strides=[1024, 1],
                dtype=pb.DTYPE_UINT8,
            )
        ],
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_memfd_round_trip_tp2_is_bit_exact(client, shm_dir, layout) -> None:
    src = [make_cache(shm_dir, f"src{r}", layout=layout, seed=r, memfd=True) for r in range(2)]
    dst = [make_cache(shm_dir, f"dst{r}", layout=layout, memfd=True) for r in range(2)]
    ctx = [rank_context(tp_rank=r, tp_size=2) for r in range(2)]
    m_src = client.map(
        "ns", [c.rank_region(ctx[i], token=client.register_memfd(c.fd)) for i, c in enumerate(src)]
    )
    m_dst = client.map(
        "ns", [c.rank_region(ctx[i], token=client.register_memfd(c.fd)) for i, c in enumerate(dst)]
    )
    assert client.store(m_src, [(b"a", [0, 1, 2]), (b"b", [9, 3, 7])]).stored_chunks == 2
    got = client.retrieve(m_dst, [(b"a", [11, 10, 4]), (b"b", [5, 6, 8])])
    assert got.loaded_chunks == 2
    for r in range(2):
        assert same(blocks(src[r], [0, 1, 2, 9, 3, 7]), blocks(dst[r], [11, 10, 4, 5, 6, 8]))


def test_memfd_and_file_regions_hold_the_same_bytes(client, shm_dir) -> None:
    """A chunk stored from a memfd loads into a file region, and back: one layout."""
    mem = make_cache(shm_dir, "mem", seed=3, memfd=True)
    file = make_cache(shm_dir, "file")
    m_mem = client.map("ns", [mem.rank_region(token=client.register_memfd(mem.fd))])
    m_file = client.map("ns", [file.rank_region()])
    assert m_mem.layout_fingerprint == m_file.layout_fingerprint
    client.store(m_mem, [(b"k", [1, 2])])
    client.retrieve(m_file, [(b"k", [5, 6])])
    assert same(blocks(mem, [1, 2]), blocks(file, [5, 6]))
    client.store(m_file, [(b"k2", [5, 6])])
    client.retrieve(m_mem, [(b"k2", [8, 9])])
    assert same(blocks(mem, [1, 2]), blocks(mem, [8, 9]))


def test_a_mapped_memfd_cannot_shrink_and_outlives_its_owner(server, client, shm_dir) -> None:
    cache = make_cache(shm_dir, "c", seed=1, memfd=True)
    m = client.map("ns", [cache.rank_region(token=client.register_memfd(cache.fd))])
    with pytest.raises(PermissionError):
        os.ftruncate(cache.fd, 0)  # the seal: what makes the server's mmap safe
    expected = [t.clone() for t in blocks(cache, [2, 3])]
    client.store(m, [(b"k", [0, 1])])
    cache.close()  # the owner lets go of its fd and mapping: the server's stays valid
    client.store(m, [(b"k2", [2, 3])])
    assert client.retrieve(m, [(b"k", [4, 5])]).loaded_chunks == 1
    out = make_cache(shm_dir, "out")
    client.retrieve(client.map("ns", [out.rank_region()]), [(b"k2", [0, 1])])
    assert same(expected, blocks(out, [0, 1]))
    assert health_status(server.address) == SERVING
    client.unmap(m)


def test_fds_that_are_not_sealed_memfds_are_refused(server, client, tmp_path) -> None:
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4096)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain, 4096)
    try:
        for fd in (unsealed, plain):
            with pytest.raises(InvalidRequest) as e:
                client.register_memfd(fd)
            assert e.value.reason == "FD_NOT_SEALED"
            assert "F_SEAL_SHRINK" in e.value.message
    finally:
        os.close(unsealed)
        os.close(plain)
    assert len(server.server.servicer.fds) == 0
    assert health_status(server.address) == SERVING


def test_malformed_passes_are_answered_and_the_socket_keeps_serving(server, client) -> None:
    path = client.server_info().fd_socket
    a, b = os.memfd_create("a"), os.memfd_create("b")
    try:
        for msg, fds in ((b"hello", [a]), (fdpass.MAGIC, [a, b]), (fdpass.MAGIC, [])):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.settimeout(5)
                s.connect(path)
                socket.send_fds(s, [msg], fds)
                reply = s.recv(65536)
            assert reply[:1] == b"\1", reply
            err = fdpass.error_pb2.RemoteError.FromString(reply[1:])
            assert err.reason == "FD_PASS_MALFORMED"
    finally:
        os.close(a)
        os.close(b)
    good = fdpass.make_sealed_memfd("good", 4096)
    try:
        assert len(client.register_memfd(good)) == 32
    finally:
        os.close(good)


def test_unknown_token_and_oversized_handle_fail_fast(client) -> None:
    fd = fdpass.make_sealed_memfd("small", 4096)
    try:
        token = client.register_memfd(fd)
    finally:
        os.close(fd)  # the server holds its own copy until the token expires

    started = time.monotonic()
    with pytest.raises(InvalidRequest) as e:
        client.map("ns", [memfd_region("f" * 32)], timeout=10)
    assert e.value.reason == "FD_TOKEN_UNKNOWN"
    with pytest.raises(InvalidRequest) as e:
        client.map("ns", [memfd_region(token, 8192)], timeout=10)
    assert e.value.reason == "REGION_TOO_SMALL"
    assert time.monotonic() - started < 5  # not retried until the deadline
    assert client.map("ns", [memfd_region(token)]).num_blocks == 4


def test_server_without_fd_socket_says_so(make_server, shm_dir) -> None:
    from kvsvc.client import KVCacheClient

    st = make_server(fd_socket="off")
    with KVCacheClient(st.address) as c:
        assert c.server_info().fd_socket == ""
        fd = fdpass.make_sealed_memfd("x", 4096)
        try:
            with pytest.raises(Unimplemented) as e:
                c.register_memfd(fd)
        finally:
            os.close(fd)
        assert e.value.reason == "FD_PASSING_DISABLED"
        with pytest.raises(InvalidRequest) as e2:
            c.map("ns", [memfd_region("t")])
        assert e2.value.reason == "FD_PASSING_DISABLED"


def test_passed_fds_expire_and_are_bounded(tmp_path) -> None:
    broker = fdbroker.FdBroker(str(tmp_path / "fds"), ttl=3, max_tokens=2)  # outlasts the steps
    broker.start()
    fds = [fdpass.make_sealed_memfd(f"m{i}", 4096) for i in range(3)]
    try:
        tokens = [fdpass.send_fd(broker.path, fd) for fd in fds[:2]]
        with pytest.raises(CapacityExhausted) as e:
            fdpass.send_fd(broker.path, fds[2])
        assert e.value.reason == "FD_TOKENS_EXHAUSTED"
        dup, size, owner = broker.open(tokens[0])
        os.close(dup)
        assert size == 4096
        assert owner is not None and not owner.gone()  # this process passed it
        owner.close()
        time.sleep(3.1)
        with pytest.raises(InvalidRequest):
            broker.open(tokens[0])
        assert len(broker) == 0  # expired fds are closed, not just forgotten
        fdpass.send_fd(broker.path, fds[2])
    finally:
        broker.close()
        for fd in fds:
            os.close(fd)
    assert not os.path.exists(broker.path)


def test_async_client_registers_and_stop_removes_the_socket(config, shm_dir) -> None:
    st = ServerThread(config)
    cache = make_cache(shm_dir, "a", seed=5, memfd=True)

    async def go() -> str:
        async with AsyncKVCacheClient(st.address) as c:
            token = await c.register_memfd(cache.fd)
            m = await c.map("ns", [cache.rank_region(token=token)])
            await c.store(m, [(b"k", [0])])
            return (await c.server_info()).fd_socket

    path = asyncio.run(go())
    assert os.path.exists(path)
    st.stop()
    assert not os.path.exists(path)
    fill_random(cache, 0)
    cache.close()


def test_sealed_memfd_helper_seals_size() -> None:
    fd = fdpass.make_sealed_memfd("s", 8192)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        assert fdbroker.check_sealed(fd) == 8192
    finally:
        os.close(fd)


def test_auto_fd_socket_that_cannot_be_made_turns_memfds_off_loudly(
    make_server, tmp_path, caplog
) -> None:
    from kvsvc.client import KVCacheClient
    from kvsvc.server.config import ServerConfig
    from kvsvc.server.ops.lifecycle import Server

    missing = tmp_path / "no-such-dir"
    st = make_server(shm_dir=str(missing))
    with KVCacheClient(st.address) as c:
        assert c.server_info().fd_socket == ""
    assert "sealed memfd regions are off" in caplog.text

    async def make() -> Server:
        cfg = ServerConfig.from_settings(
            listen="127.0.0.1:0", store_bytes=1 << 20, fd_socket=str(missing / "s")
        )
        return Server(cfg)

    with pytest.raises(OSError):  # a path the operator chose must work
        asyncio.run(make())


OWNER = """
import os, sys
from kvsvc.client import fdpass
fd = fdpass.make_sealed_memfd("owned", 4096)
os.pwrite(fd, bytes(range(256)) * 16, 0)
print(fdpass.send_fd(sys.argv[1], fd), flush=True)
sys.stdin.readline()  # exit when told
"""


def test_a_memfd_mapping_is_released_once_its_owner_exits(server, client, shm_dir) -> None:
    """A dead engine's memory must not stay alive in the server's mapping: once the
    process that passed the memfd has exited, the next Map releases its mapping,
    as it does for a deleted shm file."""
    import subprocess
    import sys

    from kvsvc.errors import MappingLost

    path = client.server_info().fd_socket
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        token = owner.stdout.readline().decode().strip()

        m = client.map("ns", [memfd_region(token)])
        client.store(m, [(b"k", [1])])
        other = make_cache(shm_dir, "other")
        client.map("ns", [other.rank_region()])  # owner alive: the mapping stays
        client.store(m, [(b"k2", [2])])
    finally:
        owner.communicate(b"\n", timeout=30)
    assert owner.returncode == 0
    client.map("ns", [make_cache(shm_dir, "third").rank_region()])
    with pytest.raises(MappingLost):
        client.store(m, [(b"k3", [3])])
    assert server.server.servicer.mappings.keys().isdisjoint({m.mapping_id})


# --- the fd socket under a misbehaving local process (issue 12, defect 8) ---
PASSER = """
import os, sys
from kvsvc.client import fdpass
fd = fdpass.make_sealed_memfd("other", 4096)
print(fdpass.send_fd(sys.argv[1], fd, 20), flush=True)
"""


def open_fds() -> int:
    """This process's open fds: the in-process server's included."""
    return len(os.listdir("/proc/self/fd"))


def eventually(check, timeout: float = 20.0) -> bool:
    """Whether ``check()`` turns true within ``timeout`` (polled)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def metric(st: ServerThread, name: str) -> float | None:
    return st.server.servicer.metrics.registry.get_sample_value(name)


def test_silent_peers_do_not_delay_a_registration(make_server, monkeypatch, shm_dir) -> None:
    """Three peers connect and say nothing, and stay connected for the whole test
    (their timeout is 30 s here): a registration must not wait for any of them.
    The old server served one peer at a time, 5 s each: 15 s before this one."""
    monkeypatch.setattr(fdbroker, "FD_PEER_TIMEOUT_S", 30.0)
    st = make_server()
    path = st.server.servicer.fds.path
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    cache = make_cache(shm_dir, "c", seed=2, memfd=True)
    try:
        for s in silent:
            s.connect(path)
        token = fdpass.send_fd(path, cache.fd, timeout=10)
        for s in silent:  # still connected: the registration did not wait them out
            with pytest.raises(BlockingIOError):
                s.recv(1, socket.MSG_DONTWAIT)
        # the silent three were accepted before this one, and are still served
        assert eventually(lambda: metric(st, "kvsvc_fd_socket_peers") == 3)
        with KVCacheClient(st.address) as c:
            assert c.map("ns", [cache.rank_region(token=token)]).num_blocks == cache.num_blocks
    finally:
        for s in silent:
            s.close()
    assert eventually(lambda: metric(st, "kvsvc_fd_socket_peers") == 0)


def test_a_silent_peer_gets_a_typed_answer_and_is_closed(tmp_path) -> None:
    broker = fdbroker.FdBroker(str(tmp_path / "fds"), peer_timeout=0.3)
    broker.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(20)
            s.connect(broker.path)
            reply = s.recv(65536)
            assert reply[:1] == b"\1", reply
            err = fdpass.error_pb2.RemoteError.FromString(reply[1:])
            assert err.reason == "FD_SOCKET_TIMEOUT"
            assert s.recv(1) == b""  # closed by the server
        assert eventually(lambda: broker.peers == 0)
    finally:
        broker.close()


def test_silent_peers_beyond_the_most_served_are_refused(tmp_path) -> None:
    broker = fdbroker.FdBroker(str(tmp_path / "fds"), peer_timeout=600, max_peers=1)
    broker.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as a:
            a.connect(broker.path)
            assert eventually(lambda: broker.peers == 1)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as b:
                b.settimeout(20)
                b.connect(broker.path)  # a second silent peer, over max_peers
                err = fdpass.error_pb2.RemoteError.FromString(b.recv(65536)[1:])
                assert err.reason == "FD_SOCKET_BUSY" and err.retryable
        assert eventually(lambda: broker.peers == 0)
    finally:
        broker.close()


def test_a_flooding_peer_hits_its_cap_and_others_still_register(make_server, monkeypatch) -> None:
    """One process passing fds as fast as it can is stopped at its own cap (the old
    server took 1024, locking everyone out for 60 s, and held 2 fds for each):
    another process still registers, and the server's fd count stays bounded."""
    import subprocess
    import sys

    from kvsvc.server import config

    for name in ("FD_TOKEN_TTL_S", "FD_TOKEN_UNUSED_TTL_S"):  # none expires here
        monkeypatch.setattr(fdbroker, name, 600.0)
    server = make_server()
    path = server.server.servicer.fds.path
    fd = fdpass.make_sealed_memfd("flood", 4096)
    before = open_fds()
    passed = 0
    try:
        with pytest.raises(CapacityExhausted) as e:
            for _ in range(2000):
                fdpass.send_fd(path, fd, timeout=20)
                passed += 1
    finally:
        os.close(fd)
    other = subprocess.run(
        [sys.executable, "-c", PASSER, path], capture_output=True, timeout=60, check=True
    )
    with KVCacheClient(server.address) as client:
        assert client.map("ns", [memfd_region(other.stdout.decode().strip())]).num_blocks == 4
    # one fd per token, one pidfd per process, the mapping (its mmap and owner
    # pidfd), and a few sockets in flight; the old server held 2 per token
    assert eventually(lambda: open_fds() - before <= passed + 10), open_fds() - before
    assert e.value.reason == "FD_TOKENS_EXHAUSTED"
    assert e.value.metadata["peerPid"] == str(os.getpid())
    assert passed == config.FD_TOKENS_PER_PEER_MAX
    assert eventually(lambda: metric(server, "kvsvc_fd_socket_open_fds") <= passed + 4)
    assert metric(server, "kvsvc_fd_tokens_held") == passed + 1


def test_an_unused_token_is_released_promptly(make_server, monkeypatch) -> None:
    """A pass whose Map never comes holds its place for FD_TOKEN_UNUSED_TTL_S only
    (the old server kept every passed fd 60 s), without any Map to notice."""
    monkeypatch.setattr(fdbroker, "FD_TOKEN_UNUSED_TTL_S", 0.5)
    st = make_server()
    fd = fdpass.make_sealed_memfd("unused", 4096)
    try:
        token = fdpass.send_fd(st.server.servicer.fds.path, fd, timeout=20)
    finally:
        os.close(fd)
    assert eventually(lambda: metric(st, "kvsvc_fd_tokens_held") == 0, timeout=30)
    with KVCacheClient(st.address) as c, pytest.raises(InvalidRequest) as e:
        c.map("ns", [memfd_region(token)])
    assert e.value.reason == "FD_TOKEN_UNKNOWN"


def test_a_token_a_map_used_outlives_the_unused_ttl(tmp_path) -> None:
    broker = fdbroker.FdBroker(str(tmp_path / "fds"), ttl=600, unused_ttl=4)
    broker.start()
    fd = fdpass.make_sealed_memfd("m", 4096)
    try:
        used = fdpass.send_fd(broker.path, fd)
        dup, _, owner = broker.open(used)  # a Map's use, right away
        os.close(dup)
        owner.close()
        unused = fdpass.send_fd(broker.path, fd)
        assert eventually(lambda: len(broker) == 1, timeout=30)
        with pytest.raises(InvalidRequest):
            broker.open(unused)
        dup, size, owner = broker.open(used)
        os.close(dup)
        owner.close()
        assert size == 4096
    finally:
        os.close(fd)
        broker.close()


def test_fds_beyond_one_per_pass_are_closed_at_once(server, client) -> None:
    """A pass carrying several fds, or more than the control buffer takes, is
    refused and leaves no fd behind in the server."""
    path = client.server_info().fd_socket
    extra = [fdpass.make_sealed_memfd(f"x{i}", 4096) for i in range(8)]
    before = open_fds()
    try:
        for _ in range(20):
            for fds in (extra[:2], extra):
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.settimeout(20)
                    s.connect(path)
                    socket.send_fds(s, [fdpass.MAGIC], fds)
                    err = fdpass.error_pb2.RemoteError.FromString(s.recv(65536)[1:])
                assert err.reason == "FD_PASS_MALFORMED"
    finally:
        for f in extra:
            os.close(f)
    assert eventually(lambda: open_fds() <= before - len(extra)), (open_fds(), before)
    assert len(server.server.servicer.fds) == 0


def test_exited_works_for_a_pidfd_past_fd_setsize() -> None:
    """A server holding many fds has pidfds numbered past 1024, where select()
    fails: the owner check must still answer."""
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        if hard != resource.RLIM_INFINITY and hard < 1100:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1100")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    pidfd = os.pidfd_open(child.pid)
    high = fcntl.fcntl(pidfd, fcntl.F_DUPFD_CLOEXEC, 1050)
    try:
        assert high >= 1050
        assert not fdbroker.exited(high)
        child.communicate(b"", timeout=30)
        assert fdbroker.exited(high)
    finally:
        os.close(high)
        os.close(pidfd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- leases: an engine's memory lives while its fd-socket connection does ---
LEASED_ENGINE = """
import json, os, sys
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
cache = SharedKVCache("leased", num_layers=2, num_blocks=8, memfd=True)
client = KVCacheClient(sys.argv[1])
m = client.map("ns", [cache.rank_region(token=client.register_memfd(cache.fd))])
client.store(m, [(b"leased", [1, 2])])
print(json.dumps({"mapping": m.mapping_id}), flush=True)
sys.stdin.readline()  # killed here
"""


def test_a_dead_engines_mapping_is_released_without_any_map(server, client) -> None:
    """The engine passes its memfd over a lease connection (the Python client's
    register_memfd) and is killed: the server releases the mapping on its own,
    within seconds, with no Map or Unmap from anyone (the old server waited for
    the next Map)."""
    import json
    import subprocess
    import sys

    engine = subprocess.Popen(
        [sys.executable, "-c", LEASED_ENGINE, server.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    servicer = server.server.servicer
    try:
        mapping = json.loads(engine.stdout.readline())["mapping"]
        assert mapping in servicer.mappings
        assert servicer.fds.leases == 1
        time.sleep(1.5)  # alive: the reaper's rounds leave it alone
        assert mapping in servicer.mappings
    finally:
        killed = time.monotonic()
        engine.kill()
        engine.wait(timeout=30)
    assert eventually(lambda: mapping not in servicer.mappings, timeout=10)
    print(f"released {time.monotonic() - killed:.3f} s after SIGKILL")
    assert servicer.fds.leases == 0 and len(servicer.fds) == 0
    assert health_status(server.address) == SERVING


def test_closing_the_client_ends_its_lease(server, shm_dir) -> None:
    """Closing the client that passed the memfd is the engine letting go: its
    mappings are released; another client's mapping stays."""
    servicer = server.server.servicer
    cache = make_cache(shm_dir, "c", seed=3, memfd=True)
    other = make_cache(shm_dir, "o", seed=4, memfd=True)
    with KVCacheClient(server.address) as keeper:
        kept = keeper.map("ns", [other.rank_region(token=keeper.register_memfd(other.fd))])
        with KVCacheClient(server.address) as c:
            m = c.map("ns", [cache.rank_region(token=c.register_memfd(cache.fd))])
            token2 = c.register_memfd(cache.fd)  # a second pass rides the same lease
            assert token2 and servicer.fds.leases == 2
        assert eventually(lambda: m.mapping_id not in servicer.mappings, timeout=10)
        assert kept.mapping_id in servicer.mappings
        keeper.store(kept, [(b"k", [0])])
        with pytest.raises(InvalidRequest) as e:  # the lease's tokens went with it
            keeper.map("ns", [cache.rank_region(token=token2)])
        assert e.value.reason == "FD_TOKEN_UNKNOWN"
