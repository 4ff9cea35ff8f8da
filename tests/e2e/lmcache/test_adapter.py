"""KvsvcL2Adapter as LMCache 0.5.6's controllers drive it: built by LMCache's own
parser and factory from the ``--l2-adapter`` plugin JSON, fed LMCache's real
``ObjectKey`` and ``TensorMemoryObj``, answered through its eventfds, against a
real `kvsvc serve` that is killed, stopped and restarted under it (and an
in-process server where a stored byte is flipped or a copy is held mid-load)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="runs in .venv-lmcache")

from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache_objects import L1, keys, load, lookup, make_adapter, obj_bytes, plugin_spec, store
from support import REPO, ServerProcess

from kvsvc.integrations.lmcache.adapter import KvsvcL2Adapter
from kvsvc.server.ops import failpoints

KIB = 1 << 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = ServerProcess(tmp_path_factory.mktemp("shm"), "--store-bytes", "128M")
    yield srv
    srv.kill()


def test_lmcache_builds_it_from_the_plugin_spec(server: ServerProcess) -> None:
    """LMCache's factory makes a KvsvcL2Adapter from the documented JSON, with three
    distinct eventfds (LMCache's controllers dispatch by fd); a misspelt key in
    adapter_params is refused at start, not ignored."""
    l1 = L1(64 * KIB)
    a = make_adapter(server.address, l1)
    try:
        assert isinstance(a, KvsvcL2Adapter) and isinstance(a, L2AdapterInterface)
        fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
        assert len(fds) == 3
        assert a.report_status()["is_healthy"] is True
    finally:
        a.close()
    with pytest.raises(ValueError, match="unknown keys"):
        make_adapter(server.address, l1, lookup_timeout=1)


def test_round_trip_bit_exact_across_sizes_and_rounds(server: ServerProcess) -> None:
    """Objects of two sizes, more of them than a staging lane holds (several rounds
    of pieces), are stored, found and loaded bit-exact by another adapter (another
    LMCache node); lookups and loads of absent keys among them are exactly 0 bits."""
    src, dst = L1(8 << 20), L1(4 << 20)
    a = make_adapter(server.address, src, staging_mib=2, piece_mib=1)
    # Lookup RPCs (the presence index is a hint that may lag another node's store).
    b = make_adapter(server.address, dst, staging_mib=2, piece_mib=1, presence=False)
    try:
        small_k, big_k = keys("rt-small", 40), keys("rt-big", 5)
        small, big = src.objects(40, 64 * KIB, seed=1), src.objects(5, 384 * KIB, seed=2)
        result, _ = store(a, small_k + big_k, small + big)
        assert (
            result.is_successful() and result.bytes_transferred() == 40 * 64 * KIB + 5 * 384 * KIB
        )
        absent = keys("rt-absent", 3)
        probe = [absent[0], *small_k[:10], absent[1], *big_k, absent[2]]
        hits, _ = lookup(b, probe)
        assert hits == [False, *[True] * 10, False, *[True] * 5, False]
        into = dst.objects(10, 64 * KIB) + dst.objects(1, 64 * KIB) + dst.objects(5, 384 * KIB)
        got, _ = load(
            b,
            [*small_k[:5], absent[1], *small_k[5:10], *big_k],
            [*into[:5], into[10], *into[5:10], *into[11:]],
        )
        assert got == [*[True] * 5, False, *[True] * 5, *[True] * 5]
        for s, d in zip(small[:10] + big, into[:10] + into[11:], strict=True):
            assert obj_bytes(d) == obj_bytes(s)
        assert obj_bytes(into[10]) == bytes(64 * KIB)  # the absent one: untouched
        assert sorted(b.report_status()["lanes"]) == [f"load/{384 * KIB}", f"load/{64 * KIB}"]
    finally:
        a.close()
        b.close()


def test_models_and_salts_never_share(server: ServerProcess) -> None:
    """The same chunk hash under another model or another cache salt is absent: each
    (model, salt) is its own kvsvc namespace."""
    l1 = L1(1 << 20)
    a = make_adapter(server.address, l1)
    try:
        k = keys("shared-hash", 2, model="m/one", salt="alice")
        assert store(a, k, l1.objects(2, 32 * KIB, seed=3))[0].is_successful()
        assert lookup(a, k)[0] == [True, True]
        assert lookup(a, keys("shared-hash", 2, model="m/one", salt="bob"))[0] == [False, False]
        assert lookup(a, keys("shared-hash", 2, model="m/one"))[0] == [False, False]
        assert lookup(a, keys("shared-hash", 2, model="m/two", salt="alice"))[0] == [False, False]
        got, _ = load(a, keys("shared-hash", 2, model="m/one", salt="bob"), l1.objects(2, 32 * KIB))
        assert got == [False, False]
    finally:
        a.close()


def test_kvsvc_killed_stopped_and_restarted_under_it(tmp_path: Path) -> None:
    """Killed: every task completes at once (absent, empty bitmap, failed store),
    every eventfd signalled, nothing raised; stopped (SIGSTOP): every task still
    completes within its deadline; restarted: hits again. report_status follows."""
    port = free_port()
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProcess(shm, port=port)
    l1 = L1(2 << 20)
    a = make_adapter(srv.address, l1, load_timeout_s=3.0, store_timeout_s=3.0, lookup_timeout_s=1.0)
    try:
        k, objs = keys("restart", 6), l1.objects(6, 32 * KIB, seed=4)
        assert store(a, k, objs)[0].is_successful()
        assert lookup(a, k)[0] == [True] * 6

        srv.kill()
        for _ in range(3):  # the first call finds out; the ones after skip kvsvc
            hits, took = lookup(a, k, timeout_s=30)
            assert hits == [False] * 6 and took < 10
            got, took = load(a, k, l1.objects(6, 32 * KIB), timeout_s=30)
            assert got == [False] * 6 and took < 10
            result, took = store(a, k, objs, timeout_s=30)
            assert not result.is_successful() and took < 10
        status = a.report_status()
        assert status["kvsvc_failures"] >= 1, status

        srv = ServerProcess(shm, port=port)
        deadline = time.monotonic() + 60
        while not store(a, k, objs)[0].is_successful():  # the memory store restarted empty
            assert time.monotonic() < deadline, "stores never succeed after the restart"
            time.sleep(0.3)
        into = l1.objects(6, 32 * KIB)
        assert load(a, k, into)[0] == [True] * 6
        assert [obj_bytes(x) for x in into] == [obj_bytes(x) for x in objs]

        srv.signal(signal.SIGSTOP)
        try:
            hits, took = lookup(a, k, timeout_s=30)
            assert hits == [False] * 6 and took < 1.0 + 10
            got, took = load(a, k, l1.objects(6, 32 * KIB), timeout_s=30)
            assert got == [False] * 6 and took < 3.0 + 10
        finally:
            srv.signal(signal.SIGCONT)
        # The load that timed out left its lane barred; the next load fences it.
        deadline = time.monotonic() + 60
        while (got := load(a, k, into)[0]) != [True] * 6:
            assert got == [False] * 6, got  # the fence lifts the bar for the whole lane
            assert time.monotonic() < deadline, "no hits after SIGCONT"
            time.sleep(0.3)
        assert [obj_bytes(x) for x in into] == [obj_bytes(x) for x in objs]
        assert lookup(a, k)[0] == [True] * 6
        assert a.report_status()["is_healthy"] is True
    finally:
        a.close()
        srv.kill()


def test_a_corrupt_chunk_is_never_reported_loaded(make_server: Any) -> None:
    """An object whose stored bytes fail kvsvc's CRC-32C is a 0 bit and its L1 object
    is untouched; the objects before and after it load bit-exact. (An in-process
    server, tests/conftest.py's, so that a stored byte can be flipped.)"""
    server = make_server()
    l1 = L1(2 << 20)
    a = make_adapter(server.address, l1)
    try:
        k, objs = keys("corrupt", 5), l1.objects(5, 64 * KIB, seed=5)
        assert store(a, k, objs)[0].is_successful()
        lane = next(lane for (d, _), lane in a._lanes.items() if d == "store")
        from kvsvc.integrations.lmcache.keys import chunk_key

        st = server.server.servicer.store
        chunk = st.get(a.namespaces.of(k[2]), chunk_key(k[2]), lane.mapping.layout_fingerprint)
        assert chunk is not None
        st.view[chunk.offset + 100] ^= 0xFF
        into = l1.objects(5, 64 * KIB)
        got, _ = load(a, k, into)
        assert got == [True, True, False, True, True]
        for i in (0, 1, 3, 4):
            assert obj_bytes(into[i]) == obj_bytes(objs[i])
        assert obj_bytes(into[2]) == bytes(64 * KIB)
        assert st.checksum_failures == 1
    finally:
        a.close()


def test_a_deadline_mid_load_holds_the_lane_until_a_fence(make_server: Any) -> None:
    """A load whose deadline expires while kvsvc is still copying completes with an
    empty bitmap by its deadline, never blocking; the staging lane stays barred
    (report_status: unhealthy, the unproven transfer named) until a Fence proves the
    copy ended; then loads hit again, bit-exact."""
    server = make_server()
    l1 = L1(4 << 20)
    a = make_adapter(server.address, l1, load_timeout_s=0.5, piece_mib=1)
    try:
        k, objs = keys("deadline", 8), l1.objects(8, 64 * KIB, seed=6)
        assert store(a, k, objs)[0].is_successful()
        failpoints.load("transfer.copy=sleep(3000)")
        try:
            got, took = load(a, k, l1.objects(8, 64 * KIB), timeout_s=30)
            assert got == [False] * 8 and took < 0.5 + 10
            status = a.report_status()
            assert status["is_healthy"] is False and status["barred_lanes"], status
        finally:
            failpoints.load("")
        into = l1.objects(8, 64 * KIB)
        deadline = time.monotonic() + 60
        while (got := load(a, k, into)[0]) != [True] * 8:
            assert got == [False] * 8, got  # the fence lifts the bar for the whole lane
            assert time.monotonic() < deadline, "the lane was never fenced"
            time.sleep(0.3)
        assert [obj_bytes(x) for x in into] == [obj_bytes(x) for x in objs]
        status = a.report_status()
        assert status["barred_lanes"] == {} and status["is_healthy"] is True
    finally:
        failpoints.load("")
        a.close()


def test_lmcaches_own_l2_adapter_check(server: ServerProcess) -> None:
    """LMCache's own adapter check (``lmcache.v1.basic_check --mode test_l2_adapter``,
    what it runs against its built-in adapters): absent keys absent, a batch store,
    found, loaded with the right contents."""
    spec = plugin_spec(server.address)
    done = subprocess.run(
        [sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_l2_adapter",
         "--model", "check/model", "--num-keys", "8", "--l2-adapter", spec],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**__import__("os").environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"},
    )  # fmt: skip
    out = done.stdout
    assert "Validation: 8/8 correctly absent" in out, out + done.stderr
    assert "Batch store OK" in out, out
    assert "Validation: 8/8 found" in out, out
    assert "Validation (loaded): 8/8" in out and "Validation (content): 8/8" in out, out
