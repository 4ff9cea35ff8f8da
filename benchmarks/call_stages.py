"""Where the time of one Store or Retrieve goes, stage by stage: a diagnostic
that wraps kvsvc's own functions (it breaks, loudly, when they are renamed).

A `kvsvc serve` child is started through this module (``--serve``), which wraps
the server's stages with time stamps before it serves; the client wraps its
session's. ``time.perf_counter_ns`` is CLOCK_MONOTONIC on Linux, so stamps of
both processes share one clock. One client then calls Store (or Retrieve) of
one chunk over a sealed memfd N times; the median of each step between
consecutive stamps is printed, for the stamp order most calls took.

    python -m benchmarks.call_stages [--chunk-blocks 1] [--calls 300] [--op store]
        [--between none|sleep|spin|copy] [--gap-ms 20]
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAMPS: list[tuple[str, int]] = []


def stamp(name: str) -> None:
    STAMPS.append((name, time.perf_counter_ns()))


def _wrap(owner: Any, attr: str, before: str, after: str | None = None) -> None:
    fn = getattr(owner, attr)
    if hasattr(fn, "__wrapped_by_stages__"):
        return

    if asyncio_function(fn):

        @functools.wraps(fn)
        async def wrapper(*a: Any, **k: Any) -> Any:
            stamp(before)
            try:
                return await fn(*a, **k)
            finally:
                if after:
                    stamp(after)
    else:

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            stamp(before)
            try:
                return fn(*a, **k)
            finally:
                if after:
                    stamp(after)

    wrapper.__wrapped_by_stages__ = True  # type: ignore[attr-defined]
    setattr(owner, attr, wrapper)


def asyncio_function(fn: Callable[..., Any]) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def patch_server(out: str) -> None:
    from kvsvc.server.data import copies
    from kvsvc.server.data import engine as transfer
    from kvsvc.server.handlers import transfers
    from kvsvc.server.rpc.servicer import KVCacheServicer as servicer
    from kvsvc.server.rpc.wrapper import session as sessions

    handlers = transfers.Transfers
    _wrap(sessions.Sessions, "_request", "server: request task starts", "server: request done")
    _wrap(handlers, "_sides", "server: Store/Retrieve handler starts", "server: _sides done")
    _wrap(handlers, "_transfer", "server: _transfer starts", "server: _transfer done")
    _wrap(transfer.TransferEngine, "run", "engine: run starts", "engine: run returns")
    _wrap(copies.NativeCopy, "copy", "copy: native call starts", "copy: native call ends")
    tasks = transfers.tasks

    def staged_tasks(*a: Any) -> list[Callable[[], Any]]:
        def timed(task: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                stamp("copy: task starts")
                try:
                    return task()
                finally:
                    stamp("copy: task ends")

            return run

        return [timed(t) for t in tasks(*a)]

    transfers.tasks = staged_tasks  # type: ignore[assignment]
    session = servicer.Session

    class StagedContext:
        """The stream's context, its writes stamped (the Session answers by write)."""

        def __init__(self, context: Any) -> None:
            self._context = context

        def __getattr__(self, name: str) -> Any:
            return getattr(self._context, name)

        async def write(self, message: Any) -> None:
            stamp("server: Session writes the answer")
            await self._context.write(message)

    async def staged_session(self: Any, requests: Any, context: Any) -> None:
        async def read() -> Any:
            async for r in requests:
                stamp("server: Session reads the request")
                yield r

        await session(self, read(), StagedContext(context))

    servicer.Session = staged_session  # type: ignore[method-assign]

    def dump(*_: Any) -> None:
        Path(out).write_text("".join(f"{n}\t{t}\n" for n, t in list(STAMPS)))

    signal.signal(signal.SIGUSR1, dump)


def patch_client() -> None:
    from kvsvc.client import session

    sync = session.SyncSession
    _wrap(sync, "send", "client: request queued")
    _wrap(sync, "_finish", "client: reader thread has the answer")
    requests = sync._requests

    def staged_requests(self: Any) -> Any:
        for r in requests(self):
            stamp("client: gRPC's thread takes the request")
            yield r

    sync._requests = staged_requests  # type: ignore[method-assign]


def serve(argv: list[str]) -> int:
    patch_server(os.environ["KVSVC_STAGES_OUT"])
    from kvsvc.cli.main import main

    return main(argv)


def _between(how: str, seconds: float) -> Callable[[], None]:
    """What the client does between two calls: nothing; sleep; spin (this thread busy,
    no memory touched); or copy (torch copies through 128 MiB of buffers, as
    benchmarks.data_plane's references run between kvsvc's calls, so the caches hold
    other bytes when the next call starts)."""
    if how == "none" or seconds <= 0:
        return lambda: None
    if how == "sleep":
        return lambda: time.sleep(seconds)
    if how == "spin":

        def spin() -> None:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        return spin
    import torch

    bufs = [torch.ones(32 << 20, dtype=torch.uint8) for _ in range(4)]
    turn = itertools.count()

    def copy() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            i = next(turn)
            bufs[(i + 1) % 4].copy_(bufs[i % 4])

    return copy


