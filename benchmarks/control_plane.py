"""Control-plane latency and throughput: kvsvc Lookup at 1, 8 and 32 concurrent
callers, beside references measured in the same run on the same machine:

* a bare grpc.aio unary echo (benchmarks/echo_server.py: raw bytes, request and
  reply the size of kvsvc's Lookup request and reply, kvsvc's server options),
  over TCP on 127.0.0.1 and over a unix socket, like kvsvc;
* a ZMQ ROUTER + msgpack echo (DEALER callers);
* LMCache's multiprocess server over its ZMQ and gRPC transports, through its
  own client (benchmarks/lmcache_client.py, run under the Python that has
  lmcache; see --lmcache-python).

Callers are closed loops (send, wait, repeat): asyncio tasks on one client
(AsyncKVCacheClient, a grpc.aio channel, or one DEALER socket per task), or
threads on one synchronous client (KVCacheClient, a grpc channel, LMCache's
client). Targets of one transport are measured in alternating rounds so that
machine noise hits them alike; samples are pooled over the rounds.

    python -m benchmarks.control_plane [--quick | --smoke] [--no-lmcache]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks.common import (
    REPO,
    KvsvcServer,
    NullProgress,
    Progress,
    cpu_seconds,
    md_table,
    pct,
    stop_process,
    wait_for_address,
)
from benchmarks.echo_server import ECHO_METHOD, ECHO_STREAM
from kvsvc.client import AsyncKVCacheClient, KVCacheClient
from kvsvc.limits import channel_options
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

NAMESPACE = "bench"
KEYS = [b"%032d" % i for i in range(8)]  # 8 chunk keys of 32 bytes, all present
CONCURRENCY = (1, 8, 32)
SESSION = "kvsvc Lookup (session)"
BIDI = "grpc bidi echo"
DEFAULT_LMCACHE_PYTHON = "/tmp/bench-venv/bin/python"


def lookup_request() -> pb.LookupRequest:
    return pb.LookupRequest(
        header=pb.RequestHeader(envelope_version=1, request_id="0" * 32),
        namespace=NAMESPACE,
        keys=KEYS,
    )


def sizes() -> tuple[int, int]:
    """Bytes of kvsvc's Lookup request and reply on the wire (protobuf)."""
    reply = pb.LookupResponse(
        result=pb.LookupResult(hit_chunks=len(KEYS), server_start_id="0" * 32)
    )
    return lookup_request().ByteSize(), reply.ByteSize()


@dataclass
class Sample:
    target: str  # what answers: kvsvc, grpc echo, ...
    transport: str  # tcp, unix, zmq, ...
    client: str  # how callers call: asyncio tasks, threads, ...
    concurrency: int
    lat: list[float] = field(default_factory=list)
    seconds: float = 0.0
    calls: int = 0  # all calls, warm-up included
    server_cpu: float = 0.0  # CPU seconds of the server process over those calls
    client_cpu: float = 0.0  # CPU seconds of this (the calling) process over those calls
    summary: dict[str, float] | None = None  # filled in directly (LMCache)

    def stats(self) -> dict[str, float]:
        if self.summary is not None:
            return self.summary
        return {
            "p50_ms": pct(self.lat, 50) * 1e3,
            "p99_ms": pct(self.lat, 99) * 1e3,
            "mean_ms": sum(self.lat) / len(self.lat) * 1e3,
            "per_s": len(self.lat) / self.seconds,
            "n": len(self.lat),
            "server_cpu_us": self.server_cpu / self.calls * 1e6 if self.calls else float("nan"),
            "client_cpu_us": self.client_cpu / self.calls * 1e6 if self.calls else float("nan"),
        }


# --- closed loops ---
Measured = tuple[list[float], int]  # (latencies after the warm-up, calls made in all)


