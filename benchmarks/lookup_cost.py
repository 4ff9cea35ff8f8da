"""Where a Lookup's server CPU goes, by difference: the same closed loop of
Lookups (raw grpc.aio stub, N asyncio tasks) against a ladder of servers, each
adding one layer, with the CPU of the server's event-loop thread and of its
other (gRPC core) threads per call, from /proc:

1. ``echo``: bare grpc.aio unary echo, raw bytes (benchmarks/echo_server.py);
2. ``proto``: the kvsvc.v1 Lookup method (protobuf request and reply, generated
   servicer) answering a prebuilt reply, plus health and reflection services;
3. ``kvsvc-bare``: kvsvc's own server without Prometheus metrics and without the
   watchdog/heartbeat (patched in this benchmark's subprocess only);
4. ``kvsvc-nometrics``: kvsvc's server without Prometheus metrics;
5. ``kvsvc``: kvsvc's server as shipped.

Servers are measured in alternating rounds. The patches touch private
attributes of kvsvc.server.ops.lifecycle and kvsvc.server.rpc.servicer; if they no longer exist
the rung fails loudly.

    python -m benchmarks.lookup_cost [--seconds 4] [--rounds 2] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from typing import Any

import grpc

from benchmarks.common import NullProgress, Progress, md_table, thread_cpu
from benchmarks.control_plane import KEYS, NAMESPACE, Subprocess, lookup_request, sizes
from benchmarks.echo_server import ECHO_METHOD
from kvsvc.client import KVCacheClient
from kvsvc.limits import channel_options
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

RUNGS = ("echo", "proto", "kvsvc-bare", "kvsvc-nometrics", "kvsvc")


# --- the servers (run as `python -m benchmarks.lookup_cost serve RUNG`) ---
async def _serve_proto() -> None:
    from grpc_health.v1 import health, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from kvsvc.limits import server_options
    from kvsvc.v1 import kv_cache_service_pb2 as pb

    reply = pb.LookupResponse(
        result=pb.LookupResult(hit_chunks=len(KEYS), server_start_id="0" * 32)
    )

    class Servicer(pb_grpc.KVCacheServiceServicer):
        async def Lookup(self, request: Any, context: Any) -> Any:
            return reply

    server = grpc.aio.server(options=server_options())
    pb_grpc.add_KVCacheServiceServicer_to_server(Servicer(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    names = (pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


async def _serve_kvsvc(rung: str) -> None:
    from kvsvc.server.config import ServerConfig
    from kvsvc.server.ops import lifecycle as kv_server

    class _NoMetric:
        def labels(self, *args: object) -> _NoMetric:
            return self

        def inc(self, *args: object) -> None:
            pass

        def observe(self, *args: object) -> None:
            pass

    cfg = ServerConfig.from_settings(
        listen="127.0.0.1:0", store_bytes=64 << 20, shm_dir=tempfile.mkdtemp()
    )
    server = kv_server.Server(cfg)
    if rung in ("kvsvc-bare", "kvsvc-nometrics"):
        server.servicer.metrics.requests = _NoMetric()
        server.servicer.metrics.request_seconds = _NoMetric()
    await server.start()
    if rung == "kvsvc-bare":
        server.watchdog.stop()
        server.watchdog._beat_task.cancel()
    print(f"serving on {server.address}", flush=True)
    await asyncio.Event().wait()


def serve(rung: str) -> None:
    if rung == "proto":
        asyncio.run(_serve_proto())
    else:
        asyncio.run(_serve_kvsvc(rung))


# --- the measurement ---
def start(rung: str) -> Subprocess:
    if rung == "echo":
        return Subprocess([sys.executable, "-m", "benchmarks.echo_server", "grpc", "--listen",
                           "127.0.0.1:0", "--reply-bytes", str(sizes()[1])])  # fmt: skip
    srv = Subprocess([sys.executable, "-m", "benchmarks.lookup_cost", "serve", rung])
    if rung.startswith("kvsvc"):
        with KVCacheClient(srv.address) as c:
            c.put(NAMESPACE, [(k, b"v" * 64) for k in KEYS])
    return srv


def measure(rung: str, srv: Subprocess, n: int, seconds: float) -> dict[str, float]:
    req = lookup_request()
    payload = b"\x01" * sizes()[0]

    async def go() -> dict[str, float]:
        async with grpc.aio.insecure_channel(srv.address, options=channel_options()) as ch:
            if rung == "echo":
                method = ch.unary_unary(ECHO_METHOD)

                def call() -> Any:
                    return method(payload, timeout=5)
            else:
                stub = pb_grpc.KVCacheServiceStub(ch)

                def call() -> Any:
                    return stub.Lookup(req, timeout=5)

                reply = await call()
                if reply.result.hit_chunks != len(KEYS):
                    raise RuntimeError(f"{rung}: unexpected reply {reply}")

            async def loop(t_end: float, done: list[int]) -> None:
                for _ in range(10**8):
                    if time.monotonic() >= t_end:
                        return
                    await call()
                    done[0] += 1

            warm = [0]
            await asyncio.gather(*(loop(time.monotonic() + 0.5, warm) for _ in range(n)))
            pid = srv.proc.pid
            before, t0, done = thread_cpu(pid), time.monotonic(), [0]
            await asyncio.gather(*(loop(t0 + seconds, done) for _ in range(n)))
            wall, after = time.monotonic() - t0, thread_cpu(pid)
            main = after.get(pid, 0.0) - before.get(pid, 0.0)
            other = sum(after.values()) - sum(before.values()) - main
            return {"per_s": done[0] / wall, "loop_us": main / done[0] * 1e6,
                    "other_us": other / done[0] * 1e6}  # fmt: skip

    return asyncio.run(go())


def run(*, seconds: float = 4.0, rounds: int = 2, concurrency: int = 8,
        progress: Progress | None = None) -> list[dict[str, Any]]:  # fmt: skip
    progress = progress or NullProgress()
    samples: dict[str, list[dict[str, float]]] = {r: [] for r in RUNGS}
    servers = {}
    try:
        for rung in RUNGS:
            servers[rung] = start(rung)
        for _ in range(rounds):
            for rung in RUNGS:
                samples[rung].append(measure(rung, servers[rung], concurrency, seconds))
    finally:
        for srv in servers.values():
            srv.stop()
    out = []
    for rung in RUNGS:
        s = samples[rung]
        out.append({"rung": rung, **{k: statistics.median(x[k] for x in s) for k in s[0]}})
    progress.step("lookup cost ladder")
    return out


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["loop_us"]
    lines, prev = [], None
    for r in rows:
        step = "" if prev is None else f"{r['loop_us'] - prev:+.0f}"
        lines.append((r["rung"], f"{r['per_s']:.0f}", f"{r['loop_us']:.0f}", step,
                      f"{r['loop_us'] - base:+.0f}", f"{r['other_us']:.0f}"))  # fmt: skip
        prev = r["loop_us"]
    return md_table(["server", "Lookups/s", "event-loop thread CPU µs/call", "vs rung above",
                     "vs bare echo", "other threads CPU µs/call"], lines)  # fmt: skip


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    print(table(run(seconds=args.seconds, rounds=args.rounds, concurrency=args.concurrency)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