def run(chunk_blocks: int, calls: int, op: str, between: str = "none", gap_ms: float = 20.0) -> str:
    from benchmarks.common import SERVING_RE, stop_process, wait_for_address
    from kvsvc.client import KVCacheClient
    from kvsvc.client.kvcache import SharedKVCache

    patch_client()
    work = Path(tempfile.mkdtemp(prefix="kvsvc-stages-"))
    shm = tempfile.mkdtemp(prefix="kvsvc-stages-", dir="/dev/shm")
    out, log_path = work / "stamps.tsv", work / "server.log"
    env = {**os.environ, "KVSVC_STAGES_OUT": str(out), "PYTHONUNBUFFERED": "1"}
    env.pop("KVSVC_FAILPOINTS", None)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.call_stages", "--serve", "serve", "--listen",
             "127.0.0.1:0", "--store-bytes", "2G", "--shm-dir", shm],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        address = wait_for_address(proc, log_path, SERVING_RE, 120)
        if address is None:
            raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
        with SharedKVCache("stages", num_layers=32, num_blocks=chunk_blocks, block_size=16,
                           kv_heads=8, head_dim=128, shm_dir=shm, memfd=True) as kv, \
                KVCacheClient(address, transfer_timeout=60) as c:  # fmt: skip
            for layer in kv.layers:
                layer.random_()
            m = c.map("stages", [kv.rank_region(token=c.register_memfd(kv.fd))])
            ids = list(range(chunk_blocks))
            for i in range(20):
                c.store(m, [(b"warm-%d" % i, ids)])
            pause = _between(between, gap_ms / 1e3)
            STAMPS.clear()
            for i in range(calls):
                pause()  # before the stamps: not part of the call
                stamp("client: call")
                if op == "store":
                    c.store(m, [(b"s-%d" % i, ids)])
                else:
                    c.retrieve(m, [(b"warm-0", ids)])
                stamp("client: call returns")
            client_stamps = list(STAMPS)
            copy_us = _plain_copy_us(kv.layers[0].nbytes // kv.num_blocks * chunk_blocks * 32,
                                     calls, pause)  # fmt: skip
            proc.send_signal(signal.SIGUSR1)
            for _ in range(100):
                time.sleep(0.1)
                if out.exists() and out.stat().st_size:
                    break
            time.sleep(0.5)
            c.unmap(m)
        server_stamps = [
            (n, int(t)) for n, t in (line.split("\t") for line in out.read_text().splitlines())
        ]
    finally:
        stop_process(proc, 15)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return report(client_stamps + server_stamps, chunk_blocks, op) + (
        f"\n\nreference: a one-thread contiguous torch copy of the same bytes in this process,"
        f" with the same pauses between copies: median {copy_us:.0f} µs"
    )


def _plain_copy_us(nbytes: int, calls: int, pause: Callable[[], None]) -> float:
    """Median µs of a plain copy of ``nbytes`` under the same between-calls regime: what
    the regime alone (caches, a halted vCPU to wake) does to a copy with no call."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        took = []
        for _ in range(calls):
            pause()
            t0 = time.perf_counter()
            dst.copy_(src)
            took.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(took)
    finally:
        torch.set_num_threads(threads)


def report(stamps: list[tuple[str, int]], chunk_blocks: int, op: str) -> str:
    calls: list[list[tuple[str, int]]] = []
    for name, t in sorted(stamps, key=lambda s: s[1]):
        if name == "client: call":
            calls.append([])
        if calls:
            calls[-1].append((name, t))
    orders = collections.Counter(tuple(n for n, _ in c) for c in calls)
    order, count = orders.most_common(1)[0]
    steps: dict[int, list[float]] = collections.defaultdict(list)
    for c in calls:
        if tuple(n for n, _ in c) == order:
            for k, ((_, a), (_, b)) in enumerate(itertools.pairwise(c)):
                steps[k].append((b - a) / 1e3)
    total = statistics.median((c[-1][1] - c[0][1]) / 1e3 for c in calls)
    head = (
        f"{op} of one {chunk_blocks * 2} MiB chunk: {len(calls)} calls, median "
        f"{total:.0f} µs; steps of the most common order ({count} calls), medians:"
    )
    lines = [head, ""]
    lines += ["| µs | from | to |", "|---|---|---|"]
    for k, (a, b) in enumerate(itertools.pairwise(order)):
        lines.append(f"| {statistics.median(steps[k]):.0f} | {a} | {b} |")
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return serve(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-blocks", type=int, default=1, help="2 MiB blocks per chunk")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--op", choices=["store", "retrieve"], default="store")
    ap.add_argument(
        "--between",
        choices=["none", "sleep", "spin", "copy"],
        default="none",
        help="what the client does between calls (default: calls back to back)",
    )
    ap.add_argument("--gap-ms", type=float, default=20.0, help="for how long, with --between")
    args = ap.parse_args()
    print(run(args.chunk_blocks, args.calls, args.op, args.between, args.gap_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
