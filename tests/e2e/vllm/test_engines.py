"""KvsvcConnector in real vLLM engines (CPU), against real `kvsvc serve` processes.

Engine processes are slow to start (20-60 s here), so each module-scoped fixture
runs one engine through several steps and the tests assert on its record:
  - baseline: no connector, prompts A, B (shares A's first 3 blocks), C;
  - engine1, then engine2, sharing one kvsvc: A, then A and B;
  - faults: one engine that starts with kvsvc down, then meets a server that
    comes up, is killed, fails Retrieve, delays Retrieve, stalls a copy.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed", reason="the vLLM connector tests run in .venv-vllm: make vllm"
)

from driver import KvsvcProcess, poll
from vllm_helpers import connector_config, free_port, make_model, run_engine

BLOCK = 128  # vLLM's CPU block size
rng = random.Random(1)
A = [rng.randrange(1, 500) for _ in range(5 * BLOCK + 40)]  # 5 full blocks + a tail
B = A[: 3 * BLOCK] + [rng.randrange(1, 500) for _ in range(2 * BLOCK + 10)]
C = [rng.randrange(1, 500) for _ in range(5 * BLOCK + 40)]
# Generous for a loaded CI host: a lookup that misses its deadline is a miss, and
# these tests need their hits (the 50 ms default is for real deployments).
LOOKUP_TIMEOUT_S = 2.0


def gen(name: str, *prompts: list[int]) -> dict[str, Any]:
    return {"do": "generate", "name": name, "prompts": list(prompts)}


def step(run: dict[str, Any], name: str) -> dict[str, Any]:
    (rec,) = [s for s in run["steps"] if s["name"] == name]
    return rec


def segment(run: dict[str, Any], name: str) -> str:
    """The engine log written while step ``name`` ran (the driver marks steps)."""
    log = run["log"]
    start = log.index(f"driver: {name} start")
    return log[start : log.index(f"driver: {name} done", start)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def baseline(model: Path, work: Path) -> dict[str, list[int]]:
    run = run_engine(
        work,
        "baseline",
        {"model": str(model), "steps": [gen("A", A), gen("B", B), gen("C", C)]},
    )
    return {n: step(run, n)["outputs"][0] for n in "ABC"}


@pytest.fixture(scope="module")
def two_engines(model: Path, work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    port = free_port()
    server = KvsvcProcess(port, "", str(work))
    try:
        cfg = connector_config(port, log_level="DEBUG", lookup_timeout_s=LOOKUP_TIMEOUT_S)
        first = run_engine(
            work,
            "engine1",
            {"model": str(model), "kv_transfer_config": cfg, "steps": [gen("A", A)]},
        )
        # Its stores are asynchronous: they end within their deadline.
        poll(server.address, "engine1's 5 chunks", lambda i: i.stored_chunks >= 5, 30)
        second = run_engine(
            work,
            "engine2",
            {
                "model": str(model),
                "kv_transfer_config": cfg,
                "steps": [gen("A", A), gen("B", B)],
            },
        )
    finally:
        server.kill()
    return first, second


def test_second_engine_loads_what_the_first_stored(two_engines, baseline) -> None:
    first, second = two_engines
    assert step(first, "A")["cached"] == [0]
    assert step(first, "A")["outputs"][0] == baseline["A"]
    # Every full block but none of the tail: 5 blocks of 128 tokens.
    assert step(second, "A")["cached"] == [5 * BLOCK]
    assert step(second, "A")["outputs"][0] == baseline["A"]
    assert "5 of 5 chunks stored" in segment(second, "A")


def test_shared_prefix_loads_exactly_the_shared_full_blocks(two_engines, baseline) -> None:
    _, second = two_engines
    assert step(second, "B")["cached"] == [3 * BLOCK]
    assert step(second, "B")["outputs"][0] == baseline["B"]


# --- one engine through kvsvc's failures ---
FAULT_CFG = {
    "log_level": "DEBUG",
    "lookup_timeout_s": LOOKUP_TIMEOUT_S,
    "load_timeout_s": 1.5,
    "store_timeout_s": 8,
    "fence_timeout_s": 10,
    "reconnect_interval_s": 1.0,
}
STALL_MS = 4000


def _serve(failpoints: str = "") -> list[dict[str, Any]]:
    return [{"do": "serve", "failpoints": failpoints}, {"do": "wait_mapped"}]


def _store_a(tag: str) -> list[dict[str, Any]]:
    return [gen(f"{tag}-store", A), {"do": "wait_stored", "chunks": 5}]


@pytest.fixture(scope="module")
def faults(model: Path, work: Path) -> dict[str, Any]:
    port = free_port()
    steps = [
        gen("down", A),
        *_serve(),
        *_store_a("up"),
        gen("up-hit", A),
        {"do": "kill"},
        gen("killed", A),
        *_serve("handler.enter=Retrieve@raise"),
        *_store_a("fail"),
        gen("fail", A),
        {"do": "kill"},
        *_serve(f"handler.enter=Retrieve@sleep({STALL_MS})"),
        *_store_a("delay"),
        gen("delay", A),
        {"do": "kill"},
        *_serve(f"transfer.copy=sleep({STALL_MS})"),
        *_store_a("stall"),
        gen("stall", A),
        {"do": "kill"},
    ]
    return run_engine(
        work,
        "faults",
        {
            "model": str(model),
            "port": port,
            "kv_transfer_config": connector_config(port, **FAULT_CFG),
            "steps": steps,
        },
    )


def test_kvsvc_down_at_start_engine_serves_with_bounded_lookups(faults, baseline) -> None:
    down = step(faults, "down")
    assert down["cached"] == [0]
    assert down["outputs"][0] == baseline["A"]
    assert "kvsvc unreachable" in faults["log"]
    # Every lookup, failed or not, ended near its deadline (margin for a loaded host).
    times = [float(ms) for ms in re.findall(r"kvsvc lookup \S+: .*?([\d.]+) ms", faults["log"])]
    assert times, "no lookup was logged"
    assert max(times) < LOOKUP_TIMEOUT_S * 1000 + 450, times


def test_connector_reconnects_when_kvsvc_comes_back(faults, baseline) -> None:
    assert step(faults, "up-store")["cached"] == [0]
    hit = step(faults, "up-hit")
    assert hit["cached"] == [5 * BLOCK]
    assert hit["outputs"][0] == baseline["A"]


def test_kvsvc_killed_between_requests_is_a_miss(faults, baseline) -> None:
    """Either the presence index already knew (unknown: the Lookup RPC failed, a
    miss) or its hint was stale (the Retrieve failed: recomputed); never wrong."""
    killed = step(faults, "killed")
    assert killed["outputs"][0] == baseline["A"]
    log = segment(faults, "killed")
    if "failed after" in log:
        assert killed["cached"] == [0]
    else:
        assert re.search(r"load of request \S+ failed", log), log[-3000:]


@pytest.mark.parametrize("name", ["fail", "delay", "stall"])
def test_failed_retrieve_is_recomputed_with_failed_blocks_reported(faults, baseline, name) -> None:
    rec = step(faults, name)
    assert rec["outputs"][0] == baseline["A"]
    log = segment(faults, name)
    assert "5 of 5 chunks stored" in log  # the lookup hit, so a load was planned
    assert re.search(r"load of request \S+ failed \(5 blocks\)", log), log[-3000:]
    # Once: the recomputing request is not looked up and loaded again (no retry loop).
    assert len(re.findall(r"load of request \S+ failed", log)) == 1, log[-3000:]


def test_retrieve_failpoint_is_reported_not_started(faults) -> None:
    log = segment(faults, "fail")
    assert "ended without proof" not in log  # the server said NOT_STARTED: no fence needed


def test_delayed_retrieve_is_fenced_before_blocks_are_released(faults) -> None:
    log = segment(faults, "delay")
    unproven = log.index("ended without proof")
    fenced = log.index("fence proved the load")
    failed = re.search(r"load of request \S+ failed", log)
    assert failed is not None
    assert unproven < fenced < failed.start()


def test_stalled_copy_holds_blocks_until_the_fence(faults) -> None:
    """The copy sleeps STALL_MS inside the server, past the 1.5 s load deadline:
    the blocks go back to vLLM (reported failed) only after the Fence, which
    had to wait for the copy."""
    log = segment(faults, "stall")
    unproven = log.index("ended without proof")
    m = re.search(r"fence proved the load of request \S+ ended \(([\d.]+) s after", log)
    assert m is not None, log[-3000:]
    failed = re.search(r"load of request \S+ failed", log)
    assert failed is not None
    assert unproven < m.start() < failed.start()
    # The fence waited for the stalled copy (it ran well past the deadline).
    assert float(m.group(1)) >= 1.0
    assert step(faults, "stall")["seconds"] >= (STALL_MS / 1000) - 1.5
