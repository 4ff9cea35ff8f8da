"""Faults inside kvsvc under real LMCache 0.5.6 MP servers (as test_mp_server.py
starts them, the kvsvc adapter on their command lines, driven by LMCache's own MP
client and CPU worker transfer path) against a real `kvsvc serve`, one per test on
the port the adapters target; node a stores, and each test runs once per data path
of the loading node's adapter (direct: LMCache's L1 in a shared file; staging):

- a corrupt chunk: one chunk's file in kvsvc's disk tier has a byte flipped after
  memory evicted it; the loader's prefetch of the prefix stops before it (LMCache
  recomputes the rest), what it retrieves is bit-exact, the file is quarantined;
- a deadline expiring mid-load: kvsvc's failpoint holds the copy past the adapter's
  load_timeout_s; the prefetch still completes (nothing found), LMCache's own status
  view (its HTTP frontend's GET /status, which holds each adapter's report_status)
  shows the adapter unhealthy with the unproven transfer while the copy may still
  run; after the adapter's Fence, hits again, bit-exact.

No server logs a traceback; every call returns within a bound."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.multiprocess.http_server", reason="runs in .venv-lmcache")

import torch
from lmcache_nodes import BLOCKS, ENV, Node, free_port, server_command
from lmcache_objects import plugin_spec
from support import ServerProcess

from kvsvc.client import KVCacheClient
from kvsvc.server.tiers.disk.format import parse_header

MIB = 1 << 20
# The adapter's load deadline, and how long the failpoint holds a copy: longer than
# the deadline and the adapter's backstop together, so the held load cannot end in
# time whatever the machine's load.
LOAD_TIMEOUT_S = 3.0
HOLD_S = 10.0
# Stores may be held too (a store of two chunks is one copy): their deadline
# outlasts the hold.
STORE_TIMEOUT_S = 30.0
# Generous bounds for one client call and for the polls (a busy 2-core machine).
CALL_BOUND_S = 60.0
POLL_S = 90.0


class StatusNode(Node):
    """A Node whose LMCache server runs under LMCache's HTTP frontend (``python -m
    lmcache.v1.multiprocess.http_server``: the same MP server plus LMCache's admin
    API), whose GET /status is LMCache's report_status, its L2 adapters' included.
    The plain server Node starts is replaced at once (it is still importing: its
    port is free once it is reaped)."""

    def __init__(self, name: str, spec: str, logs: Path, extra: tuple[str, ...] = ()) -> None:
        super().__init__(name, spec, logs, extra)
        self.proc.kill()
        self.proc.wait(30)
        self.http_port = free_port()
        command = server_command(self.port, spec, extra)
        command[command.index("lmcache.v1.multiprocess.server")] = (
            "lmcache.v1.multiprocess.http_server"
        )
        self.proc = subprocess.Popen(
            [*command, "--http-host", "127.0.0.1", "--http-port", str(self.http_port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
        )

    def status(self) -> dict[str, Any]:
        """LMCache's status (the frontend answers moments after the MP port does)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                url = f"http://127.0.0.1:{self.http_port}/status"
                with urllib.request.urlopen(url, timeout=10) as r:
                    status: dict[str, Any] = json.loads(r.read())
                    return status
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"no /status: {self.output()}"
                time.sleep(0.3)

    def adapter_status(self) -> dict[str, Any]:
        adapters = self.status()["storage_manager"]["l2_adapters"]
        ours = [s for s in adapters if s.get("type") == "KvsvcL2Adapter"]
        assert len(ours) == 1, adapters
        return ours[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """LMCache nodes targeting one port, where each test starts its own kvsvc (the
    adapters reconnect by themselves, as test_mp_server shows): a stores; the
    loaders, one per data path of the adapter, load (b's L1 is a shared file,
    ``--shm-name``: kvsvc copies into its objects in place; c's is anonymous
    memory: through staging)."""
    port = free_port()
    spec = plugin_spec(
        f"127.0.0.1:{port}",
        staging_mib=4,
        load_timeout_s=LOAD_TIMEOUT_S,
        store_timeout_s=STORE_TIMEOUT_S,
    )
    logs = tmp_path_factory.mktemp("logs")
    a = StatusNode("a", spec, logs)
    loaders = {
        "direct": StatusNode("b", spec, logs, ("--shm-name", f"kvsvc_faults_{port}")),
        "staging": StatusNode("c", spec, logs),
    }
    nodes = [a, *loaders.values()]
    try:
        for node in nodes:
            node.start()
        yield port, a, loaders
    finally:
        for node in nodes:
            node.close()


# Each test runs once per loader's data path; its seeds (tokens and request ids)
# differ per path: a writes to L2 only the prefixes new to its L1, and LMCache
# keeps state per request id.
PATHS = pytest.mark.parametrize("path, seed", [("direct", 100), ("staging", 200)])


def loader(cluster: Any, path: str) -> StatusNode:
    """The loader of ``path``; its log names the data path its adapter took."""
    b: StatusNode = cluster[2][path]
    assert f"data path: {path}" in b.log_path.read_text(errors="replace"), b.output()
    return b


def tokens(seed: int, n: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n)]


