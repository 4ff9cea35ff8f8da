"""Every kvsvc benchmark, each beside its reference measured in the same run on
the same machine, in one command:

    python -m benchmarks.run [--quick | --smoke] [--out bench-results]

Sections (each runs in this process tree; servers are child processes):
1. data plane: Store/Retrieve over shared memory vs a torch copy and raw
   preadv/pwritev of the same bytes (benchmarks/data_plane.py);
2. control plane: Lookup p50/p99 and throughput at 1, 8, 32 callers vs a bare
   gRPC echo (TCP and unix socket), a ZMQ + msgpack echo, and LMCache's
   multiprocess server over ZMQ and gRPC (benchmarks/control_plane.py);
3. + 4. error path and failure detection: benchmarks/fault_detection.py;
5. memory: server RSS vs store capacity, and drift over a soak (benchmarks/memory.py);
6. GPU: pinned H2D/D2H through the service vs copy_ (benchmarks/gpu.py; skipped
   without a GPU);
7. events: the WatchEvents stream and the presence index (benchmarks/events.py);
8. disk: the disk tier's Store-to-disk and load-from-disk vs dd on the same
   filesystem, and the warm restart's index rebuild (benchmarks/disk_tier.py);
9. SGLang: kvsvc as SGLang's HiCache storage vs SGLang's HiCacheFile and a copy
   (benchmarks/sglang.py; skipped, with the reason, where SGLang does not import:
   ``make sglang`` runs it in .venv-sglang);
then, for each goal missed, a py-spy profile of the server under that load
(benchmarks/profile_server.py; skipped, with the reason printed, where py-spy
cannot attach). Writes results.md, results.json and PNG plots into --out; exits
1 if a section failed, naming it.

``--smoke`` runs every section at tiny sizes (under 2 minutes on 2 cores), and
always one short profile and the Lookup cost ladder: it checks that the
benchmarks still run (``make bench-smoke``, part of ``make test``); its figures
mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import (
    control_plane,
    data_plane,
    disk_tier,
    events,
    gpu,
    lookup_cost,
    memory,
    profile_server,
)
from benchmarks import sglang as sglang_bench
from benchmarks.common import REPO, Progress, machine_info, machine_line, md_table

SECTIONS = ("data", "control", "faults", "memory", "gpu", "events", "disk", "sglang", "profile")
WELL_UNDER = 0.5  # "p99 well under LMCache's gRPC transport": at most half of it


def git_state() -> str:
    """The commit measured, and whether kvsvc/ differs from it (read-only git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "kvsvc"], cwd=REPO, text=True,
                               capture_output=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{head}{' with uncommitted changes in kvsvc/' if dirty else ''}"


# --- 3 + 4: the fault benchmark, another script ---
def run_fault_detection(size: str, progress: Progress, out_dir: Path) -> dict[str, Any]:
    """Run benchmarks/fault_detection.py (``size``: "full", "quick" or "smoke") and
    read its markdown tables."""
    script = REPO / "benchmarks" / "fault_detection.py"
    if not script.exists():
        raise RuntimeError(f"{script} does not exist")
    cmd = [sys.executable, "-m", "benchmarks.fault_detection", "--out", str(out_dir),
           *([f"--{size}"] if size != "full" else [])]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    timer = threading.Timer(1800, proc.kill)  # bounded: 30 minutes at most
    timer.start()
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        for line in proc.stderr or []:
            progress.log(f"fault_detection: {line.rstrip()}")
        rc = proc.wait()
    finally:
        timer.cancel()
    reader.join(30)
    stdout = "".join(out)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{stdout[-2000:]}")

    def row(label: str) -> list[float] | None:
        for line in stdout.splitlines():
            if line.startswith("|") and label in line:
                cells = [c.strip() for c in line.strip("|").split("|")]
                nums = []
                for c in cells[1:]:
                    try:
                        nums.append(float(c))
                    except ValueError:
                        continue
                return nums
        return None

    return {
        "command": " ".join(cmd[1:]),
        "stdout": stdout,
        "detect": row("NOT_SERVING"),  # [median ms, max ms]
        # the first rows of each: 1 caller, [p50, p99, mean] ms (then CPU µs a call)
        "failed": (row("raises in handler") or [])[-4:-1] or None,
        "ok": (row("succeeds") or [])[-4:-1] or None,
        # error p99 / success p99 at each caller count (fault_detection.CALLERS)
        "ratios": row("handler fault p99 ratio"),
        "typed_ratios": row("typed error p99 ratio"),
        "injections": (m := re.search(r"\((\d+) injections", stdout)) and int(m.group(1)),
    }