async def run_async(
    callers: list[Callable[[], Awaitable[Any]]], seconds: float, warmup: float
) -> Measured:
    lat: list[float] = []
    calls = [0]
    t_start = time.monotonic() + warmup
    t_end = t_start + seconds

    async def loop(call: Callable[[], Awaitable[Any]]) -> None:
        while True:
            t0 = time.perf_counter()
            if time.monotonic() >= t_end:
                return
            await call()
            calls[0] += 1
            if time.monotonic() >= t_start:
                lat.append(time.perf_counter() - t0)

    await asyncio.wait_for(asyncio.gather(*(loop(c) for c in callers)), warmup + seconds + 60)
    return lat, calls[0]


def run_threads(
    make_call: Callable[[], Callable[[], Any]], n: int, seconds: float, warmup: float
) -> Measured:
    lat: list[list[float]] = [[] for _ in range(n)]
    calls = [0] * n
    errors: list[BaseException] = []
    t_start = time.monotonic() + warmup
    t_end = t_start + seconds

    def loop(i: int) -> None:
        call = make_call()
        try:
            while True:
                t0 = time.perf_counter()
                if time.monotonic() >= t_end:
                    return
                call()
                calls[i] += 1
                if time.monotonic() >= t_start:
                    lat[i].append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    if n == 1:
        loop(0)
    else:
        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(warmup + seconds + 60)
    if errors:
        raise errors[0]
    return [x for per in lat for x in per], sum(calls)


# --- servers ---
class Subprocess:
    """A reference server: started, waited for ('serving on ADDRESS'), stopped."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            "w+", prefix="bench-ref-", suffix=".log", delete=False
        )
        self.log_path = Path(self._log.name)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )  # fmt: skip
        address = wait_for_address(self.proc, self.log_path, re.compile(r"serving on (\S+)"), 60)
        if address is None:
            text = self.log_path.read_text()
            self.stop()
            raise RuntimeError(f"{cmd} did not start:\n{text}")
        self.address = address

    def stop(self, grace: float = 10.0) -> None:
        stop_process(self.proc, grace)
        self._log.close()
        with contextlib.suppress(FileNotFoundError):
            self.log_path.unlink()


def own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- targets: (name, transport, client kind, concurrency levels, runner) ---
Runner = Callable[[int, float, float], Awaitable[Measured]]


def kvsvc_targets(address: str, transport: str) -> list[tuple[str, str, str, Runner]]:
    req = lookup_request()

    def async_client(session: bool) -> Runner:
        async def run(n: int, seconds: float, warmup: float) -> Measured:
            async with AsyncKVCacheClient(address, session=session) as c:
                hits = await c.lookup(KEYS, namespace=NAMESPACE)
                assert hits == len(KEYS), hits
                assert (c._session is not None) == session
                return await run_async(
                    [lambda: c.lookup(KEYS, namespace=NAMESPACE)] * n, seconds, warmup
                )

        return run

    async def raw_stub(n: int, seconds: float, warmup: float) -> Measured:
        async with grpc.aio.insecure_channel(address, options=channel_options()) as ch:
            stub = pb_grpc.KVCacheServiceStub(ch)
            reply = await stub.Lookup(req, timeout=5)
            assert reply.result.hit_chunks == len(KEYS), reply
            return await run_async([lambda: stub.Lookup(req, timeout=5)] * n, seconds, warmup)

    def sync_client(session: bool) -> Runner:
        async def run(n: int, seconds: float, warmup: float) -> Measured:
            with KVCacheClient(address, session=session) as c:
                assert c.lookup(KEYS, namespace=NAMESPACE) == len(KEYS)
                assert (c._session is not None) == session
                return await asyncio.to_thread(
                    run_threads, lambda: lambda: c.lookup(KEYS, namespace=NAMESPACE), n,
                    seconds, warmup,
                )  # fmt: skip

        return run

    # Unary calls (session=False) under the names earlier runs used; the Session
    # stream (the clients' default) as its own target.
    out: list[tuple[str, str, str, Runner]] = [
        ("kvsvc Lookup", transport, "AsyncKVCacheClient, asyncio tasks", async_client(False)),
        (SESSION, transport, "AsyncKVCacheClient, asyncio tasks", async_client(True)),
        ("kvsvc Lookup", transport, "KVCacheClient (sync), threads", sync_client(False)),
        (SESSION, transport, "KVCacheClient (sync), threads", sync_client(True)),
    ]
    if transport == "tcp":
        out.insert(2, ("kvsvc Lookup", transport, "raw grpc.aio stub, asyncio tasks", raw_stub))
    return out


def echo_targets(
    address: str, transport: str, req_bytes: int
) -> list[tuple[str, str, str, Runner]]:
    payload = b"\x01" * req_bytes

    async def aio(n: int, seconds: float, warmup: float) -> Measured:
        async with grpc.aio.insecure_channel(address, options=channel_options()) as ch:
            echo = ch.unary_unary(ECHO_METHOD)
            await echo(payload, timeout=5)
            return await run_async([lambda: echo(payload, timeout=5)] * n, seconds, warmup)

    async def sync(n: int, seconds: float, warmup: float) -> Measured:
        with grpc.insecure_channel(address, options=channel_options()) as ch:
            echo = ch.unary_unary(ECHO_METHOD)
            echo(payload, timeout=5)
            return await asyncio.to_thread(
                run_threads, lambda: lambda: echo(payload, timeout=5), n, seconds, warmup
            )

    async def bidi(n: int, seconds: float, warmup: float) -> Measured:
        """One stream shared by the callers, as the Session is: replies come in order."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[bytes] = asyncio.Queue()
        waiting: collections.deque[asyncio.Future[None]] = collections.deque()

        async def requests() -> AsyncIterator[bytes]:
            while True:
                yield await out.get()

        async with grpc.aio.insecure_channel(address, options=channel_options()) as ch:
            call = ch.stream_stream(ECHO_STREAM)(requests())

            async def read() -> None:
                async for _ in call:
                    waiting.popleft().set_result(None)

            reader = loop.create_task(read())

            async def one() -> None:
                fut = loop.create_future()
                waiting.append(fut)
                out.put_nowait(payload)
                await asyncio.wait_for(fut, 5)

            try:
                await one()
                return await run_async([one] * n, seconds, warmup)
            finally:
                call.cancel()
                reader.cancel()

    return [
        ("grpc echo", transport, "grpc.aio channel, asyncio tasks", aio),
        (BIDI, transport, "grpc.aio channel, asyncio tasks", bidi),
        ("grpc echo", transport, "grpc channel (sync), threads", sync),
    ]