def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def zero(x: list[torch.Tensor]) -> bool:
    return all(not t.any() for t in x)


def timed_prefetch(node: Node, t: list[int], request_id: str) -> int:
    t0 = time.monotonic()
    found = node.prefetch(t, request_id)
    took = time.monotonic() - t0
    assert took < CALL_BOUND_S, f"prefetch {request_id} took {took:.1f} s"
    return found


def prefetch_until(node: Node, t: list[int], tag: str, want: int) -> None:
    """Poll ``node``'s prefetch of ``t`` until it finds ``want`` chunks: the writes
    to L2 run behind LMCache's L1, the presence index may lag, the adapters
    reconnect to a kvsvc started by this test."""
    deadline = time.monotonic() + POLL_S
    i = 0
    while (found := timed_prefetch(node, t, f"{tag}-{i}-{time.monotonic_ns()}")) != want:
        assert found < want, f"{tag}: found {found} chunks, stored {want}"
        assert time.monotonic() < deadline, f"{tag}: found {found} chunks, never {want}"
        i += 1
        time.sleep(0.3)


def slots(node: Node, first: int, n: int = 1) -> list[int]:
    """The blocks of ``n`` chunks from chunk slot ``first`` of the node's KV cache
    (eight slots: a warms up in slot 7; each test loads into slots of b's that
    no other test writes)."""
    bpc = node.blocks_per_chunk
    assert (first + n) * bpc <= BLOCKS
    return list(range(first * bpc, (first + n) * bpc))


def warm_up(a: Node, b: Node, seed: int) -> None:
    """Both adapters talk to this test's kvsvc: a one-chunk prefix a stores, b finds."""
    src = slots(a, 7)
    a.fill(src, seed=seed)
    deadline = time.monotonic() + POLL_S
    i = 0
    while True:
        # Other tokens each round: LMCache writes to L2 only what is new to its L1,
        # so a prefix whose write failed (the adapter still on the old kvsvc) is
        # never written again.
        t = tokens(seed, a.chunk + i)[i:]
        assert a.store(t, src, f"warm-{seed}-{i}")
        if timed_prefetch(b, t, f"warm-{seed}-{i}") == 1:
            return
        assert time.monotonic() < deadline, "the adapters never reached this test's kvsvc"
        i += 1
        time.sleep(0.3)


def no_tracebacks(*logs: str) -> None:
    for text in logs:
        assert "Traceback" not in text, text