# --- goals ---
def data_goals(rows: list[dict]) -> dict[str, Any]:
    """Judged on the fast region kind (sealed memfd); the file kind is reported."""
    detail = []
    met_all = bool(rows)
    for region in data_plane.REGIONS:
        sel = [r for r in rows if r["region"] == region]
        if not sel:
            continue
        ratios = [r["kvsvc"] / r["plain"] for r in sel]
        cold = [r["kvsvc_cold"] / r["plain_cold"] for r in sel]
        met = sum(x >= 0.95 for x in ratios)
        if region == data_plane.REGIONS[0]:
            met_all = met == len(sel)
        detail.append(f"{region}: {met} of {len(sel)} rows reach 0.95 of the torch copy "
                      f"(kvsvc/torch {min(ratios):.2f} to {max(ratios):.2f}; over the cold sets "
                      f"(the stored rounds still whole), {sum(x >= 0.95 for x in cold)} rows, "
                      f"{min(cold):.2f} to {max(cold):.2f})")  # fmt: skip
    return {"met": met_all, "detail": "; ".join(detail)}


def control_goals(rs: list[dict]) -> dict[str, Any]:
    """p50 against the grpc echo of the same transport and caller kind, p99
    against LMCache's gRPC transport at the same concurrency."""
    p50: dict[str, list[str]] = {}
    p99: dict[str, list[str]] = {}
    ok_p50 = ok_p99 = True
    worst50 = 0.0
    for r in rs:
        if r["target"] != "kvsvc Lookup" or r["client"].startswith("raw"):
            continue
        kind = "grpc.aio" if "asyncio" in r["client"] else "grpc channel (sync)"
        who = f"{r['transport']} {'async' if 'asyncio' in r['client'] else 'sync'}"
        echo = control_plane.find(rs, "grpc echo", r["transport"], kind, r["concurrency"])
        if echo is not None:
            x = r["p50_ms"] / echo["p50_ms"]
            worst50 = max(worst50, x)
            ok_p50 &= x <= 1.2
            p50.setdefault(who, []).append(f"{x:.2f}")
        lm = control_plane.find(rs, "LMCache get_chunk_size", "lmcache grpc", "its client",
                                r["concurrency"])  # fmt: skip
        if lm is not None and r["transport"] == "tcp":
            x = r["p99_ms"] / lm["p99_ms"]
            ok_p99 &= x <= WELL_UNDER
            p99.setdefault(who, []).append(f"{x:.2f}")
    levels = "/".join(f"x{n}" for n in control_plane.CONCURRENCY)
    return {
        "p50_met": ok_p50 and bool(p50),
        "p99_met": ok_p99 and bool(p99),
        "p50": f"kvsvc p50 / echo p50 at {levels}: "
        + "; ".join(f"{k} {' / '.join(v)}" for k, v in p50.items()),
        "p99": (
            f"kvsvc p99 / LMCache gRPC get_chunk_size p99 at {levels}: "
            + "; ".join(f"{k} {' / '.join(v)}" for k, v in p99.items())
        )
        if p99
        else "",
        "worst_p50": worst50,
    }


