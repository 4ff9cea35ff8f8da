"""What mapping vLLM's CPU KV cache into kvsvc costs the worker at start, per GiB:
``describe_kv_caches`` on a cache allocated as vLLM allocates it (one zeroed int8
buffer, bf16 views per layer), each round in a fresh process (as a worker).

Runs in the vLLM venv (``make vllm`` makes it)::

    .venv-vllm/bin/python -m benchmarks.vllm_kv_map [--gib 1] [--rounds 3] [--tree DIR ...]

``--tree`` (repeatable) names kvsvc checkouts to compare, run in alternating rounds
(default: this one). Prints a markdown table of the median seconds per GiB that
``register_kv_caches`` holds the worker (the hook) and until the cache's pages are
populated (a background thread's work, where it has one), and how the cache was
reached (in place, or through a mirror)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ONE_ROUND = """
import json, threading, time, torch
from kvsvc.integrations.vllm import region
n = int({gib} * (1 << 30)) // 2 * 2
buf = torch.zeros(n, dtype=torch.int8)
half = n // 2
blocks = half // (2 * 16 * 128 * 2)
views = [buf[i * half : i * half + blocks * 2 * 16 * 128 * 2].view(torch.bfloat16)
         .view(blocks, 2, 16, 128) for i in range(2)]
t0 = time.perf_counter()
kv = region.describe_kv_caches({{"a": views[0], "b": views[1]}}, blocks, 0, 1)
took = time.perf_counter() - t0
for t in threading.enumerate():
    if t.name == "kvsvc-populate":
        t.join()
ready = time.perf_counter() - t0
staging = getattr(kv, "staging", None) is not None
print(json.dumps({{"s": took, "ready": ready, "how": "mirror" if staging else "in place"}}))
"""


def one(tree: Path, gib: float) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", ONE_ROUND.format(gib=gib)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree", action="append", type=Path)
    ap.add_argument("--smoke", action="store_true", help="64 MiB, one round (CI)")
    args = ap.parse_args()
    gib, rounds = (1 / 16, 1) if args.smoke else (args.gib, args.rounds)
    trees = args.tree or [REPO]
    got: dict[Path, list[dict[str, object]]] = {t: [] for t in trees}
    for _ in range(rounds):
        for t in trees:
            got[t].append(one(t, gib))
    print(
        "| tree | the hook, s per GiB | populated, s per GiB | rounds | how |\n"
        "|---|---|---|---|---|"
    )
    for t, rs in got.items():
        hook = statistics.median(float(r["s"]) / gib for r in rs)  # type: ignore[arg-type]
        ready = statistics.median(float(r["ready"]) / gib for r in rs)  # type: ignore[arg-type]
        hows = sorted({str(r["how"]) for r in rs})
        print(f"| {t} | {hook:.2f} | {ready:.2f} | {len(rs)} | {', '.join(hows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