def chunk_file(disk: Path, values: list[torch.Tensor]) -> Path:
    """The disk tier's file (one per chunk, in its 256 subdirectories) holding the
    chunk of these KV values, whatever LMCache's object layout orders them in: its
    bytes, as float16 bit patterns, are the same multiset."""
    want = torch.sort(torch.cat([v.flatten() for v in values]).view(torch.int16)).values
    deadline = time.monotonic() + POLL_S
    while True:
        for path in disk.glob("??/*.kv"):
            with contextlib.suppress(FileNotFoundError):
                raw = path.read_bytes()
                h = parse_header(raw)
                if h.size == 2 * want.numel():
                    data = raw[h.data_offset : h.data_offset + h.size]
                    got = torch.frombuffer(bytearray(data), dtype=torch.int16)
                    if torch.equal(torch.sort(got).values, want):
                        return path
        assert time.monotonic() < deadline, "the chunk never reached kvsvc's disk tier"
        time.sleep(0.2)


@PATHS
def test_a_corrupt_chunk_is_a_miss_through_lmcache(
    cluster: Any, tmp_path: Path, path: str, seed: int
) -> None:
    """Node a stores a three-chunk prefix; kvsvc writes each chunk to its disk tier,
    then memory evicts them (other chunks fill it); the second chunk's file gets a
    flipped byte. Node b's prefetch finds one chunk (the load refused the corrupt
    one: a miss, LMCache recomputes from there), its retrieve of that chunk is
    bit-exact and writes nothing else; kvsvc quarantined the file; later stores and
    loads work."""
    port, a, _ = cluster
    b = loader(cluster, path)
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    srv = ServerProcess(shm, "--store-bytes", "8M", "--disk-dir", str(disk), port=port)
    try:
        warm_up(a, b, seed=seed + 11)
        n = 3
        bpc = a.blocks_per_chunk
        src, dst = slots(a, 0, n), slots(b, 4, n)
        a.fill(src, seed=seed + 12)
        t = tokens(seed + 12, n * a.chunk)
        assert a.store(t, src, f"s{seed + 12}")
        by_chunk = [chunk_file(disk, a.blocks_bytes(slots(a, k))) for k in range(n)]
        # Memory evicts the prefix (least recently used): the load comes from disk.
        with KVCacheClient(f"127.0.0.1:{port}") as filler:
            for i in range(24):
                filler.put("filler", [(b"filler-%d" % i, bytes([i]) * MIB)], timeout=30)
        corrupt = by_chunk[1]
        with open(corrupt, "r+b") as f:
            f.seek(-1, os.SEEK_END)  # the chunk's last byte (its header comes first)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte ^ 0xFF]))

        deadline = time.monotonic() + POLL_S
        i = 0
        while (found := timed_prefetch(b, t, f"p{seed + 12}-{i}")) == 0:
            assert time.monotonic() < deadline, "node b never found the prefix"
            i += 1
            time.sleep(0.3)
        assert found == 1, f"node b found {found} chunks; the second is corrupt"
        assert b.retrieve(t[: a.chunk], dst[:bpc], f"r{seed + 12}")
        assert same(b.blocks_bytes(dst[:bpc]), a.blocks_bytes(src[:bpc]))
        assert zero(b.blocks_bytes(dst[bpc:]))
        assert not corrupt.exists()
        quarantined = list((disk / "quarantine").iterdir())
        assert [p.name for p in quarantined] == [f"{corrupt.parent.name}_{corrupt.name}"]

        # Later stores and loads work.
        src2, dst2 = src[: 2 * bpc], slots(b, 0, 2)
        a.fill(src2, seed=seed + 13)
        t2 = tokens(seed + 13, 2 * a.chunk)
        assert a.store(t2, src2, f"s{seed + 13}")
        prefetch_until(b, t2, f"p{seed + 13}", 2)
        assert b.retrieve(t2, dst2, f"r{seed + 13}")
        assert same(b.blocks_bytes(dst2), a.blocks_bytes(src2))
        for node in (a, b):
            assert node.proc.poll() is None
        no_tracebacks(a.output(), b.output(), srv.output())
    finally:
        srv.kill()