# --- plots ---
def plots(out: Path, results: dict[str, Any], progress: Progress) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress.log("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    made = []
    rows = results.get("data_plane") or []
    if rows:
        regions = [g for g in data_plane.REGIONS if any(r["region"] == g for r in rows)]
        fig, grid = plt.subplots(len(regions), 2, figsize=(13, 4.5 * len(regions)),
                                 sharey=True, squeeze=False)  # fmt: skip
        for ax, (region, op) in zip(
            grid.flat, [(g, o) for g in regions for o in ("store", "retrieve")], strict=True
        ):
            sel = [r for r in rows if r["op"] == op and r["region"] == region]
            xs = range(len(sel))
            w = 0.27
            for k, (key, label) in enumerate((("kvsvc", "kvsvc"), ("plain", "torch copy"),
                                              ("pread", "preadv/pwritev"))):  # fmt: skip
                ax.bar([x + (k - 1) * w for x in xs], [r[key] for r in sel], w, label=label)
            ax.set_xticks(list(xs))
            ax.set_xticklabels([f"{r['chunk']}MiB\nx{r['batch']}\n{r['clients']}cl" for r in sel],
                               fontsize=8)  # fmt: skip
            ax.set_title(f"{op}, {region} regions (GB/s, higher is better)")
            ax.grid(axis="y", alpha=0.3)
        grid[0][0].legend()
        fig.tight_layout()
        fig.savefig(out / "data_plane.png", dpi=110)
        plt.close(fig)
        made.append("data_plane.png")
    cp = results.get("control_plane_rows") or []
    if cp:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        series = [
            ("kvsvc Lookup", "tcp", "AsyncKVCacheClient", "kvsvc, AsyncKVCacheClient (tcp)"),
            ("kvsvc Lookup", "tcp", "raw grpc.aio", "kvsvc, raw grpc.aio stub (tcp)"),
            ("grpc echo", "tcp", "grpc.aio", "grpc.aio echo (tcp)"),
            ("kvsvc Lookup", "unix", "AsyncKVCacheClient", "kvsvc, AsyncKVCacheClient (unix)"),
            ("grpc echo", "unix", "grpc.aio", "grpc.aio echo (unix)"),
            ("zmq + msgpack echo", "zmq tcp", "DEALER", "zmq + msgpack echo"),
            ("kvsvc Lookup", "tcp", "KVCacheClient", "kvsvc, sync client threads (tcp)"),
            ("LMCache get_chunk_size", "lmcache grpc", "its", "LMCache gRPC, its client threads"),
            ("LMCache get_chunk_size", "lmcache zmq", "its", "LMCache ZMQ, its client threads"),
        ]
        for ax, key in zip(axes, ("p50_ms", "p99_ms"), strict=True):
            for target, transport, client, label in series:
                pts = [control_plane.find(cp, target, transport, client, n)
                       for n in control_plane.CONCURRENCY]  # fmt: skip
                if all(p is not None for p in pts):
                    ax.plot(control_plane.CONCURRENCY, [p[key] for p in pts], marker="o",
                            label=label, linestyle="--" if "LMCache" in label else "-")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(list(control_plane.CONCURRENCY))
            ax.set_xticklabels([str(n) for n in control_plane.CONCURRENCY])
            ax.set_xlabel("concurrent callers")
            ax.set_title(f"{key.replace('_ms', '')} latency (ms, lower is better)")
            ax.grid(alpha=0.3, which="both")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "control_plane.png", dpi=110)
        plt.close(fig)
        made.append("control_plane.png")
    mem = results.get("memory")
    if mem:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        s = mem["soak"]
        axes[0].plot([t for t, _ in s["samples"]], [v / (1 << 20) for _, v in s["samples"]])
        axes[0].set_xlabel("seconds of mixed traffic")
        axes[0].set_ylabel("server VmRSS (MiB)")
        axes[0].set_title(f"soak, store {s['capacity'] >> 20} MiB")
        axes[0].grid(alpha=0.3)
        fills = mem["fills"]
        xs = range(len(fills))
        w = 0.25
        for k, (key, label) in enumerate((("start", "at start"), ("filled", "after fill"),
                                          ("churned", "after churn"))):  # fmt: skip
            rss = [f[key]["VmRSS"] / (1 << 20) for f in fills]
            axes[1].bar([x + (k - 1) * w for x in xs], rss, w, label=label)
        for x, f in zip(xs, fills, strict=True):
            axes[1].hlines(f["capacity"] / (1 << 20), x - 1.5 * w, x + 1.5 * w, colors="k",
                           linestyles="--", label="store capacity" if x == 0 else None)  # fmt: skip
        axes[1].set_xlim(-0.6, len(fills) - 0.4)
        axes[1].set_xticks(list(xs))
        axes[1].set_xticklabels([f"{f['capacity'] >> 20} MiB store" for f in fills])
        axes[1].set_ylabel("server VmRSS (MiB)")
        axes[1].legend()
        axes[1].grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=110)
        plt.close(fig)
        made.append("memory.png")
    fd = results.get("faults")
    if fd and fd.get("failed") and fd.get("ok"):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        labels = ["p50", "p99"]
        axes[0].bar([0 - 0.2, 1 - 0.2], fd["ok"][:2], 0.4, label="succeeds")
        axes[0].bar([0 + 0.2, 1 + 0.2], fd["failed"][:2], 0.4, label="fails in handler")
        axes[0].set_xticks([0, 1])
        axes[0].set_xticklabels(labels)
        axes[0].set_ylabel("ms")
        axes[0].set_title("Lookup: error path vs success")
        axes[0].legend()
        if fd.get("detect"):
            axes[1].bar(["median", "max"], fd["detect"][:2])
            axes[1].set_ylabel("ms")
            axes[1].set_title("fault -> NOT_SERVING seen by Watch")
        fig.tight_layout()
        fig.savefig(out / "faults.png", dpi=110)
        plt.close(fig)
        made.append("faults.png")
    return made


