"""What KvsvcTier costs vLLM's scheduler per call: the time each method vLLM calls
on its step (lookup, submit_store, submit_load, get_finished_jobs) holds that
thread, with kvsvc up and with kvsvc killed (goal: p99 <= 50 us). Then its bytes:
MiB/s of a store and a load job of 32 rows of 2 MiB (submit to JobResult, through
the tier's staging memfd), beside a plain copy of the same rows in this process.
The tier is built by vLLM's own TieringOffloadingSpec over a real /dev/shm offload
file (tests/e2e/vllm/tiering.py) against a `kvsvc serve` started here.

Runs in the vLLM venv (``make vllm`` makes it)::

    .venv-vllm/bin/python -m benchmarks.vllm_tier [--calls 20000] [--smoke]

Prints a markdown table and writes JSON to bench-results/vllm_tier.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "e2e" / "vllm"), str(REPO / "tests")]

from driver import KvsvcProcess  # noqa: E402
from tiering import Engine, new_keys  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm_helpers import free_port  # noqa: E402


def timed(fn: Callable[[int], Any], calls: int) -> dict[str, float]:
    """Per-call wall time of ``fn(i)`` in microseconds (p50, p99, max), and the p99
    of this thread's CPU time in it: wall minus CPU is time the call waited, mostly
    for the GIL while the tier's threads (or gRPC's) ran Python."""
    wall, cpu = np.empty(calls), np.empty(calls)
    clock, own = time.perf_counter_ns, time.thread_time_ns
    for i in range(calls):
        c0, t0 = own(), clock()
        fn(i)
        wall[i], cpu[i] = clock() - t0, own() - c0
    us = wall / 1000
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "max_us": float(us.max()),
        "cpu_p99_us": float(np.percentile(cpu / 1000, 99)),
    }


def measure(engine: Engine, calls: int, hit: list[bytes], jobs: int) -> dict[str, dict]:
    tier = engine.tier
    miss = new_keys(64)
    ctx = ReqContext("bench")
    chunk = np.array([3], dtype=np.int32)
    eight = np.arange(8, 16, dtype=np.int32)
    next_id = [10**6]

    def job(keys: list[bytes], chunks: np.ndarray) -> TransferJob:
        next_id[0] += 1
        return TransferJob(next_id[0], keys, chunks, is_promotion=False, req_context=ctx)

    def drain() -> None:
        end = time.monotonic() + 60
        while tier.has_pending_work() and time.monotonic() < end:
            tier.get_finished_jobs()
            time.sleep(0.001)

    rows = {
        "lookup (hit)": timed(lambda i: tier.lookup(hit[i % len(hit)], ctx), calls),
        "lookup (miss)": timed(lambda i: tier.lookup(miss[i % len(miss)], ctx), calls),
    }
    fresh = [new_keys(1) for _ in range(jobs)]
    rows["submit_store (1 chunk)"] = timed(lambda i: tier.submit_store(job(fresh[i], chunk)), jobs)
    drain()
    many = [new_keys(8) for _ in range(jobs)]
    rows["submit_store (8 chunks)"] = timed(lambda i: tier.submit_store(job(many[i], eight)), jobs)
    drain()
    rows["submit_load (8 chunks)"] = timed(lambda i: tier.submit_load(job(many[i], eight)), jobs)
    rows["get_finished_jobs"] = timed(lambda i: tier.get_finished_jobs(), calls)
    drain()
    return rows


def throughput(address: str, rows: int, row_bytes: int, rounds: int) -> dict[str, float]:
    """Median MiB/s of whole jobs (submit to JobResult) of ``rows`` rows, and of a
    numpy copy of the same rows between two halves of the primary view."""
    engine = Engine(target=address, row=row_bytes, chunks=2 * rows)
    tier, view = engine.tier, engine.rows
    try:
        view[:] = np.random.default_rng(1).integers(0, 256, view.shape, dtype=np.uint8)
        ctx = ReqContext("bench-bytes")

        def run(job_id: int, keys: list[bytes], load: bool) -> float:
            job = TransferJob(job_id, keys, np.arange(rows), load, req_context=ctx)
            t0 = time.perf_counter()
            (tier.submit_load if load else tier.submit_store)(job)
            done: list[Any] = []
            while not done:
                done = list(tier.get_finished_jobs())
                time.sleep(0.0002)
            assert done[0].success, (done, dict(tier.counters))
            return time.perf_counter() - t0

        stores, loads, copies = [], [], []
        for r in range(rounds + 1):  # the first round warms up (mapping, first faults)
            keys = new_keys(rows)
            s = run(2 * r, keys, False)
            ld = run(2 * r + 1, keys, True)
            t0 = time.perf_counter()
            view[rows:] = view[:rows]
            c = time.perf_counter() - t0
            if r:
                stores.append(s)
                loads.append(ld)
                copies.append(c)
        mib = rows * row_bytes / 2**20
        return {
            "store_mib_s": mib / float(np.median(stores)),
            "load_mib_s": mib / float(np.median(loads)),
            "copy_mib_s": mib / float(np.median(copies)),
        }
    finally:
        del view
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=20000, help="calls per lookup row")
    ap.add_argument("--jobs", type=int, default=200, help="jobs per submit row")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args()
    calls, jobs = (500, 20) if args.smoke else (args.calls, args.jobs)
    results: dict[str, Any] = {"machine": platform.platform(), "calls": calls, "jobs": jobs}
    with tempfile.TemporaryDirectory() as tmp:
        server = KvsvcProcess(free_port(), "", tmp)
        engine = Engine(target=server.address)
        try:
            hit = new_keys(16)
            engine.offload(hit, seed=0)
            engine.settle()
            engine.wait_index()
            results["up"] = measure(engine, calls, hit, jobs)
            rows, rounds = (4, 1) if args.smoke else (32, 5)
            results["bytes"] = throughput(server.address, rows, 2 << 20, rounds)
            server.kill()
            time.sleep(1.0)  # the index has seen its stream break
            results["down"] = measure(engine, calls, hit, jobs)
            results["counters"] = dict(engine.tier.counters)
        finally:
            engine.close()
            server.kill()
    print("| kvsvc | call | p50 µs | p99 µs | max µs | CPU p99 µs |\n|---|---|---|---|---|---|")
    for state in ("up", "down"):
        for name, r in results[state].items():
            p50, p99, top, cpu = r["p50_us"], r["p99_us"], r["max_us"], r["cpu_p99_us"]
            print(f"| {state} | {name} | {p50:.1f} | {p99:.1f} | {top:.0f} | {cpu:.1f} |")
    b = results["bytes"]
    print(
        f"a job of {rows} rows of 2 MiB: store {b['store_mib_s']:.0f} MiB/s, load "
        f"{b['load_mib_s']:.0f} MiB/s; a numpy copy of the same rows {b['copy_mib_s']:.0f} MiB/s"
    )
    print(f"tier counters: {results['counters']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_tier.json").write_text(json.dumps(results, indent=1))
    worst = max(r["p99_us"] for s in ("up", "down") for r in results[s].values())
    print(f"worst p99: {worst:.1f} µs (goal <= 50 µs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