def unproven_while(node: StatusNode, job: Future[Any]) -> dict[str, Any] | None:
    """The adapter's status once it shows an unproven transfer while ``job`` runs
    (or right after it ended), else None."""
    while True:
        done = job.done()
        status = node.adapter_status()
        if status["unproven_transfers"]:
            return status
        if done:
            return None
        time.sleep(0.2)


@PATHS
def test_a_deadline_mid_load_is_unproven_until_a_fence(
    cluster: Any, tmp_path: Path, path: str, seed: int
) -> None:
    """kvsvc's ``transfer.copy`` failpoint holds every copy of more than one chunk
    (after its first chunk) for HOLD_S. Node b's prefetch of a two-chunk prefix
    completes with nothing found; once the load's deadline has passed LMCache's
    status shows it and the adapter unhealthy with the unproven transfer, still
    while the held copy may run (no proof by a timer); after a Fence (the adapter's
    own, when kvsvc can prove the copy ended) loads hit again (one-chunk prefixes:
    those copies are not held), bit-exact, and the status is healthy."""
    port, a, _ = cluster
    b = loader(cluster, path)
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProcess(
        shm,
        # Held copies occupy copy threads (the others keep copying) and would pass
        # for stalled ones (a fatal failure) after the default 10 s.
        *("--transfer-threads", "4", "--stall-timeout", "60"),
        port=port,
        env={"KVSVC_FAILPOINTS": f"transfer.copy=sleep({int(HOLD_S * 1000)})"},
    )
    try:
        warm_up(a, b, seed=seed + 21)
        src, dst = slots(a, 0, 2), slots(b, 2, 2)
        a.fill(src, seed=seed + 22)
        t = tokens(seed + 22, 2 * a.chunk)
        assert a.store(t, src, f"s{seed + 22}")
        # Until a load of b's ran into its deadline (before, the prefix may not be
        # in kvsvc yet: nothing found, nothing unproven).
        deadline = time.monotonic() + POLL_S
        with ThreadPoolExecutor(1) as pool:
            i = 0
            while True:
                t0 = time.monotonic()
                job = pool.submit(timed_prefetch, b, t, f"p{seed + 22}-{i}")
                seen = unproven_while(b, job)
                if seen is not None:
                    break
                assert job.result() == 0, "a load of the prefix was not held"
                assert time.monotonic() < deadline, "no load of the prefix was held"
                i += 1
                time.sleep(0.3)
            assert seen["is_healthy"] is False, seen
            assert b.status()["is_healthy"] is False
            # This load's copy began after t0 and is held HOLD_S: a status read
            # before t0 + HOLD_S must still show it unproven.
            time.sleep(max(t0 + HOLD_S - 3 - time.monotonic(), 0))
            status = b.adapter_status()
            if time.monotonic() < t0 + HOLD_S:
                assert status["unproven_transfers"] and status["is_healthy"] is False, status
            assert job.result() == 0, "a held load found chunks"
        assert zero(b.blocks_bytes(dst))

        src1, dst1 = slots(a, 0), slots(b, 7)
        a.fill(src1, seed=seed + 23)
        t1 = tokens(seed + 23, a.chunk)
        assert a.store(t1, src1, f"s{seed + 23}")
        prefetch_until(b, t1, f"p{seed + 23}", 1)
        assert b.retrieve(t1, dst1, f"r{seed + 23}")
        assert same(b.blocks_bytes(dst1), a.blocks_bytes(src1))
        status = b.adapter_status()
        assert status["unproven_transfers"] == 0 and status["is_healthy"] is True, status
        assert b.status()["is_healthy"] is True
        assert zero(b.blocks_bytes(dst))
        for node in (a, b):
            assert node.proc.poll() is None
        no_tracebacks(a.output(), b.output(), srv.output())
    finally:
        srv.kill()
