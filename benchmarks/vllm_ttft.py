"""Time to first token with the vLLM connector: a full kvsvc hit vs recompute (no
connector), and what a miss adds over no connector, in one run.

Runs in the vLLM venv (``make vllm`` makes it)::

    .venv-vllm/bin/python -m benchmarks.vllm_ttft [--lengths 1024,2048,4096] [--reps 3]

A random Llama large enough that prefill costs real time on CPU (8 layers, hidden
1024, 8 KV heads, bf16) is built in a temp dir. Two engine processes run one after
the other on the same prompt lengths: one without a connector (recompute), one with
KvsvcConnector against a `kvsvc serve` started here. For each length and repetition,
the connector engine sees a fresh prompt twice: the first is a miss (computed, then
stored), the second a hit (loaded). TTFT is the wall time of ``generate`` with
``max_tokens=1`` (offline: prefill plus one sampled token). Prints a markdown table
and writes JSON to bench-results/vllm_ttft.json. ``--variants recompute,kvsvc,tier`` adds
vLLM's own OffloadingConnector with KvsvcTier below its CPU tier (KvsvcOffloadingSpec):
there a prompt of the longest length runs between the miss and the hit and evicts the
first from the CPU tier (sized to hold one such prompt), so the hit is loaded from kvsvc.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BLOCK = 128


# name -> (connector target: "" none, "server" the kvsvc started here, else an address
# nothing listens on; extra engine env). With a KV connector set, vLLM 0.32 reserves a
# second core for it; on <= 2 cores it then reserves none and binds its OpenMP threads to
# every core (docs/vllm.md): "kvsvc" is the documented setting there (one core reserved,
# as without a connector), the "-bind-all" variants show vLLM's default.
_SMALL_HOST = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"} if len(os.sched_getaffinity(0)) <= 2 else {}
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "recompute": ("", {}),
    "kvsvc": ("server", _SMALL_HOST),
    "kvsvc-down": ("127.0.0.1:9", _SMALL_HOST),
    "kvsvc-bind-all": ("server", {}),
    "recompute-bind-all": ("", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
    # vLLM's own OffloadingConnector (KvsvcOffloadingSpec) with KvsvcTier below its CPU
    # tier; a prompt of the longest length run between the miss and the hit evicts the
    # first from the CPU tier (sized to hold one), so the hit comes from kvsvc.
    "tier": ("server", _SMALL_HOST),
}
#: Bytes of one 128-token chunk of make_model's KV: layers x KV heads x head dim x K|V x bf16.
CHUNK_BYTES = 8 * 8 * 64 * 2 * BLOCK * 2


def make_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=2816,
        max_position_embeddings=8192,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def engine(args: argparse.Namespace) -> None:
    """One engine process: times each prompt of the plan, writes JSON."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    plan = json.loads(Path(args.plan).read_text())
    kwargs: dict[str, Any] = {}
    if plan["target"] and plan.get("cpu_bytes"):
        tier = {"type": "KvsvcTier", "module_path": "kvsvc.integrations.vllm.tier"}
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KvsvcOffloadingSpec",
                "spec_module_path": "kvsvc.integrations.vllm.offload_spec",
                "cpu_bytes_to_use": plan["cpu_bytes"],
                "secondary_tiers": [{**tier, "target": plan["target"]}],
            },
        )
    elif plan["target"]:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvsvcConnector",
            kv_connector_module_path="kvsvc.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"target": plan["target"]},
        )
    llm = LLM(
        model=plan["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.15,
        max_model_len=8192,
        max_num_seqs=1,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1] * 200)], params)  # warm-up
    out = []
    for item in plan["runs"]:
        t0 = time.perf_counter()
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=item["prompt"])], params)
        seconds = time.perf_counter() - t0
        out.append(
            {
                "kind": item["kind"],
                "length": len(item["prompt"]),
                "seconds": seconds,
                "cached": int(o.num_cached_tokens or 0),
            }
        )
        print(f"bench: {item['kind']} {len(item['prompt'])} tokens: {seconds:.3f} s", flush=True)
        if item.get("wait_stored"):
            time.sleep(item["wait_stored"])  # stores are asynchronous
    Path(args.out).write_text(json.dumps(out))
    del llm  # vLLM's shutdown ends its engine core


def run_engine(
    tmp: Path, name: str, plan: dict[str, Any], extra_env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    plan_path, out_path = tmp / f"{name}.plan.json", tmp / f"{name}.out.json"
    plan_path.write_text(json.dumps(plan))
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_RPC_BASE_PATH=str(tmp),  # its ZMQ sockets go with tmp, not stay in /tmp
    )
    env.update(extra_env or {})
    print(f"bench: engine {name} {extra_env or ''}", flush=True)
    cmd = [sys.executable, "-m", "benchmarks.vllm_ttft", "--engine", str(plan_path), str(out_path)]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=3600)
    return list(json.loads(out_path.read_text()))


