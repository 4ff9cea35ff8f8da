"""Where a `kvsvc serve` spends its CPU under a given load: py-spy samples the
server process (and, for the Lookup load, the calling process too) while the
load runs, and the samples are summed per thread, per innermost function
("self") and per function anywhere on the stack ("inclusive"), as shares of
all samples of busy threads (py-spy leaves idle threads out).

Loads:
* ``lookup``: Lookup of 8 present keys, AsyncKVCacheClient, N asyncio tasks;
* ``lookup-error``: the same Lookup with an empty key among them (a typed error,
  ``InvalidRequest``), to set the error path's cost beside success's;
* ``store`` / ``retrieve``: block Store / Retrieve of 16 chunks of 32 MiB over
  shared memory, one client.

    python -m benchmarks.profile_server lookup [--seconds 8] [--concurrency 8]

Needs py-spy (pip install py-spy) and the right to read the server's memory
(root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import KvsvcServer, md_table, thread_cpu
from kvsvc.client import AsyncKVCacheClient, KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.errors import InvalidRequest

KEYS = [b"%032d" % i for i in range(8)]
LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
FRAME_RE = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def py_spy() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


def can_profile() -> tuple[bool, str]:
    """(whether py-spy can sample a server this process starts, why not). Yama's
    ptrace_scope 1 (Ubuntu's default) lets a process trace only its descendants,
    and py-spy is the server's sibling: only root (or scope 0) can."""
    if py_spy() is None:
        return False, "py-spy is not installed (pip install -e '.[bench]'): profiles skipped"
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        scope = 0  # no Yama: classic ptrace rules (same user may trace)
    if scope > 0 and os.geteuid() != 0:
        return False, (
            f"kernel.yama.ptrace_scope is {scope} and this is not root: py-spy cannot "
            "attach to the server, profiles skipped"
        )
    return True, ""


def start_record(
    pid: int, seconds: float, out: Path, rate: int = 250, extra: list[str] | None = None
) -> subprocess.Popen:
    extra = [*(extra or []), "--nonblocking"]
    exe = py_spy()
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
         "--format", "raw", "--threads", *extra, "-o", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish_record(proc: subprocess.Popen, out: Path, timeout: float) -> str:
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate(30)
    if not out.exists():
        raise RuntimeError(f"py-spy wrote nothing: {log[-2000:]}")
    return out.read_text()


def _frame(frame: str, line: bool = False) -> str:
    m = FRAME_RE.match(frame.strip())
    if not m:
        return frame.strip()
    file = m.group("file")
    short = "/".join(file.split("/")[-2:]) if "/" in file else file
    if line and m.group("line"):
        short += f":{m.group('line')}"
    return f"{m.group('func')} ({short})"


def summarize(raw: str, top: int = 15) -> dict[str, Any]:
    """Shares of samples per thread, per innermost function, per function on the stack."""
    threads: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        parts = stack.split(";")
        thread = parts[0]
        if thread.startswith("thread ("):
            thread = thread.split(": ", 1)[-1]
            parts = parts[1:]
        thread = re.sub(r"-\d+$", "-N", thread)  # kvsvc-copy-0/1 -> kvsvc-copy-N
        threads[thread] += n
        frames = [_frame(p) for p in parts]
        if frames:
            self_[_frame(parts[-1], line=True)] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        return {"total": 0, "threads": [], "self": [], "inclusive": []}

    def share(counter: collections.Counter[str], k: int) -> list[tuple[str, float]]:
        return [(name, c / total) for name, c in counter.most_common(k)]

    # inclusive: leave out the frames every busy stack goes through (bootstrap,
    # runpy, asyncio's run_forever...) by keeping those under 90 %
    inclusive = [(n, c / total) for n, c in incl.most_common() if c / total < 0.9][:top]
    return {"total": total, "threads": share(threads, 8), "self": share(self_, top),
            "inclusive": inclusive}  # fmt: skip


def summary_markdown(title: str, s: dict[str, Any]) -> str:
    if not s["total"]:
        return f"{title}: no samples."
    return "\n".join([
        f"{title}: {s['total']} samples; by thread: "
        + ", ".join(f"{name} {x:.0%}" for name, x in s["threads"]),
        "",
        md_table(["innermost function:line (self)", "share"],
                 [(f"`{n}`", f"{x:.1%}") for n, x in s["self"]]),
        "",
        md_table(["function on the stack (inclusive)", "share"],
                 [(f"`{n}`", f"{x:.1%}") for n, x in s["inclusive"]]),
    ])  # fmt: skip


def thread_names(raw: str) -> dict[int, str]:
    """OS thread id -> Python thread name, from py-spy's ``--threads`` stacks."""
    names: dict[int, str] = {}
    for m in re.finditer(r"^thread \(((?:0x)?[0-9a-fA-F]+)\): ([^;]*);", raw, re.M):
        names[int(m.group(1), 0)] = m.group(2)
    return names


def cpu_by_thread(
    before: dict[int, float], after: dict[int, float], names: dict[int, str], wall: float
) -> list[tuple[str, float]]:
    """(thread name, cores used over ``wall`` seconds), busiest first."""
    use: collections.Counter[str] = collections.Counter()
    for tid, cpu in after.items():
        name = re.sub(r"-\d+$", "-N", names.get(tid, "threads without Python frames (C)"))
        use[name] += (cpu - before.get(tid, 0.0)) / wall
    return use.most_common()


class Counter:
    def __init__(self) -> None:
        self.n = 0


def lookup_load(
    address: str, concurrency: int, seconds: float, done: Counter, error: bool = False
) -> None:
    keys = [*KEYS, b""] if error else KEYS

    async def go() -> None:
        async with AsyncKVCacheClient(address) as c:
            await c.put("prof", [(k, b"v" * 64) for k in KEYS])
            t_end = time.monotonic() + seconds

            async def loop() -> None:
                for _ in range(10**8):
                    if time.monotonic() >= t_end:
                        return
                    try:
                        await c.lookup(keys, namespace="prof")
                    except InvalidRequest:
                        if not error:
                            raise
                    done.n += 1

            await asyncio.gather(*(loop() for _ in range(concurrency)))

    asyncio.run(go())


def block_load(
    address: str,
    shm_dir: str,
    direction: str,
    seconds: float,
    chunk_blocks: int,
    batch: int,
    done: Counter,
    region: str = "memfd",
) -> None:
    blocks = chunk_blocks * batch
    name = f"prof-{os.getpid()}"
    memfd = region == "memfd"
    with SharedKVCache(name, num_layers=LAYERS, num_blocks=blocks, block_size=BLOCK,
                       kv_heads=HEADS, head_dim=HEAD_DIM, shm_dir=shm_dir, memfd=memfd) as kv, \
            KVCacheClient(address, transfer_timeout=120) as c:  # fmt: skip
        for layer in kv.layers:
            layer.random_()
        m = c.map(name, [kv.rank_region(token=c.register_memfd(kv.fd) if memfd else "")])
        ids = [list(range(i * chunk_blocks, (i + 1) * chunk_blocks)) for i in range(batch)]
        c.store(m, [(b"p-%d" % j, ids[j]) for j in range(batch)])
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end and done.n < 10**7:
            if direction == "store":
                c.store(m, [(b"s-%d-%d" % (done.n, j), ids[j]) for j in range(batch)])
            else:
                r = c.retrieve(m, [(b"p-%d" % j, ids[j]) for j in range(batch)])
                assert r.loaded_chunks == batch, r
            done.n += 1
        c.unmap(m)


def profile(
    mode: str,
    *,
    seconds: float = 8.0,
    concurrency: int = 8,
    chunk_blocks: int = 16,
    batch: int = 16,
    gil: bool | None = None,
    region: str = "memfd",
    store_bytes: int = 3 << 30,
) -> dict[str, Any]:
    """Run ``mode``'s load against a fresh server for ``seconds`` + margins while
    py-spy records the server (and this process, for ``lookup``), and measure
    each thread's CPU over the same window from /proc.

    On a machine with fewer cores than runnable threads, a thread that waits for
    a core (or the GIL) after a wake-up is sampled as busy; ``gil`` (default for
    ``lookup``) keeps only the samples of the thread holding the GIL, i.e. where
    the Python work goes."""
    lookup = mode.startswith("lookup")
    gil = lookup if gil is None else gil
    work = Path(tempfile.mkdtemp(prefix="kvsvc-prof-"))
    shm_dir = tempfile.mkdtemp(prefix="kvsvc-prof-", dir="/dev/shm")
    extra = ["--gil"] if gil else []
    try:
        with KvsvcServer(store_bytes=store_bytes, shm_dir=shm_dir) as server:
            result: dict[str, Any] = {"mode": mode, "seconds": seconds, "concurrency": concurrency,
                                      "chunk_blocks": chunk_blocks, "batch": batch,
                                      "gil": gil, "region": region}  # fmt: skip
            box: dict[str, Any] = {}
            done = Counter()

            def load() -> None:
                try:
                    if lookup:
                        lookup_load(server.address, concurrency, seconds + 3, done,
                                    error=mode == "lookup-error")  # fmt: skip
                    else:
                        block_load(server.address, shm_dir, mode, seconds + 3, chunk_blocks,
                                   batch, done, region)  # fmt: skip
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    box["error"] = exc

            t = threading.Thread(target=load, daemon=True)
            t.start()
            time.sleep(1.0)  # past connection set-up and the first calls
            pids = {"server": server.pid, "caller": os.getpid()}
            who_all = ["server", "caller"] if lookup else ["server"]
            before = {who: thread_cpu(pids[who]) for who in who_all}
            calls0, t0 = done.n, time.monotonic()
            spies = [(who, start_record(pids[who], seconds, work / f"{who}.txt", extra=extra))
                     for who in who_all]  # fmt: skip
            time.sleep(seconds)
            wall = time.monotonic() - t0
            after = {who: thread_cpu(pids[who]) for who in who_all}
            calls = done.n - calls0
            for who, proc in spies:
                raw = finish_record(proc, work / f"{who}.txt", seconds + 60)
                result[who] = summarize(raw)
                names = thread_names(raw)
                result[who]["cpu"] = cpu_by_thread(before[who], after[who], names, wall)
                total = sum(after[who].values()) - sum(before[who].values())
                result[who]["cpu_us_per_call"] = total / max(1, calls) * 1e6
            t.join(seconds + 120)
            if "error" in box:
                raise RuntimeError(f"profile load failed: {box['error']!r}") from box["error"]
            result["calls_per_s"] = calls / wall
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def markdown(result: dict[str, Any]) -> str:
    mode = result["mode"]
    mib, batch = result["chunk_blocks"] * 2, result["batch"]
    what = {
        "lookup": f"Lookup of 8 keys, AsyncKVCacheClient, {result['concurrency']} asyncio tasks",
        "lookup-error": "Lookup of 8 keys and an empty one (InvalidRequest), AsyncKVCacheClient, "
        f"{result['concurrency']} asyncio tasks",
        "store": f"Store of {batch} x {mib} MiB chunks, {result.get('region')} regions, 1 client",
        "retrieve": f"Retrieve of {batch} x {mib} MiB chunks, {result.get('region')} regions, "
        "1 client",
    }[mode]
    kind = "samples holding the GIL" if result["gil"] else "samples of runnable threads"
    parts = []
    for who, title in (("server", "`kvsvc serve`"), ("caller", "the calling process")):
        if who not in result:
            continue
        s = result[who]
        cpu = ", ".join(f"{name} {x:.2f}" for name, x in s["cpu"] if x >= 0.005)
        parts += [
            f"**{mode}** ({what}; {result['calls_per_s']:.0f} calls/s): {title}, "
            f"{s['cpu_us_per_call']:.0f} µs CPU per call; cores used per thread: {cpu}.",
            "",
            summary_markdown(f"py-spy, {kind}", s),
            "",
        ]
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["lookup", "lookup-error", "store", "retrieve"])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=8, help="lookup callers")
    ap.add_argument("--chunk-blocks", type=int, default=16, help="2 MiB blocks per chunk")
    ap.add_argument("--batch", type=int, default=16, help="chunks per Store/Retrieve")
    ap.add_argument("--region", choices=["memfd", "file"], default="memfd")
    ap.add_argument("--gil", action=argparse.BooleanOptionalAction, default=None,
                    help="only samples holding the GIL (default: for lookup)")  # fmt: skip
    args = ap.parse_args()
    result = profile(args.mode, seconds=args.seconds, concurrency=args.concurrency,
                     chunk_blocks=args.chunk_blocks, batch=args.batch, gil=args.gil,
                     region=args.region)  # fmt: skip
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
