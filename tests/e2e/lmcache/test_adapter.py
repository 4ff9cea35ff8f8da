"""KvsvcL2Adapter as LMCache 0.5.6's controllers drive it: built by LMCache's own
parser and factory from the ``--l2-adapter`` plugin JSON, fed LMCache's real
``ObjectKey`` and ``TensorMemoryObj``, answered through its eventfds, against a
real `kvsvc serve` that is killed, stopped and restarted under it (and an
in-process server where a stored byte is flipped or a copy is held mid-load)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="runs in .venv-lmcache")

from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache_objects import (
    L1,
    ShmL1,
    keys,
    load,
    lookup,
    make_adapter,
    obj_bytes,
    plugin_spec,
    store,
    submit_load,
    wait_fd,
)
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


def wait_held(adapter: Any, task: str, pop: Callable[[], dict[int, Any]] | None = None) -> None:
    """Until ``task`` ("<kind> <id>") shows in ``held_tasks``; with ``pop`` (the
    kind's completed tasks), asserting it is not given meanwhile."""
    deadline = time.monotonic() + 60
    while task not in adapter.report_status()["held_tasks"]:
        if pop is not None:
            assert int(task.split()[1]) not in pop(), "completed without a hold"
        assert time.monotonic() < deadline, adapter.report_status()
        time.sleep(0.05)


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
        # Past the down time a lookup still makes no call (a probe thread asks, one
        # at a time): every lookup is skipped, none is the one to find kvsvc gone.
        time.sleep(a.cfg.reconnect_interval_s * 1.5)
        skipped = a.report_status()["lookups_skipped_down"]
        for _ in range(5):
            assert lookup(a, k, timeout_s=30)[0] == [False] * 6
        status = a.report_status()
        assert status["lookups_skipped_down"] == skipped + 5, status
        assert status["reconnect_probes"] >= 1 and status["kvsvc_unproven"] is True, status
        assert status["is_healthy"] is False, status

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
        # Lookups come back once the probe thread has had an answer.
        while lookup(a, k)[0] != [True] * 6:
            assert time.monotonic() < deadline, f"no lookup hits: {a.report_status()}"
            time.sleep(0.1)
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
        lane = next(lane for (d, _), lane in a.staging.lanes.items() if d == "store")
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


@pytest.fixture
def shm_l1() -> Any:
    """LMCache's own L1 arenas with ``shm_name`` set (its server's ``--shm-name``)."""
    made: list[ShmL1] = []

    def make(nbytes: int) -> ShmL1:
        made.append(ShmL1(nbytes, f"kvsvc_test_{time.monotonic_ns()}"))
        return made[-1]

    yield make
    for l1 in made:
        l1.close()


def test_the_data_path_is_chosen_at_construction_and_said_why(
    server: ServerProcess, shm_l1: Any
) -> None:
    """An L1 arena in a shared file (--shm-name) is copied in place (direct); an
    anonymous one, no descriptor, or ``l1_direct`` false keeps the staging lanes,
    and report_status says which path and why."""
    direct = make_adapter(server.address, shm_l1(1 << 20))
    anonymous = make_adapter(server.address, L1(1 << 20))
    off = make_adapter(server.address, shm_l1(1 << 20), l1_direct=False)
    try:
        s = direct.report_status()
        assert s["data_path"] == "direct" and s["staging_why"] == "", s
        s = anonymous.report_status()
        assert s["data_path"] == "staging" and "--shm-name" in s["staging_why"], s
        s = off.report_status()
        assert s["data_path"] == "staging" and "l1_direct" in s["staging_why"], s
    finally:
        for a in (direct, anonymous, off):
            a.close()
    none = KvsvcL2Adapter({"target": server.address}, None)
    try:
        assert none.report_status()["staging_why"] == "LMCache passed no l1_memory_desc"
    finally:
        none.close()


def test_direct_round_trip_bit_exact_and_shared_with_staging_nodes(
    server: ServerProcess, shm_l1: Any
) -> None:
    """On the direct path kvsvc copies LMCache's objects in place, bit-exact, for two
    object sizes and more objects than one Store carries; a node on the staging
    path loads what it stored and the other way (one layout); absent keys are 0
    bits and their objects untouched."""
    l1 = shm_l1(16 << 20)
    a = make_adapter(server.address, l1, piece_mib=1)
    staged_l1 = L1(4 << 20)
    b = make_adapter(server.address, staged_l1, presence=False)
    try:
        small_k, big_k = keys("d-small", 40), keys("d-big", 5)
        small, big = l1.objects(40, 64 * KIB, seed=11), l1.objects(5, 384 * KIB, seed=12)
        result, _ = store(a, small_k + big_k, small + big)
        assert result.is_successful(), a.report_status()
        absent = keys("d-absent", 1)
        into = l1.objects(41, 64 * KIB) + l1.objects(5, 384 * KIB)
        got, _ = load(a, [*small_k[:20], absent[0], *small_k[20:], *big_k], into)
        assert got == [*[True] * 20, False, *[True] * 20, *[True] * 5]
        for s, d in zip(small + big, into[:20] + into[21:], strict=True):
            assert obj_bytes(d) == obj_bytes(s)
        assert obj_bytes(into[20]) == bytes(64 * KIB)
        status = a.report_status()
        assert status["data_path"] == "direct" and status["lanes"] == [], status
        assert sorted(status["arena_mappings"]) == [
            f"load/{384 * KIB}", f"load/{64 * KIB}", f"store/{384 * KIB}", f"store/{64 * KIB}"
        ]  # fmt: skip
        # A staging node loads what the direct node stored...
        there = staged_l1.objects(5, 384 * KIB)
        assert load(b, big_k, there)[0] == [True] * 5
        assert [obj_bytes(x) for x in there] == [obj_bytes(x) for x in big]
        # ...and the direct node loads what a staging node stored.
        sk = keys("s-to-d", 4)
        src = staged_l1.objects(4, 64 * KIB, seed=13)
        assert store(b, sk, src)[0].is_successful()
        back = l1.objects(4, 64 * KIB)
        assert load(a, sk, back)[0] == [True] * 4
        assert [obj_bytes(x) for x in back] == [obj_bytes(x) for x in src]
    finally:
        a.close()
        b.close()


def test_direct_a_corrupt_chunk_is_never_reported_loaded(make_server: Any, shm_l1: Any) -> None:
    """On the direct path kvsvc writes the object as it checks it: a chunk that fails
    its CRC-32C is a 0 bit (LMCache then deletes that object unread), the objects
    before and after it load bit-exact, and the stored copy is dropped."""
    server = make_server()
    l1 = shm_l1(4 << 20)
    a = make_adapter(server.address, l1)
    try:
        k, objs = keys("d-corrupt", 5), l1.objects(5, 64 * KIB, seed=14)
        assert store(a, k, objs)[0].is_successful()
        from kvsvc.integrations.lmcache.keys import chunk_key

        mapping = a.arena.entry("store", 64 * KIB).mapping
        st = server.server.servicer.store
        chunk = st.get(a.namespaces.of(k[2]), chunk_key(k[2]), mapping.layout_fingerprint)
        assert chunk is not None
        st.view[chunk.offset + 100] ^= 0xFF
        into = l1.objects(5, 64 * KIB)
        got, _ = load(a, k, into)
        assert got == [True, True, False, True, True]
        for i in (0, 1, 3, 4):
            assert obj_bytes(into[i]) == obj_bytes(objs[i])
        assert st.checksum_failures == 1
        assert load(a, k[2:3], l1.objects(1, 64 * KIB))[0] == [False]  # dropped
        assert a.report_status()["is_healthy"] is True
    finally:
        a.close()


def _held_then_given(a: Any, task: int, timeout_s: float = 60) -> tuple[list[bool], float]:
    """Waits until the load task is held (report_status), checks its result is not
    given while it is, then waits for the result; (bitmap, seconds it was held)."""
    deadline = time.monotonic() + timeout_s
    while not any(name == f"load {task}" for name in a.report_status()["held_tasks"]):
        assert a.query_load_result(task) is None, "completed without being held"
        assert time.monotonic() < deadline, f"never held: {a.report_status()}"
        time.sleep(0.05)
    held_at = time.monotonic()
    status = a.report_status()
    assert status["is_healthy"] is False and status["unproven_transfers"] >= 1, status
    result = a.query_load_result(task)
    if f"load {task}" in a.report_status()["held_tasks"]:
        assert result is None, "a held task's result was given"
    while result is None:
        assert time.monotonic() < deadline, f"held for good: {a.report_status()}"
        time.sleep(0.05)
        result = a.query_load_result(task)
    return [bool(result.test(i)) for i in range(result.size())], time.monotonic() - held_at


def test_direct_a_deadline_mid_load_holds_the_task_until_a_fence(
    make_server: Any, shm_l1: Any
) -> None:
    """A load whose deadline passes while kvsvc still copies into LMCache's objects
    is held incomplete (its objects stay LMCache's task's: never reused while kvsvc
    may write them), unhealthy with its transfer named, until a Fence proves the copy
    ended; then it completes with those objects 0 bits, and loads hit again."""
    server = make_server()
    l1 = shm_l1(4 << 20)
    a = make_adapter(server.address, l1, load_timeout_s=0.5, piece_mib=1)
    try:
        k, objs = keys("d-deadline", 8), l1.objects(8, 64 * KIB, seed=15)
        assert store(a, k, objs)[0].is_successful()
        failpoints.load("transfer.copy=sleep(3000)")
        try:
            task = submit_load(a, k, l1.objects(8, 64 * KIB))
            got, _ = _held_then_given(a, task)
        finally:
            failpoints.load("")
        assert got == [False] * 8
        assert a.report_status()["held_tasks"] == {}
        into = l1.objects(8, 64 * KIB)
        deadline = time.monotonic() + 60
        while (got := load(a, k, into)[0]) != [True] * 8:
            assert time.monotonic() < deadline, a.report_status()
            time.sleep(0.3)
        assert [obj_bytes(x) for x in into] == [obj_bytes(x) for x in objs]
        assert a.report_status()["is_healthy"] is True
    finally:
        failpoints.load("")
        a.close()


def test_direct_a_deadline_mid_store_holds_the_task_until_a_fence(
    make_server: Any, shm_l1: Any
) -> None:
    """A store whose deadline passes while kvsvc still reads LMCache's objects is held
    (LMCache keeps them read-locked: no bytes of another object can be stored under
    these keys) until a Fence proves the copy ended; then it is reported failed, and
    a store and load afterwards are bit-exact."""
    server = make_server()
    l1 = shm_l1(4 << 20)
    a = make_adapter(server.address, l1, store_timeout_s=0.5, piece_mib=1)
    try:
        k, objs = keys("d-store-deadline", 8), l1.objects(8, 64 * KIB, seed=17)
        failpoints.load("transfer.copy=sleep(3000)")
        try:
            task = a.submit_store_task(k, objs)
            deadline = time.monotonic() + 60
            wait_held(a, f"store {task}", a.pop_completed_store_tasks)
            assert a.report_status()["is_healthy"] is False
        finally:
            failpoints.load("")
        done: dict[int, Any] = {}
        while task not in done:
            done.update(a.pop_completed_store_tasks())
            assert time.monotonic() < deadline, a.report_status()
            time.sleep(0.05)
        assert not done[task].is_successful()
        assert a.report_status()["held_tasks"] == {}
        while not store(a, k, objs)[0].is_successful():
            assert time.monotonic() < deadline, a.report_status()
            time.sleep(0.3)
        into = l1.objects(8, 64 * KIB)
        assert load(a, k, into)[0] == [True] * 8
        assert [obj_bytes(x) for x in into] == [obj_bytes(x) for x in objs]
    finally:
        failpoints.load("")
        a.close()


def test_direct_kvsvc_stopped_then_killed_and_restarted(
    tmp_path: Path, shm_l1: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvsvc SIGSTOPped mid-load: the task is held (no result, unhealthy) however long
    it stays stopped; SIGCONT: a Fence proves the copies ended and the task
    completes. Stopped again and then killed and restarted where the adapter cannot
    watch kvsvc's process (no pidfds): the new server start proves it. Stopped and
    killed for good: its exit proves it, no restart needed. Then, with nothing in
    flight, every task completes at once. Hits again after each."""
    port = free_port()
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProcess(shm, port=port)
    l1 = shm_l1(4 << 20)
    a = make_adapter(srv.address, l1, load_timeout_s=1.0, store_timeout_s=1.0, fence_timeout_s=2.0)
    k, objs = keys("d-stop", 6), l1.objects(6, 64 * KIB, seed=16)

    def hits_again() -> None:
        deadline = time.monotonic() + 60
        into = l1.objects(6, 64 * KIB)
        while load(a, k, into)[0] != [True] * 6:
            store(a, k, objs)  # a restarted memory store is empty
            assert time.monotonic() < deadline, a.report_status()
            time.sleep(0.3)
        assert [obj_bytes(x) for x in into] == [obj_bytes(x) for x in objs]

    def held_load(srv: ServerProcess) -> int:
        """A load submitted to a SIGSTOPped kvsvc, once it is held."""
        srv.signal(signal.SIGSTOP)
        task = submit_load(a, k, l1.objects(6, 64 * KIB))
        wait_held(a, f"load {task}")
        return task

    try:
        assert store(a, k, objs)[0].is_successful()
        hits_again()

        srv.signal(signal.SIGSTOP)
        try:
            task = submit_load(a, k, l1.objects(6, 64 * KIB))
            wait_held(a, f"load {task}")
            time.sleep(3.0)  # stopped past the deadline and several proof attempts
            assert a.query_load_result(task) is None, "given while kvsvc is stopped"
        finally:
            srv.signal(signal.SIGCONT)
        got, _ = _held_then_given(a, task)
        assert got == [False] * 6 or got == [True] * 6, got  # the copy may have ended in time
        monkeypatch.delattr(os, "pidfd_open")  # the next mapping's server is not watched
        hits_again()

        task = held_load(srv)
        srv.kill()
        assert a.query_load_result(task) is None  # killed, not watched: nobody proves it yet
        srv = ServerProcess(shm, port=port)
        got, _ = _held_then_given(a, task)
        assert got == [False] * 6
        assert a.report_status()["proven_by_exit"] == 0
        monkeypatch.undo()
        hits_again()
        assert a.report_status()["is_healthy"] is True

        task = held_load(srv)
        srv.kill()  # for good: its exit proves its copies ended
        got, _ = _held_then_given(a, task)
        assert got == [False] * 6
        status = a.report_status()
        assert status["held_tasks"] == {} and status["proven_by_exit"] == 1, status

        got, took = load(a, k, l1.objects(6, 64 * KIB), timeout_s=30)
        assert got == [False] * 6 and took < 10
        assert not store(a, k, objs, timeout_s=30)[0].is_successful()
        assert a.report_status()["held_tasks"] == {}
    finally:
        a.close()
        srv.kill()


def test_direct_a_held_store_completes_when_kvsvc_dies_for_good(
    tmp_path: Path, shm_l1: Any
) -> None:
    """A store whose copy kvsvc's ``transfer.copy`` failpoint stalls past its deadline
    is held; kvsvc is then SIGKILLed and never restarted: no Fence can answer, but
    its server process's exit proves its copies ended, so the store completes
    (failed: LMCache releases its read locks), its eventfd signalled, and nothing
    stays held."""
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProcess(shm, env={"KVSVC_FAILPOINTS": "transfer.copy=sleep(600000)"})
    l1 = shm_l1(4 << 20)
    a = make_adapter(srv.address, l1, store_timeout_s=0.5, piece_mib=1)
    try:
        k, objs = keys("d-store-dies", 8), l1.objects(8, 64 * KIB, seed=18)
        task = a.submit_store_task(k, objs)
        wait_held(a, f"store {task}", a.pop_completed_store_tasks)
        assert a.report_status()["proven_by_exit"] == 0
        srv.kill()
        done: dict[int, Any] = {}
        deadline = time.monotonic() + 60
        while task not in done:
            wait_fd(a.get_store_event_fd(), max(deadline - time.monotonic(), 0))
            done.update(a.pop_completed_store_tasks())
        assert not done[task].is_successful()
        status = a.report_status()
        assert status["held_tasks"] == {} and status["proven_by_exit"] == 1, status
    finally:
        a.close()
        srv.kill()


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
