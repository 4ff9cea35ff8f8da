"""Fault detection latency, measured against real `kvsvc serve` subprocesses.

1. Fault -> NOT_SERVING as a health Watch subscriber sees it. Each injection
   needs a fresh server (a fatal failure is sticky): it runs with
   KVSVC_FAILPOINTS=transfer.before_copy=raise, a Watch stream is open on the
   service name, and one inline put is sent. Measured from just before the put
   is sent to the Watch stream's NOT_SERVING message. The server-side part is
   GetServerInfo's failure_time minus the (same host) wall clock at sending.
2. A handler fault -> the client's exception, against the same call succeeding:
   the same Lookup against a server with handler.enter=Lookup@raise and against
   a normal one, calls interleaved, p50/p99.

    python -m benchmarks.fault_detection [--quick | --smoke] [--out DIR]

Prints a markdown table; with --out, also writes it to DIR/fault_detection.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsvc.client import KVCacheClient
from kvsvc.errors import FatalServerError, KVServiceError, RemoteHandlerError
from kvsvc.server.health import SERVICE_NAME

REPO = Path(__file__).resolve().parent.parent
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Server:
    """One `kvsvc serve` on 127.0.0.1, port picked by the kernel."""

    def __init__(self, workdir: Path, failpoints: str = "") -> None:
        self.log_path = workdir / f"server-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KVSVC_FAILPOINTS", None)
        if failpoints:
            env["KVSVC_FAILPOINTS"] = failpoints
        cmd = [sys.executable, "-m", "kvsvc", "serve", "--listen", "127.0.0.1:0"]
        cmd += ["--shm-dir", str(workdir), "--store-bytes", "64M"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(r"serving on (127\.0\.0\.1:\d+)", self.log_path.read_text())
            if m:
                self.address = m.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"kvsvc serve did not start:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def one_injection(workdir: Path) -> dict[str, float]:
    """Seconds from sending the put to: the client's exception, the server's
    failure_time, and the Watch subscriber's NOT_SERVING."""
    srv = Server(workdir, "transfer.before_copy=raise")
    channel = grpc.insecure_channel(srv.address)
    try:
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30
        )
        seen: queue.Queue[tuple[int, float]] = queue.Queue()

        def drain() -> None:
            try:
                for msg in stream:
                    seen.put((msg.status, time.perf_counter()))
            except grpc.RpcError:
                pass

        threading.Thread(target=drain, daemon=True).start()
        status, _ = seen.get(timeout=10)
        assert status == SERVING, status
        with KVCacheClient(srv.address) as c:
            c.server_info(timeout=5)  # the client's channel is connected before timing
            wall0, t0 = time.time(), time.perf_counter()
            try:
                c.put("bench", [(b"k", b"v" * 4096)], timeout=5)
                raise AssertionError("the put succeeded; the failpoint did not fire")
            except FatalServerError:
                t_reply = time.perf_counter()
            while True:
                status, t_watch = seen.get(timeout=10)
                if status == NOT_SERVING:
                    break
            info = c.server_info(timeout=5)
            assert info.failure_reason == "TRANSFER_WORKER_FAILED", info.failure_reason
            failed_at = info.failure_time.seconds + info.failure_time.nanos / 1e9
        stream.cancel()
        return {
            "watch": t_watch - t0,
            "reply": t_reply - t0,
            "server": failed_at - wall0,
        }
    finally:
        channel.close()
        srv.stop()


def handler_latencies(workdir: Path, calls: int) -> tuple[list[float], list[float]]:
    """Seconds per Lookup: (against the faulty server, against the normal one)."""
    faulty = Server(workdir, "handler.enter=Lookup@raise")
    normal = Server(workdir)
    try:
        with KVCacheClient(faulty.address) as cf, KVCacheClient(normal.address) as cn:
            keys = [b"key-0", b"key-1"]

            def fail_once() -> float:
                t0 = time.perf_counter()
                try:
                    cf.lookup(keys, namespace="bench", timeout=5)
                except RemoteHandlerError:
                    return time.perf_counter() - t0
                raise AssertionError("the Lookup succeeded; the failpoint did not fire")

            def succeed_once() -> float:
                t0 = time.perf_counter()
                cn.lookup(keys, namespace="bench", timeout=5)
                return time.perf_counter() - t0

            for _ in range(min(200, calls)):  # warm up both channels and servers
                fail_once()
                succeed_once()
            failed: list[float] = []
            ok: list[float] = []
            for _ in range(calls):  # interleaved, so drift hits both alike
                failed.append(fail_once())
                ok.append(succeed_once())
            return failed, ok
    finally:
        faulty.stop()
        normal.stop()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 injections, 300 calls")
    ap.add_argument("--smoke", action="store_true", help="1 injection, 50 calls")
    ap.add_argument("--injections", type=int, default=None)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    n_inj = args.injections or (1 if args.smoke else 3 if args.quick else 20)
    n_calls = args.calls or (50 if args.smoke else 300 if args.quick else 2000)

    workdir = Path(tempfile.mkdtemp(prefix="kvsvc-fault-bench-"))
    try:
        runs = []
        for i in range(n_inj):
            runs.append(one_injection(workdir))
            r = runs[-1]
            print(
                f"injection {i + 1}/{n_inj}: reply {ms(r['reply'])} ms, server "
                f"{ms(r['server'])} ms, watch NOT_SERVING {ms(r['watch'])} ms",
                file=sys.stderr,
                flush=True,
            )
        failed, ok = handler_latencies(workdir, n_calls)
    except (KVServiceError, AssertionError, RuntimeError, queue.Empty) as exc:
        print(f"benchmark failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def col(key: str) -> list[float]:
        return [r[key] for r in runs]

    lines = [
        f"# Fault detection ({'smoke' if args.smoke else 'quick' if args.quick else 'full'} run)",
        "",
        f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}; client and server on 127.0.0.1.",
        "",
        f"## Fatal copy fault -> NOT_SERVING ({n_inj} injections, a fresh server each)",
        "",
        "Measured from just before the inline put is sent (`transfer.before_copy=raise`).",
        "",
        "| measured to | median ms | max ms |",
        "|---|---|---|",
        f"| server declares fatal (failure_time, same-host clock) | "
        f"{ms(statistics.median(col('server')))} | {ms(max(col('server')))} |",
        f"| client gets FatalServerError | {ms(statistics.median(col('reply')))} | "
        f"{ms(max(col('reply')))} |",
        f"| Watch subscriber sees NOT_SERVING | {ms(statistics.median(col('watch')))} | "
        f"{ms(max(col('watch')))} |",
        "",
        f"## Handler fault vs success ({n_calls} Lookups each, interleaved)",
        "",
        "| same Lookup | p50 ms | p99 ms | mean ms |",
        "|---|---|---|---|",
        f"| raises in handler (`handler.enter=Lookup@raise`) -> RemoteHandlerError | "
        f"{ms(pct(failed, 50))} | {ms(pct(failed, 99))} | {ms(statistics.fmean(failed))} |",
        f"| succeeds (normal server) | {ms(pct(ok, 50))} | {ms(pct(ok, 99))} | "
        f"{ms(statistics.fmean(ok))} |",
        "",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fault_detection.md").write_text(table)
        print(f"written to {args.out / 'fault_detection.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