def zmq_target(address: str) -> tuple[str, str, str, Runner]:
    import msgpack
    import zmq
    import zmq.asyncio

    body = msgpack.packb({"op": "lookup", "ns": NAMESPACE, "keys": KEYS})

    async def run(n: int, seconds: float, warmup: float) -> Measured:
        ctx = zmq.asyncio.Context()
        socks = []
        try:
            for _ in range(n):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://{address}")
                socks.append(s)

            def caller(s: Any) -> Callable[[], Awaitable[Any]]:
                async def call() -> Any:
                    await s.send_multipart([b"", body])
                    frames = await asyncio.wait_for(s.recv_multipart(), 5)
                    return msgpack.unpackb(frames[-1])

                return call

            callers = [caller(s) for s in socks]
            assert (await callers[0]())["hits"] == len(KEYS)
            return await run_async(callers, seconds, warmup)
        finally:
            for s in socks:
                s.close(0)
            ctx.term()

    return ("zmq + msgpack echo", "zmq tcp", "DEALER per asyncio task", run)


# --- LMCache ---
def lmcache_python(explicit: str | None) -> tuple[str | None, str]:
    """(python with lmcache importable, or None; why not)."""
    candidates = [explicit] if explicit else []
    candidates += [os.environ.get("KVSVC_BENCH_LMCACHE_PYTHON", ""), DEFAULT_LMCACHE_PYTHON,
                   sys.executable]  # fmt: skip
    reasons = []
    for py in dict.fromkeys(c for c in candidates if c):
        if not shutil.which(py) and not Path(py).exists():
            reasons.append(f"{py}: not found")
            continue
        probe = "import lmcache.v1.multiprocess.server, lmcache; print(lmcache.__version__)"
        r = subprocess.run(
            [py, "-c", probe],
            capture_output=True, text=True, timeout=180,
            env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        if r.returncode == 0:
            return py, r.stdout.strip().splitlines()[-1]
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        reasons.append(f"{py}: {tail[:200]}")
    return None, "; ".join(reasons)


def run_lmcache(
    py: str, transport: str, seconds: float, warmup: float, progress: Progress
) -> list[Sample]:
    port, prom = free_port(), free_port()
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONWARNINGS": "ignore",
           # its "no GPU context" lookup logs an ERROR per call; without logging
           # LMCache only gets faster, so the comparison stays conservative
           "LMCACHE_LOG_LEVEL": "CRITICAL"}  # fmt: skip
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below
        "w+", prefix=f"bench-lmcache-{transport}-", suffix=".log", delete=False
    )
    server = subprocess.Popen(
        [py, str(REPO / "benchmarks" / "lmcache_launch.py"), "--transport", transport,
         "--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", "1",
         "--eviction-policy", "LRU", "--prometheus-port", str(prom)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
    )  # fmt: skip
    url = f"grpc://127.0.0.1:{port}" if transport == "grpc" else f"tcp://127.0.0.1:{port}"
    samples: list[Sample] = []
    try:
        r = subprocess.run(
            [py, str(REPO / "benchmarks" / "lmcache_client.py"), "--url", url,
             "--seconds", str(seconds), "--warmup", str(warmup),
             "--concurrency", *map(str, CONCURRENCY)],
            capture_output=True, text=True, env=env, cwd=REPO,
            timeout=180 + 2 * len(CONCURRENCY) * (seconds + warmup + 30),
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(
                f"LMCache client failed ({r.returncode}): {r.stderr.strip()[-1500:]}\n"
                f"server log: {Path(log.name).read_text()[-1500:]}"
            )
        for line in r.stdout.splitlines():
            d = json.loads(line)
            samples.append(Sample(
                f"LMCache {d['op']}", f"lmcache {transport}", "its client (sync), threads",
                d["concurrency"], seconds=seconds, summary=d,
            ))  # fmt: skip
            progress.step(f"LMCache {transport} {d['op']} x{d['concurrency']}")
    finally:
        stop_process(server, 5)  # it may hang in shutdown after SIGTERM: SIGKILL then
        log.close()
        Path(log.name).unlink(missing_ok=True)
    return samples


# --- the section ---
def planned_steps(lmcache: bool) -> int:
    tcp = 3 + 3 + 3 + 3 + 3 + 3  # kvsvc async/raw/sync, echo aio/sync, zmq
    unix = 3 + 3 + 3 + 3
    return tcp + unix + (2 * 2 * len(CONCURRENCY) if lmcache else 0)


def run(
    *,
    quick: bool,
    smoke: bool = False,
    lmcache: bool = True,
    lmcache_py: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """``smoke``: every target at every concurrency for 0.1 s (checks that it runs)."""
    progress = progress or NullProgress()
    rounds = 1 if quick or smoke else 3
    seconds = 0.1 if smoke else 0.7 if quick else 1.5
    warmup = 0.05 if smoke else 0.2 if quick else 0.3
    req_bytes, reply_bytes = sizes()
    samples: dict[tuple[str, str, str, int], Sample] = {}
    notes: list[str] = [
        f"Lookup of {len(KEYS)} present 32-byte keys: request {req_bytes} B, reply "
        f"{reply_bytes} B (protobuf); the echoes send and return payloads of these sizes.",
        f"{rounds} round(s) of {seconds} s per case after {warmup} s warm-up, targets of a "
        "transport alternating.",
    ]
    tmp = Path(tempfile.mkdtemp(prefix="kvsvc-cp-"))

    def measure_group(targets: list[tuple[str, str, str, Runner]], pids: dict[str, int]) -> None:
        async def go() -> None:
            for r in range(rounds):
                for name, transport, client, runner in targets:
                    for n in CONCURRENCY:
                        srv0, me0 = cpu_seconds(pids[name]), own_cpu()
                        lat, calls = await runner(n, seconds, warmup)
                        srv1, me1 = cpu_seconds(pids[name]), own_cpu()
                        key = (name, transport, client, n)
                        s = samples.setdefault(key, Sample(name, transport, client, n))
                        s.lat.extend(lat)
                        s.seconds += seconds
                        s.calls += calls
                        s.server_cpu += srv1 - srv0
                        s.client_cpu += me1 - me0
                        if r == rounds - 1:
                            progress.step(f"{name} {transport} x{n}")

        asyncio.run(go())

    try:
        # TCP on 127.0.0.1: kvsvc, the grpc echo, the zmq echo
        with contextlib.ExitStack() as started:  # all stopped, even if one fails to start
            kv = KvsvcServer(store_bytes="64M", shm_dir=str(tmp))
            started.callback(kv.stop)
            echo = Subprocess([sys.executable, "-m", "benchmarks.echo_server", "grpc", "--listen",
                               "127.0.0.1:0", "--reply-bytes", str(reply_bytes)])  # fmt: skip
            started.callback(echo.stop)
            zmq_echo = Subprocess([sys.executable, "-m", "benchmarks.echo_server", "zmq",
                                   "--listen", "127.0.0.1:0", "--reply-bytes",
                                   str(reply_bytes)])  # fmt: skip
            started.callback(zmq_echo.stop)
            with KVCacheClient(kv.address) as c:
                c.put(NAMESPACE, [(k, b"v" * 64) for k in KEYS])
            k_async, s_async, *k_rest = kvsvc_targets(kv.address, "tcp")
            e_aio, e_bidi, e_sync = echo_targets(echo.address, "tcp", req_bytes)
            pids = {"kvsvc Lookup": kv.pid, SESSION: kv.pid, "grpc echo": echo.proc.pid,
                    BIDI: echo.proc.pid, "zmq + msgpack echo": zmq_echo.proc.pid}  # fmt: skip
            measure_group([k_async, s_async, e_aio, e_bidi, *k_rest, e_sync,
                           zmq_target(zmq_echo.address)], pids)  # fmt: skip
        # unix sockets
        kv = KvsvcServer(store_bytes="64M", shm_dir=str(tmp), listen=f"unix:{tmp}/kvsvc.sock")
        echo = Subprocess([sys.executable, "-m", "benchmarks.echo_server", "grpc", "--listen",
                           f"unix:{tmp}/echo.sock", "--reply-bytes", str(reply_bytes)])  # fmt: skip
        try:
            with KVCacheClient(kv.address) as c:
                c.put(NAMESPACE, [(k, b"v" * 64) for k in KEYS])
            k_async, s_async, k_sync, s_sync = kvsvc_targets(kv.address, "unix")
            e_aio, e_bidi, e_sync = echo_targets(echo.address, "unix", req_bytes)
            pids = {"kvsvc Lookup": kv.pid, SESSION: kv.pid, "grpc echo": echo.proc.pid,
                    BIDI: echo.proc.pid}  # fmt: skip
            measure_group([k_async, s_async, e_aio, e_bidi, k_sync, s_sync, e_sync], pids)
        finally:
            kv.stop()
            echo.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    lmcache_status = "not requested (--no-lmcache)"
    if lmcache:
        py, why = lmcache_python(lmcache_py)
        if py is None:
            lmcache_status = f"not run: lmcache is not importable ({why})"
            progress.log(f"LMCache: {lmcache_status}")
            progress.add(-2 * 2 * len(CONCURRENCY))
        else:
            lmcache_status = f"lmcache {why} under {py}"
            for transport in ("zmq", "grpc"):
                try:
                    for s in run_lmcache(py, transport, seconds * rounds, warmup, progress):
                        samples[(s.target, s.transport, s.client, s.concurrency)] = s
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                    msg = f"LMCache {transport} transport failed: {exc}"
                    progress.log(msg)
                    notes.append(msg.replace("\n", " ")[:2000])
    notes.append(f"LMCache: {lmcache_status}.")
    return {"samples": list(samples.values()), "notes": notes}


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for s in result["samples"]:
        out.append({"target": s.target, "transport": s.transport, "client": s.client,
                    "concurrency": s.concurrency, **s.stats()})  # fmt: skip
    return out


def find(rs: list[dict], target: str, transport: str, client_prefix: str, n: int) -> dict | None:
    for r in rs:
        if (r["target"] == target and r["transport"] == transport
                and r["client"].startswith(client_prefix) and r["concurrency"] == n):  # fmt: skip
            return r
    return None


def table(rs: list[dict]) -> str:
    """All measured rows, with kvsvc's ratio to the grpc echo of the same
    transport and client kind."""
    lines = []
    for r in rs:
        ratio = ""
        if r["target"] in ("kvsvc Lookup", SESSION):
            kind = "grpc.aio" if "asyncio" in r["client"] else "grpc channel (sync)"
            # the session beside the bidi echo where there is one (asyncio), else unary
            echo = BIDI if r["target"] == SESSION and "asyncio" in r["client"] else "grpc echo"
            ref = find(rs, echo, r["transport"], kind, r["concurrency"])
            if ref:
                ratio = f"{r['p50_ms'] / ref['p50_ms']:.2f} / {r['p99_ms'] / ref['p99_ms']:.2f}"
        cpu = "" if "server_cpu_us" not in r else (
            f"{r['server_cpu_us']:.0f} / {r['client_cpu_us']:.0f}")  # fmt: skip
        lines.append((r["target"], r["transport"], r["client"], r["concurrency"],
                      f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['per_s']:.0f}",
                      ratio, cpu))  # fmt: skip
    return md_table(
        ["target", "transport", "callers", "concurrency", "p50 ms", "p99 ms", "calls/s",
         "p50 / p99 vs grpc echo (session: bidi echo)", "CPU µs/call server / caller"], lines,
    )  # fmt: skip


def session_goals(rs: list[dict]) -> list[tuple[str, str, str]]:
    """Issue 18's goals for the session Lookup against LMCache's ZMQ transport
    (get_chunk_size, its client threads), per kvsvc client over TCP, as
    (goal, met/MISSED, figures)."""
    out: list[tuple[str, str, str]] = []
    for who, prefix in (("sync", "KVCacheClient"), ("async", "AsyncKVCacheClient")):

        def pair(n: int, prefix: str = prefix) -> tuple[dict | None, dict | None]:
            return (find(rs, SESSION, "tcp", prefix, n),
                    find(rs, "LMCache get_chunk_size", "lmcache zmq", "its client", n))  # fmt: skip

        checks = [(f"session p50 at 1 caller <= LMCache ZMQ p50 ({who} client)", 1, "p50_ms", 1)]
        checks += [(f"session p99 at {n} callers <= LMCache ZMQ p99 ({who} client)", n, "p99_ms", 1)
                   for n in (8, 32)]  # fmt: skip
        checks += [(f"session calls/s at 32 callers >= LMCache ZMQ's ({who} client)", 32,
                    "per_s", -1)]  # fmt: skip
        for goal, n, key, sign in checks:
            ours, theirs = pair(n)
            if ours is None or theirs is None:
                out.append((goal, "not measured", "LMCache did not run" if ours else "no row"))
                continue
            met = sign * ours[key] <= sign * theirs[key]
            figures = f"{ours[key]:.3f} vs {theirs[key]:.3f} ({ours[key] / theirs[key]:.2f}x)"
            out.append((goal, "met" if met else "MISSED", figures))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument("--no-lmcache", action="store_true", help="skip LMCache")
    ap.add_argument("--lmcache-python", default=None,
                    help=f"Python with lmcache installed (default: $KVSVC_BENCH_LMCACHE_PYTHON, "
                         f"{DEFAULT_LMCACHE_PYTHON}, this Python)")  # fmt: skip
    args = ap.parse_args()
    result = run(quick=args.quick, smoke=args.smoke, lmcache=not args.no_lmcache,
                 lmcache_py=args.lmcache_python)  # fmt: skip
    print(table(rows(result)))
    print()
    print(md_table(["goal (issue 18)", "verdict", "kvsvc vs LMCache ZMQ"],
                   session_goals(rows(result))))  # fmt: skip
    print()
    for note in result["notes"]:
        print(f"- {note}")


if __name__ == "__main__":
    main()
