"""Control-plane latency of LMCache's multiprocess server through its own client
(``RequestClientFactory``), closed loop: N threads share one client, each sends
one request and waits for it (LMCache's client is synchronous, returning
``MessagingFuture``s). Runs under the Python that has lmcache installed; imports
neither kvsvc nor the rest of benchmarks/.

Ops: ``get_chunk_size`` (a non-blocking handler, answered on the transport's
thread: transport + dispatch cost) and ``lookup`` (a blocking handler, run on
LMCache's handler pool; with no KV cache registered, it takes LMCache's
"no GPU context" early exit, so it is the cheapest lookup there is).

    python benchmarks/lmcache_client.py --url grpc://127.0.0.1:P --concurrency 1 8 32

Prints one JSON object per (op, concurrency) on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from typing import Any


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="tcp://HOST:PORT (ZMQ) or grpc://HOST:PORT")
    ap.add_argument("--ops", nargs="*", default=["get_chunk_size", "lookup"])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=3.0, help="per (op, concurrency)")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--ready-timeout", type=float, default=120.0)
    ap.add_argument("--tokens", type=int, default=256, help="token ids per lookup key")
    args = ap.parse_args()

    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    client: Any = RequestClientFactory.create(args.url)
    t_ready = time.monotonic() + args.ready_timeout
    while True:  # the server is up once it answers
        try:
            chunk = client.get_chunk_size().result(timeout=2.0)
            break
        except Exception as exc:  # noqa: BLE001 - any failure: retry until the deadline
            if time.monotonic() > t_ready:
                print(f"LMCache server at {args.url} never answered: {exc!r}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    print(f"LMCache at {args.url} answers (chunk size {chunk})", file=sys.stderr, flush=True)

    def make_call(op: str, worker: int) -> Any:
        if op == "get_chunk_size":
            return lambda: client.get_chunk_size().result(timeout=10)
        if op == "noop":
            return lambda: client.noop().result(timeout=10)
        if op == "lookup":
            # One request id per worker: the server keeps a prefetch job per id.
            key = IPCCacheServerKey(
                model_name="bench",
                world_size=1,
                worker_id=0,
                token_ids=tuple(range(args.tokens)),
                start=0,
                end=args.tokens,
                request_id=f"bench-{worker}-{uuid.uuid4().hex[:8]}",
            )
            return lambda: client.lookup(key, 1).result(timeout=10)
        raise SystemExit(f"unknown op {op}")

    def measure(op: str, conc: int) -> dict[str, Any]:
        lat: list[list[float]] = [[] for _ in range(conc)]
        errors: list[BaseException] = []
        t_start = time.monotonic() + args.warmup
        t_end = t_start + args.seconds

        def worker(i: int) -> None:
            call = make_call(op, i)
            try:
                while True:
                    t0 = time.perf_counter()
                    if time.monotonic() >= t_end:
                        return
                    call()
                    if time.monotonic() >= t_start:
                        lat[i].append(time.perf_counter() - t0)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(conc)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.warmup + args.seconds + 30)
        if errors:
            raise RuntimeError(f"{op} x{conc}: {errors[0]!r}") from errors[0]
        flat = [x for per in lat for x in per]
        return {
            "op": op, "concurrency": conc, "n": len(flat),
            "p50_ms": pct(flat, 50) * 1e3, "p99_ms": pct(flat, 99) * 1e3,
            "mean_ms": sum(flat) / len(flat) * 1e3, "per_s": len(flat) / args.seconds,
        }  # fmt: skip

    for op in args.ops:
        for conc in args.concurrency:
            try:
                print(json.dumps(measure(op, conc)), flush=True)
            except RuntimeError as exc:
                print(str(exc), file=sys.stderr)
                return 1
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
