"""The real LMCache 0.5.6 multiprocess server with the kvsvc adapter on its command
line, driven by LMCache's own MP client and CPU worker transfer path: one node
stores, a second node (another LMCache server, empty L1) loads the same prefix from
kvsvc bit-exact (node a's L1 is anonymous memory: the adapter's staging path; node
b's is a shared file, ``--shm-name``: kvsvc copies into its L1 objects in place);
kvsvc killed, stopped and restarted under both running servers:
misses, then hits again, no stuck request, the servers alive throughout."""

from __future__ import annotations

import signal
import socket
import time
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.multiprocess.server", reason="runs in .venv-lmcache")

import torch
from lmcache_nodes import Node
from lmcache_objects import plugin_spec
from support import ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A kvsvc server on a fixed port (so that a restart is the same target) and two
    LMCache nodes using it, started together (each takes tens of seconds here)."""
    shm = tmp_path_factory.mktemp("shm")
    port = free_port()
    holder = {"kvsvc": ServerProcess(shm, "--store-bytes", "128M", port=port)}
    spec = plugin_spec(f"127.0.0.1:{port}", staging_mib=4, load_timeout_s=3.0, store_timeout_s=3.0)
    logs = tmp_path_factory.mktemp("logs")
    shm_name = ("--shm-name", f"kvsvc_test_{port}")
    a, b = Node("a", spec, logs), Node("b", spec, logs, shm_name)
    try:
        a.start()
        b.start()
        yield holder, shm, port, a, b
    finally:
        a.close()
        b.close()
        holder["kvsvc"].kill()


def tokens(seed: int, n: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n)]


def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def test_a_second_node_loads_the_prefix_from_kvsvc(cluster: Any) -> None:
    _, _, _, a, b = cluster
    n = 2 * a.chunk
    src = list(range(0, n // 16))
    dst = list(range(64, 64 + n // 16))
    a.fill(src, seed=1)
    t = tokens(1, n)
    assert a.store(t, src, "s1")
    deadline = time.monotonic() + 60  # LMCache writes L2 behind its L1
    while (found := b.prefetch(t, f"p1-{time.monotonic_ns()}")) != 2:
        assert time.monotonic() < deadline, f"node b found {found} chunks"
        time.sleep(0.3)
    assert b.retrieve(t, dst, "r1")
    assert same(b.blocks_bytes(dst), a.blocks_bytes(src))
    # Each server's log names its adapter's data path, and why not direct.
    logs = {n.name: n.log_path.read_text(errors="replace") for n in (a, b)}
    assert "data path: staging" in logs["a"] and "--shm-name" in logs["a"], logs["a"][-4000:]
    assert "data path: direct" in logs["b"], logs["b"][-4000:]
    # Another cache salt is another namespace: nothing found.
    assert b.prefetch(t, "p1-salted", salt="tenant-b") == 0


def test_kvsvc_killed_stopped_restarted_under_running_servers(cluster: Any) -> None:
    holder, shm, port, a, b = cluster
    n = a.chunk
    src, dst = list(range(16, 16 + n // 16)), list(range(96, 96 + n // 16))

    holder["kvsvc"].kill()
    a.fill(src, seed=2)
    t = tokens(2, n)
    assert a.store(t, src, "s2")  # L1 takes it; the L2 write fails, unseen by the engine
    t0 = time.monotonic()
    assert b.prefetch(t, "p2") == 0
    assert time.monotonic() - t0 < 30

    holder["kvsvc"] = ServerProcess(shm, "--store-bytes", "128M", port=port)
    a.fill(src, seed=3)
    deadline = time.monotonic() + 90
    found, i = 0, 0
    while found != 1:  # the adapters reconnect and map again by themselves
        assert time.monotonic() < deadline, "no hits after kvsvc restarted"
        i += 1
        # A new prefix each try: a store the adapter skipped (kvsvc still counted
        # down, up to reconnect_interval_s after it is back) is never written to L2
        # again by LMCache for the same keys, which its L1 already holds.
        t = tokens(1000 + i, n)
        assert a.store(t, src, f"s3-{i}")
        time.sleep(0.5)
        found = b.prefetch(t, f"p3-{i}")
    assert b.retrieve(t, dst, "r3")
    assert same(b.blocks_bytes(dst), a.blocks_bytes(src))

    holder["kvsvc"].signal(signal.SIGSTOP)
    try:
        t = tokens(4, n)
        t0 = time.monotonic()
        assert b.prefetch(t, "p4") == 0
        assert time.monotonic() - t0 < 60
        assert a.store(t, src, "s4")
    finally:
        holder["kvsvc"].signal(signal.SIGCONT)
    a.fill(src, seed=5)
    deadline = time.monotonic() + 90
    found, i = 0, 0
    while found != 1:
        assert time.monotonic() < deadline, "no hits after SIGCONT"
        i += 1
        t = tokens(2000 + i, n)  # a new prefix each try, as above
        assert a.store(t, src, f"s5-{i}")
        time.sleep(0.5)
        found = b.prefetch(t, f"p5-{i}")
    assert b.retrieve(t, dst, "r5")
    assert same(b.blocks_bytes(dst), a.blocks_bytes(src))
    for node in (a, b):
        assert node.proc.poll() is None
        assert "Traceback" not in node.output()
