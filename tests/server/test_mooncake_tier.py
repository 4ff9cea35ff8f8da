"""The Mooncake tier against a real ``mooncake_master`` and real kvsvc servers:
two servers share chunks through Mooncake Store (bit-exact); the master killed
mid-Retrieve, the peer holding the data killed mid-load, the master restarted
empty: every call ends within its deadline as a success or a miss, health stays
SERVING, nothing corrupt is loaded and no call hangs; a forged value under a
kvsvc key is a miss; DropNamespace's reply counts the values the master removed,
or says the removal did not finish. The tier contract tests (test_tier_contract)
run against it too.

Mooncake's transfer engine ignores loopback (it dials the first other
interface), so these tests never run in the machine's own network namespace:
``test_in_a_network_namespace`` runs this file again under ``unshare -n``, in a
namespace it sets up (lo, and a veth pair 10.250.0.1/24 - 10.250.0.2/24 that
exists only there), and every other test here runs only there (skipped outside,
with that reason)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mooncake_servers import CALL_S, HOST_A, HOST_B, NETNS_SETUP, Master, mooncake_missing, required
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import SERVING, ServerProcess, ServerThread, documented_metrics, health_status

# The contract every tier keeps, run here against the Mooncake tier (the
# `backend` fixture below); `node` is the contract tests' own fixture.
from test_tier_contract import (  # noqa: F401 - collected here, with this file's backend
    node,
    test_a_stored_chunk_is_written_behind_and_loaded_back_bit_exact,
    test_a_tier_whose_backend_fails_is_a_miss_and_health_stays,
    test_drop_namespace_forgets_the_tiers_copy,
)

from kvsvc.cli.main import main as kvsvc_cli
from kvsvc.client import KVCacheClient
from kvsvc.errors import Miss
from kvsvc.server.config import ServerConfig
from kvsvc.server.data.store import INLINE_LAYOUT
from kvsvc.v1 import kv_cache_service_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: set in the namespace test_in_a_network_namespace makes
INSIDE = "KVSVC_MOONCAKE_NETNS"
NS = "mooncake-tests"
CHUNK = 256 << 10
#: every call's deadline in these tests; a call must end before it
DEADLINE_S = 8.0


def test_in_a_network_namespace(tmp_path: Path) -> None:
    """This file's tests, run again inside a network namespace made for them."""
    if os.environ.get(INSIDE):
        pytest.skip("this is the run inside the namespace")
    why = mooncake_missing()
    if why is None and shutil.which("unshare") is None:
        why = "unshare (util-linux) not installed"
    if why is None:
        probe = subprocess.run(
            ["unshare", "-n", "sh", "-c", NETNS_SETUP + "true"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if probe.returncode != 0:
            why = f"cannot make a network namespace with a veth pair: {probe.stderr.strip()}"
    if why is not None:
        if required():
            pytest.fail(why)
        pytest.skip(why)
    report = tmp_path / "report.xml"
    # GLOG_minloglevel: Mooncake's own log lines (one per failed call) stay out of the report
    env = {**os.environ, INSIDE: "1", "PYTHONUNBUFFERED": "1", "GLOG_minloglevel": "3"}
    run = subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            NETNS_SETUP + 'exec "$@"',
            "netns",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            f"--basetemp={tmp_path / 'inner'}",
            __file__,
        ],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    ran = int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
    # the five scenarios and the three contract tests (the one skip is this test itself)
    assert ran >= 8, run.stdout[-3000:]


@pytest.fixture(autouse=True)
def _inside(request: pytest.FixtureRequest) -> None:
    if request.node.name != "test_in_a_network_namespace" and not os.environ.get(INSIDE):
        pytest.skip("runs inside the network namespace test_in_a_network_namespace makes")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    m = Master(tmp_path / "master")
    yield m
    m.kill()


# --- the contract tests' backend: the Mooncake tier ---
class MooncakeBackend:
    name = "mooncake"

    def __init__(self, tmp: Path) -> None:
        self.master = Master(tmp / "master")

    def settings(self, which: str) -> dict[str, object]:
        return self.master.settings(HOST_A if which == "a" else HOST_B)

    def destroy(self, which: str) -> None:
        self.master.kill()

    def close(self) -> None:
        self.master.kill()


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[MooncakeBackend]:
    b = MooncakeBackend(tmp_path)
    yield b
    b.close()


# --- helpers ---
@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def make(name: str, **settings: object) -> ServerThread:
        shm = tmp_path / f"shm-{name}"
        shm.mkdir()
        config = ServerConfig.from_settings(
            listen="127.0.0.1:0", store_bytes=96 << 20, shm_dir=str(shm), **settings
        )
        st = ServerThread(config)
        started.append(st)
        return st

    yield make
    for st in started:
        st.stop()


@pytest.fixture
def process(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def make(name: str, *args: str) -> ServerProcess:
        shm = tmp_path / f"shm-{name}"
        shm.mkdir()
        p = ServerProcess(shm, "--store-bytes", "160M", *args)
        started.append(p)
        return p

    yield make
    for p in started:
        p.kill()


def series(st: ServerThread, name: str, **labels: str) -> float:
    text = generate_latest(st.server.servicer.metrics.registry).decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def items(n: int, tag: bytes, size: int = CHUNK) -> list[tuple[bytes, bytes]]:
    return [(tag + b"-%d" % i, os.urandom(size)) for i in range(n)]


def wait_until(what: str, ok: Callable[[], bool], limit: float = 30) -> None:
    end = time.monotonic() + limit
    while not ok():
        assert time.monotonic() < end, f"{what}: not within {limit} s"
        time.sleep(0.05)


def shared(c: KVCacheClient, keys: list[bytes]) -> Callable[[], bool]:
    """Lookup counts every key (memory or Mooncake)."""
    return lambda: c.lookup(keys, namespace=NS, timeout=DEADLINE_S) == len(keys)


def gets_during(
    st: ServerThread,
    c: KVCacheClient,
    data: dict[bytes, bytes],
    fault: Callable[[], None],
    rounds: int = 6,
) -> dict[str, int]:
    """Retrieve every key, ``rounds`` times over, from two threads while
    ``fault`` runs, memory forgetting them before each call (each a load from
    Mooncake): each call a success (bit-exact) or a Miss within its deadline."""
    out = {"hit": 0, "miss": 0}
    keys = list(data)

    def one(key: bytes) -> str:
        forget_in_memory(st)
        t0 = time.monotonic()
        try:
            got = c.get(NS, key, timeout=DEADLINE_S)
        except Miss:
            result = "miss"
        else:
            assert got == data[key], "a corrupt chunk was loaded"
            result = "hit"
        assert time.monotonic() - t0 < DEADLINE_S + 1.0, "a call outlived its deadline"
        return result

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        work = [pool.submit(one, k) for _ in range(rounds) for k in keys]
        time.sleep(0.05)
        fault()
        for f in concurrent.futures.as_completed(work, timeout=rounds * len(keys) * DEADLINE_S):
            out[f.result()] += 1
    return out


def listed(st: ServerThread) -> set[bytes]:
    """The keys ``st``'s events log lists in TIER_MOONCAKE (a snapshot's)."""

    async def snapshot() -> Any:
        return st.server.servicer.events.snapshot()

    _, _, below = st.run(snapshot())
    return {key[1] for tier, keys in below if tier == pb.TIER_MOONCAKE for key, _ in keys}


def forget_in_memory(st: ServerThread) -> None:
    async def drop() -> None:
        st.server.servicer.store.drop_namespace(NS)

    st.run(drop())


# --- the scenarios ---
def test_two_servers_share_chunks_and_a_forged_value_is_a_miss(
    master, server, tmp_path, capsys
) -> None:
    a = server("a", **master.settings(HOST_A))
    b = server("b", **master.settings(HOST_B))
    data = dict(items(4, b"s") + items(1, b"big", 3 << 20))
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        assert ca.put(NS, list(data.items())).stored_chunks == len(data)
        wait_until("A writes its chunks", lambda: series(a, "kvsvc_tier_written_chunks_total") == 5)
        wait_until("B sees them", shared(cb, list(data)))
        for key, value in data.items():
            assert cb.get(NS, key, timeout=DEADLINE_S) == value
        assert series(b, "kvsvc_tier_hits_total", tier="mooncake") == len(data)
        # What each knows Mooncake holds is its TIER_MOONCAKE listing (WatchEvents'
        # snapshots, the presence index): A's writes, B's reads.
        wait_until("A lists its writes", lambda: listed(a) == set(data))
        assert listed(b) == set(data)
        assert series(b, "kvsvc_tier_written_chunks_total", tier="mooncake") == 0  # not back

        # A value under a kvsvc key that is not that chunk: never loaded.
        import mooncake.store

        raw = mooncake.store.MooncakeDistributedStore()
        s = master.settings(HOST_A)
        assert raw.setup(HOST_A, s["mooncake_metadata"], 16 << 20, 16 << 20, "tcp", "",
                         s["mooncake_master"]) == 0  # fmt: skip
        from kvsvc.server.tiers.mooncake.values import key_name

        forged = b"forged-key"
        name = key_name("kvsvc", NS, INLINE_LAYOUT, forged)
        assert raw.put(name, os.urandom(CHUNK)) == 0
        copied = key_name("kvsvc", NS, INLINE_LAYOUT, b"copied")  # another key's value
        assert raw.put(copied, raw.get(key_name("kvsvc", NS, INLINE_LAYOUT, b"s-0"))) == 0
        for key in (forged, b"copied"):
            with pytest.raises(Miss):
                cb.get(NS, key, timeout=DEADLINE_S)
        assert series(b, "kvsvc_mooncake_rejected_values_total") >= 2

        # DropNamespace says what the master removed: every node's values under the
        # namespace (A's five, the forged and the copied one), named by the CLI.
        capsys.readouterr()
        assert kvsvc_cli(["drop-namespace", NS, "--target", a.address]) == 0
        said = capsys.readouterr().out
        assert "from memory, 7 values from Mooncake\n" in said and "did not finish" not in said
        again = ca.drop_namespace(NS, timeout=DEADLINE_S)
        assert (again.mooncake_values, again.mooncake_complete) == (0, True)
    assert health_status(b.address) == SERVING
    # docs/metrics.md's Mooncake rows are exactly the kvsvc_mooncake_* families.
    text = generate_latest(b.server.servicer.metrics.registry).decode()
    exported = {
        f.name + ("_total" if f.type == "counter" else ""): f.type
        for f in text_string_to_metric_families(text)
        if f.name.startswith("kvsvc_mooncake_")
    }
    documented = {n: k for n, k in documented_metrics().items() if "_mooncake_" in n}
    assert exported and documented == exported


def test_the_master_killed_mid_retrieve_then_restarted_empty(master, server, process) -> None:
    a = process("a", *master.flags(HOST_A))
    b = server("b", **master.settings(HOST_B))
    data = dict(items(6, b"m", 1 << 20))
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ca.put(NS, list(data.items()))
        wait_until("B sees A's chunks", shared(cb, list(data)))
        outcome = gets_during(b, cb, data, master.kill)
        assert outcome["hit"] + outcome["miss"] == 6 * len(data)
        assert health_status(b.address) == SERVING
        # Every Mooncake call is bounded: none left past --mooncake-timeout.
        wait_until("no call left in Mooncake", lambda: series(
            b, "kvsvc_mooncake_calls_in_flight") == 0, 5 * CALL_S + 5)  # fmt: skip
        forget_in_memory(b)
        t0 = time.monotonic()
        with pytest.raises(Miss):  # the master is gone
            cb.get(NS, b"m-0", timeout=DEADLINE_S)
        assert time.monotonic() - t0 < DEADLINE_S
        assert cb.put(NS, items(1, b"during")).stored_chunks == 1  # Stores still succeed

        master.start()  # empty: what it held is gone, the peers mount again
        with pytest.raises(Miss):
            cb.get(NS, b"m-1", timeout=DEADLINE_S)
        tries = iter(range(1000))

        def shared_again() -> bool:
            """A new chunk stored on A reaches B (A's segment is mounted again)."""
            key, value = items(1, b"after-%d" % next(tries))[0]
            ca.put(NS, [(key, value)])
            try:
                end = time.monotonic() + 3
                while cb.lookup([key], namespace=NS, timeout=DEADLINE_S) == 0:
                    if time.monotonic() > end:
                        return False
                    time.sleep(0.1)
                return cb.get(NS, key, timeout=DEADLINE_S) == value
            except Miss:
                return False

        wait_until("the tier works again after the restart", shared_again, 40)
    assert health_status(b.address) == SERVING
    assert series(b, "kvsvc_mooncake_errors_total") > 0


def test_the_peer_holding_the_data_killed_mid_load(master, server, process) -> None:
    a = process("a", *master.flags(HOST_A))  # its own writes land in its own segment
    b = server("b", **master.settings(HOST_B))
    data = dict(items(8, b"p", 4 << 20))
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ca.put(NS, list(data.items()))
        wait_until("B sees A's chunks", shared(cb, list(data)))
        outcome = gets_during(b, cb, data, a.kill, rounds=2)
        assert outcome["hit"] + outcome["miss"] == 2 * len(data)
        # Once B holds nothing, every key is a miss (A's memory is gone), in time.
        forget_in_memory(b)
        t0 = time.monotonic()
        for key in list(data)[:3]:
            with pytest.raises(Miss):
                cb.get(NS, key, timeout=DEADLINE_S)
        assert time.monotonic() - t0 < 3 * DEADLINE_S
        assert cb.put(NS, items(1, b"still")).stored_chunks == 1
    assert health_status(b.address) == SERVING


def test_a_master_that_stops_answering_never_piles_up_calls(master, server) -> None:
    """The master stopped (SIGSTOP: every call waits on it): each Retrieve is a miss
    within about --mooncake-timeout, never more calls inside Mooncake than the
    tier's threads, and it heals once the master answers again."""
    from kvsvc.server.tiers.mooncake.gate import THREADS

    b = server("b", **master.settings(HOST_B))
    data = dict(items(4, b"z"))
    with KVCacheClient(b.address) as cb:
        cb.put(NS, list(data.items()))
        wait_until("written", lambda: series(b, "kvsvc_tier_written_chunks_total") == 4)
        forget_in_memory(b)
        assert master.proc is not None
        master.proc.send_signal(signal.SIGSTOP)
        try:
            most = 0.0

            def one(key: bytes) -> float:
                t0 = time.monotonic()
                with pytest.raises(Miss):
                    cb.get(NS, key, timeout=DEADLINE_S)
                return time.monotonic() - t0

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                work = [pool.submit(one, k) for _ in range(3) for k in data]
                while not all(f.done() for f in work):
                    most = max(most, series(b, "kvsvc_mooncake_calls_in_flight"))
                    time.sleep(0.01)
                took = [f.result() for f in work]
            # two Mooncake calls per load at most, each cut at CALL_S; generous margin
            assert max(took) < 2 * CALL_S + 3.0, took
            assert most <= THREADS
            assert series(b, "kvsvc_mooncake_errors_total", kind="busy") + series(
                b, "kvsvc_mooncake_errors_total", kind="breaker_open"
            ) > 0  # fmt: skip
            assert health_status(b.address) == SERVING
            # A drop the master does not answer in time is reported unfinished
            # (another namespace's: the removal given up on runs once it answers).
            t0 = time.monotonic()
            r = cb.drop_namespace("elsewhere", timeout=1.0)
            assert time.monotonic() - t0 < 1.5
            assert (r.mooncake_values, r.mooncake_complete) == (0, False)
        finally:
            master.proc.send_signal(signal.SIGCONT)

        def loads() -> bool:
            forget_in_memory(b)
            try:
                return cb.get(NS, b"z-0", timeout=DEADLINE_S) == data[b"z-0"]
            except Miss:
                return False

        wait_until("it heals once the master answers", loads, 30)
        # The chunks reserved for calls given up on were freed once those ended.
        store = b.server.servicer.store
        forget_in_memory(b)
        wait_until("every reservation freed", lambda: store.used_bytes == 0, 15)


def test_a_master_down_at_start_is_misses_until_it_answers(tmp_path, server) -> None:
    """No master at start: the server starts SERVING (Mooncake's set-up, which
    would hold the process ~90 s against an absent master, is not even tried),
    Retrieves are misses in time, Stores succeed; once the master answers the
    tier sets up and works."""
    master = Master(tmp_path / "late-master")
    master.kill()
    try:
        b = server("b", **master.settings(HOST_B))
        assert health_status(b.address) == SERVING
        with KVCacheClient(b.address) as cb:
            t0 = time.monotonic()
            with pytest.raises(Miss):
                cb.get(NS, b"nothing", timeout=DEADLINE_S)
            assert time.monotonic() - t0 < DEADLINE_S
            assert cb.put(NS, items(1, b"early")).stored_chunks == 1
            time.sleep(2 * CALL_S)  # the watchdog would see a stall by now
            assert health_status(b.address) == SERVING
            master.start()
            tries = iter(range(1000))

            def works() -> bool:  # a new chunk each time: a present one is not rewritten
                cb.put(NS, items(1, b"late-%d" % next(tries)))
                return series(b, "kvsvc_tier_written_chunks_total") >= 1

            wait_until("the tier sets up once the master answers", works, 30)
        assert health_status(b.address) == SERVING
    finally:
        master.kill()