def paired_overheads(
    base: list[dict[str, Any]], other: list[dict[str, Any]], kind: str, length: int
) -> list[float]:
    """``other``'s ``kind`` over recompute, rep by rep: the engines alternate per
    repetition, so rep i of each ran next to each other in time (a loaded host's
    swings cancel in the pair, not across the run)."""
    xs = [r["seconds"] for r in base if r["kind"] == "recompute" and r["length"] == length]
    ys = [r["seconds"] for r in other if r["kind"] == kind and r["length"] == length]
    return [y / x - 1 for x, y in zip(xs, ys, strict=False)]


def ci_text(xs: list[float], resamples: int = 2000) -> str:
    """Median and a bootstrap 95% interval of the median (seeded: reruns print the same)."""
    if not xs:
        return "-"
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    lo, hi = meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]
    return f"{100 * statistics.median(xs):+.1f}% [{100 * lo:+.1f}%, {100 * hi:+.1f}%], n={len(xs)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--variants",
        default="recompute,kvsvc",
        help=f"engines, alternated per repetition, from {','.join(VARIANTS)}",
    )
    p.add_argument("--engine", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        args.plan, args.out = args.engine
        engine(args)
        return
    from benchmarks.common import KvsvcServer

    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, 2000) for _ in range(n + 1)]  # +1: full blocks all hit

    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown or "recompute" not in variants:
        raise SystemExit(f"--variants: {sorted(unknown)} unknown, or no recompute")
    results_by: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="kvsvc-vllm-bench-") as d:
        tmp = Path(d)
        make_model(tmp / "model")
        with KvsvcServer(store_bytes="4G", shm_dir=str(tmp)) as server:
            # Engines alternate, one repetition each in turn: a loaded host's swings
            # then hit every variant alike.
            for rep in range(args.reps):
                for v in variants:
                    target, env = VARIANTS[v]
                    if target == "server":
                        target = server.address
                    runs = []
                    for n in lengths:
                        q = prompt(n)
                        if target:
                            runs += [{"kind": "miss", "prompt": q, "wait_stored": 2.0}]
                            if v == "tier":  # evicts q from vLLM's CPU tier
                                evict = prompt(max(lengths))
                                runs += [{"kind": "evict", "prompt": evict, "wait_stored": 2.0}]
                            if target == server.address:
                                runs += [{"kind": "hit", "prompt": q}]
                        else:
                            runs += [{"kind": "recompute", "prompt": q}]
                    plan = {"model": str(tmp / "model"), "target": target, "runs": runs}
                    if v == "tier":
                        plan["cpu_bytes"] = (max(lengths) // BLOCK) * CHUNK_BYTES
                    results_by[v] += run_engine(tmp, f"{v}-{rep}", plan, env)
    rows = []
    results: dict[str, Any] = {"lengths": lengths, "reps": args.reps, "rows": rows}
    print(
        "\n| prompt tokens | engine | recompute (no connector) s | kvsvc miss s | kvsvc hit s |"
        " hit speed-up | miss overhead | miss overhead, paired reps: median [95% CI] |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in lengths:

        def med(kind: str, src: list[dict[str, Any]], n: int = n) -> float:
            xs = [r["seconds"] for r in src if r["kind"] == kind and r["length"] == n + 1]
            return statistics.median(xs) if xs else float("nan")

        rc = med("recompute", results_by["recompute"])
        for v in variants[1:]:
            first = "miss" if VARIANTS[v][0] else "recompute"
            miss, hit = med(first, results_by[v]), med("hit", results_by[v])
            cached = [
                r["cached"] for r in results_by[v] if r["kind"] == "hit" and r["length"] == n + 1
            ]
            rows.append(
                {"tokens": n, "engine": v, "recompute_s": rc, "miss_s": miss, "hit_s": hit,
                 "hit_cached": cached,
                 "all": {k: [r["seconds"] for r in results_by[k] if r["length"] == n + 1]
                         for k in ("recompute", v)}}
            )  # fmt: skip
            paired = paired_overheads(results_by["recompute"], results_by[v], first, n + 1)
            rows[-1]["paired_overheads"] = paired
            print(f"| {n} | {v} | {rc:.3f} | {miss:.3f} | {hit:.3f} | {rc / hit:.1f}x |"
                  f" {100 * (miss / rc - 1):+.1f}% | {ci_text(paired)} |")  # fmt: skip
    out = REPO / "bench-results" / "vllm_ttft.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nhit loaded tokens per run: {[r['hit_cached'] for r in rows]}; JSON: {out}")


if __name__ == "__main__":
    main()