# --- the report ---
def report(args: argparse.Namespace, results: dict[str, Any], info: dict[str, str],
           started: float, made: list[str]) -> str:  # fmt: skip
    mode = size_of(args)
    flag = f" --{mode}" if mode != "full" else ""
    md = [
        f"# kvsvc benchmarks ({mode} run)",
        "",
        f"`python -m benchmarks.run{flag} --out {args.out}`, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{(time.monotonic() - started) / 60:.1f} min, kvsvc at {git_state()}.",
        "",
        f"Machine: {machine_line(info)}.",
        "Every figure is beside its reference, measured in the same run on this machine.",
        "",
    ]
    goals: list[tuple[str, str, str]] = []
    err = results.get("errors", {})
    # 1
    md += ["## 1. Data plane (GB/s)", ""]
    if "data_plane" in results:
        rows = results["data_plane"]
        md += [data_plane.table(rows), ""]
        g = data_goals(rows)
        goals.append(("data plane >= 0.95 of the plain copy", "met" if g["met"] else "MISSED",
                      g["detail"]))  # fmt: skip
    elif "data" in err:
        md += [f"Failed: {err['data']}", ""]
    # 2
    md += ["## 2. Control plane (Lookup vs references)", ""]
    if "control_plane_rows" in results:
        rs = results["control_plane_rows"]
        md += [control_plane.table(rs), ""]
        md += [f"- {n}" for n in results["control_plane_notes"]] + [""]
        g = control_goals(rs)
        goals.append(("Lookup p50 <= 1.2x bare gRPC echo", "met" if g["p50_met"] else "MISSED",
                      g["p50"]))  # fmt: skip
        goals.append((f"Lookup p99 well under (<= {WELL_UNDER}x) LMCache gRPC",
                      ("met" if g["p99_met"] else "MISSED") if g["p99"] else "not measured",
                      g["p99"] or "LMCache did not run"))  # fmt: skip
        goals += control_plane.session_goals(rs)
    elif "control" in err:
        md += [f"Failed: {err['control']}", ""]
    # 3 + 4
    md += ["## 3. Error path and 4. failure detection (benchmarks/fault_detection.py)", ""]
    fd = results.get("faults")
    if fd:
        md += [f"From `python {fd['command']}`:", ""]
        body = fd["stdout"].split("\n", 1)[-1].strip()
        md += [re.sub(r"^## ", "### ", body, flags=re.M), ""]
        if fd["ratios"]:
            worst = max(fd["ratios"])
            typed = ", ".join(f"{x:.2f}" for x in fd["typed_ratios"] or [])
            goals.append(("error path p99 <= 1.5x success (x1, x8, x32 callers)",
                          "met" if worst <= 1.5 else "MISSED",
                          f"handler fault {', '.join(f'{x:.2f}' for x in fd['ratios'])}; "
                          f"typed error {typed}"))  # fmt: skip
        if fd["detect"]:
            goals.append(("fault -> NOT_SERVING (Watch)", "measured (no goal set)",
                          f"median {fd['detect'][0]:.2f} ms, max {fd['detect'][1]:.2f} ms over "
                          f"{fd['injections']} injections"))  # fmt: skip
    elif "faults" in err:
        md += [f"Failed: {err['faults']}", ""]
    # 5
    md += ["## 5. Memory (server RSS)", ""]
    if "memory" in results:
        md += [memory.tables(results["memory"]), ""]
        s = results["memory"]["soak"]
        goals.append(("memory: RSS drift over the soak", "measured (no goal set)",
                      f"{s['drift'] / (1 << 20):+.1f} MiB over {s['seconds']:.0f} s "
                      f"(slope {s['slope_mib_per_min']:+.2f} MiB/min, 2nd half)"))  # fmt: skip
    elif "memory" in err:
        md += [f"Failed: {err['memory']}", ""]
    # 6
    md += ["## 6. GPU (pinned D2H / H2D through the service)", ""]
    if "gpu" in results:
        md += [gpu.table(results["gpu"]), ""]
    elif "gpu" in err:
        md += [f"Failed: {err['gpu']}", ""]
    if "events" in results or "events" in err:
        md += ["## 7. Events stream and presence index (benchmarks/events.py)", ""]
        for name, figures in results.get("events", {}).items():
            rows = [(k, f"{v:.3g}" if isinstance(v, float) else v) for k, v in figures.items()]
            md += [f"### {name}", "", md_table(["figure", "value"], rows), ""]
        if "events" in err:
            md += [f"Failed: {err['events']}", ""]
    if "disk" in results:
        d = results["disk"]
        md += ["## 8. Disk tier (benchmarks/disk_tier.py)", "", d["filesystem"], "",
               disk_tier.tables(d["throughput"], d["rebuild"]), ""]  # fmt: skip
        goals += disk_tier.goals(d)
    elif "disk" in err:
        md += ["## 8. Disk tier (benchmarks/disk_tier.py)", "", f"Failed: {err['disk']}", ""]
    if "sglang" in results or "sglang" in err:
        md += ["## 9. SGLang HiCache storage (benchmarks/sglang.py)", ""]
        sg = results.get("sglang", {})
        if "skipped" in sg:
            md += [f"Skipped: {sg['skipped']}", ""]
        elif sg:
            md += [sglang_bench.table(sg), ""]
            goals += sglang_bench.goals(sg)
        if "sglang" in err:
            md += [f"Failed: {err['sglang']}", ""]
    # goals and profiles
    md += ["## Goals", "", md_table(["goal", "verdict", "detail"], goals), ""]
    if results.get("profiles_skipped"):
        md += ["## Profiles", "", f"Skipped: {results['profiles_skipped']}.", ""]
    if results.get("profiles"):
        md += ["## Profiles of the missed goals (py-spy, `kvsvc serve` and its caller)", ""]
        for p in results["profiles"]:
            md += [profile_server.markdown(p), ""]
    if results.get("lookup_cost"):
        md += ["### Lookup server CPU by difference (benchmarks/lookup_cost.py)", "",
               "Raw grpc.aio stub, 8 asyncio tasks; each server adds one layer to the one above.",
               "", lookup_cost.table(results["lookup_cost"]), ""]  # fmt: skip
    if err:
        md += ["## Sections that failed", ""]
        md += [f"- {k}: {v.splitlines()[0] if v else v}" for k, v in err.items()] + [""]
    if made:
        md += ["## Plots", ""] + [f"![{m}]({m})" for m in made] + [""]
    return "\n".join(md)


def size_of(args: argparse.Namespace) -> str:
    """ "smoke", "quick" or "full"."""
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sizes = ap.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="shorter measurements (~10 minutes)")
    sizes.add_argument("--smoke", action="store_true",
                       help="tiny sizes, every section: checks that they run")  # fmt: skip
    ap.add_argument("--out", default="bench-results", help="results folder")
    ap.add_argument("--only", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--no-lmcache", action="store_true", help="skip LMCache in the control plane")
    ap.add_argument("--lmcache-python", default=None,
                    help="Python that has lmcache (default: $KVSVC_BENCH_LMCACHE_PYTHON, "
                         f"{control_plane.DEFAULT_LMCACHE_PYTHON}, this Python)")  # fmt: skip
    ap.add_argument("--soak-seconds", type=float, default=None,
                    help="memory soak seconds (120; --quick 20, --smoke 3)")  # fmt: skip
    args = ap.parse_args()
    smoke = args.smoke
    quick = args.quick or smoke
    clients = [1, 2] if smoke else [1, 4]
    out = Path(args.out)
    if not out.is_absolute():
        out = Path.cwd() / out
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    info = machine_info()
    has_gpu, gpu_why = gpu.gpu_available()
    only = set(args.only)
    gpu_cases = len(gpu.SMOKE_CASES if smoke else gpu.CASES) if has_gpu else 1
    steps = (
        (len(data_plane.cases(clients, smoke=smoke)) if "data" in only else 0)
        + (control_plane.planned_steps(not args.no_lmcache) if "control" in only else 0)
        + (1 if "faults" in only else 0)
        + (len(memory.capacities(quick, smoke)) + 1 if "memory" in only else 0)
        + (gpu_cases if "gpu" in only else 0)
        + (len(events.SECTIONS) if "events" in only else 0)
        + (1 if "disk" in only else 0)
        + (1 if "sglang" in only else 0)
    )
    progress = Progress(steps, "kvsvc bench")
    progress.log(f"machine: {machine_line(info)}")
    results: dict[str, Any] = {"machine": info, "size": size_of(args), "errors": {}}

    def section(name: str, fn: Any) -> None:
        if name not in only:
            return
        t0 = time.monotonic()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - recorded; the other sections still run
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
            progress.log(f"section {name} FAILED:\n{traceback.format_exc()}")
        progress.log(f"section {name}: {time.monotonic() - t0:.0f} s")

    def do_data() -> None:
        results["data_plane"] = data_plane.run(quick=quick, smoke=smoke, clients=clients,
                                               progress=progress)  # fmt: skip

    def do_control() -> None:
        r = control_plane.run(quick=quick, smoke=smoke, lmcache=not args.no_lmcache,
                              lmcache_py=args.lmcache_python, progress=progress)  # fmt: skip
        results["control_plane_rows"] = control_plane.rows(r)
        results["control_plane_notes"] = r["notes"]

    def do_faults() -> None:
        try:
            results["faults"] = run_fault_detection(size_of(args), progress, out)
        finally:
            progress.step("fault detection")

    def do_memory() -> None:
        results["memory"] = memory.run(quick=quick, smoke=smoke, soak_seconds=args.soak_seconds,
                                       progress=progress)  # fmt: skip

    def do_gpu() -> None:
        if not has_gpu:
            progress.log(gpu_why)
            results["gpu"] = {"skipped": gpu_why, "rows": []}
            progress.step("gpu (skipped)")
            return
        results["gpu"] = gpu.run(quick=quick, smoke=smoke, progress=progress)

    def do_events() -> None:
        results["events"] = {}
        for name, fn in events.SECTIONS.items():  # each prints its figures
            try:
                results["events"][name] = fn(size_of(args))
            finally:
                progress.step(f"events {name}")

    def do_disk() -> None:
        try:
            results["disk"] = disk_tier.run(size_of(args))
        finally:
            progress.step("disk tier")

    def do_sglang() -> None:
        try:
            why = sglang_bench.unavailable()
            if why:
                progress.log(f"sglang: skipped: {why}")
                results["sglang"] = {"skipped": why}
                return
            size = sglang_bench.SMOKE if smoke else sglang_bench.FULL
            results["sglang"] = sglang_bench.measure(size, 2 if smoke else 3 if quick else 5)
        finally:
            progress.step("sglang")

    def do_profile() -> None:
        ok, why = profile_server.can_profile()
        if not ok:
            progress.log(why)
            results["profiles_skipped"] = why
            return
        todo: list[dict[str, Any]] = []
        secs = 1.0 if smoke else 4.0 if quick else 8.0
        if smoke:  # one short profile and the Lookup ladder, whatever the goals say
            todo.append(dict(mode="lookup", concurrency=2, store_bytes=64 << 20))
            progress.add(1)
            results["lookup_cost"] = lookup_cost.run(seconds=0.3, rounds=1, concurrency=2,
                                                     progress=progress)  # fmt: skip
        elif "data_plane" in results and not data_goals(results["data_plane"])["met"]:
            todo += [dict(mode="store", chunk_blocks=16, batch=16),
                     dict(mode="retrieve", chunk_blocks=16, batch=16),
                     dict(mode="store", chunk_blocks=1, batch=1)]  # fmt: skip
        if (
            not smoke
            and "control_plane_rows" in results
            and not control_goals(results["control_plane_rows"])["p50_met"]
        ):
            todo.append(dict(mode="lookup", concurrency=8))
            progress.add(1)
            results["lookup_cost"] = lookup_cost.run(
                seconds=2.0 if quick else 4.0, rounds=1 if quick else 2, progress=progress
            )
        progress.add(len(todo))
        results["profiles"] = []
        for kw in todo:
            results["profiles"].append(profile_server.profile(seconds=secs, **kw))
            progress.step(f"profile {kw['mode']}")

    section("data", do_data)
    section("control", do_control)
    section("faults", do_faults)
    section("memory", do_memory)
    section("gpu", do_gpu)
    section("events", do_events)
    section("disk", do_disk)
    section("sglang", do_sglang)
    section("profile", do_profile)
    progress.close()

    made = plots(out, results, progress)
    text = report(args, results, info, started, made)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_json_default))
    print(text)
    print(f"\nwritten: {out / 'results.md'}, results.json, {', '.join(made) or 'no plots'}",
          file=sys.stderr)  # fmt: skip
    if results["errors"]:
        print(f"benchmarks.run: FAILED section(s): {', '.join(results['errors'])}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


if __name__ == "__main__":
    raise SystemExit(main())
