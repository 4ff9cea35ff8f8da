"""The events stream and the presence index, measured (issue 29's "Measure"):

    python -m benchmarks.events [--quick | --smoke] [--only SECTION ...]

Sections are functions taking the run size ("full", "quick" or "smoke") that print
their figures with the load average and return them: ``presence_lookup`` (a local
lookup of 64 keys beside the session Lookup RPC and LMCache's real lookup),
``presence_visibility`` (Store acknowledged -> visible in another process's index at
1,000 Stores/s), ``presence_watchers`` (Store throughput with 4 watchers vs none) and
``events_resync`` (lost -> snapshot -> live at 1 M present keys, server RSS growth).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from benchmarks import control_plane
from benchmarks.common import REPO, KvsvcServer, NullProgress, cpu_seconds, pct
from kvsvc.client import KVCacheClient
from kvsvc.client.native import NATIVE, new_table
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

# --- the presence index (issue 29's "Measure": lookup, visibility, watchers) ---
PRESENCE_NS = "bench-presence"
#: sizes per run size: (lookup iterations, visibility seconds, throughput seconds, rounds)
PRESENCE_SIZES = {"smoke": (200, 0.3, 0.3, 1), "quick": (5000, 3.0, 2.0, 2),
                  "full": (20000, 8.0, 4.0, 3)}  # fmt: skip


def _uptime() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + ", ".join(f.read().split()[:3])


def _p(values: list[float], q: float) -> float:
    return pct(values, q) if values else float("nan")


def _timed_ns(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def presence_lookup(size: str = "quick", lmcache_py: str | None = None) -> dict[str, Any]:
    """Local presence lookup of 64 keys (p50) beside the session Lookup RPC of the
    same keys and LMCache's real lookup (its own client, 1 caller), in one run; and
    the table alone at 1 M keys (native and Python): lookup p50 and bytes a key."""
    iters = PRESENCE_SIZES[size][0]
    keys = [b"%032d" % i for i in range(64)]
    out: dict[str, Any] = {"load": _uptime()}
    shm = tempfile.mkdtemp(prefix="kvsvc-presence-")
    with (
        KvsvcServer(store_bytes=64 << 20, shm_dir=shm) as server,
        KVCacheClient(server.address) as client,
    ):
        client.put(PRESENCE_NS, [(k, b"v" * 256) for k in keys])
        with client.presence(PRESENCE_NS) as index:
            if not index.wait_fresh(30):
                raise RuntimeError(f"the presence index never became fresh: {index.error}")
            assert index.prefix_hits(keys) == 64, index.prefix_hits(keys)
            prefix = _timed_ns(lambda: index.prefix_hits(keys), iters)
            hits = _timed_ns(lambda: index.hits(keys), iters)
        assert client.lookup(keys, namespace=PRESENCE_NS) == 64
        rpc = _timed_ns(lambda: client.lookup(keys, namespace=PRESENCE_NS), max(50, iters // 10))
    out["index_prefix_hits_p50_us"] = _p(prefix, 50)
    out["index_prefix_hits_p99_us"] = _p(prefix, 99)
    out["index_hits_p50_us"] = _p(hits, 50)
    out["session_lookup_p50_us"] = _p(rpc, 50)
    out["session_lookup_p99_us"] = _p(rpc, 99)
    py, why = control_plane.lmcache_python(lmcache_py)
    if py is None:
        out["lmcache"] = f"skipped: lmcache is not importable ({why})"
    else:
        seconds = 0.3 if size == "smoke" else 1.0
        samples = control_plane.run_lmcache(py, "zmq", seconds, 0.2, NullProgress())
        one = [s for s in samples if s.concurrency == 1 and "lookup" in s.target.lower()]
        out["lmcache"] = f"lmcache {why} under {py}, zmq, 1 caller"
        if one:
            out["lmcache_lookup_p50_us"] = one[0].stats()["p50_ms"] * 1e3
    for native in [True, False] if NATIVE else [False]:
        n = 1_000_000 if size != "smoke" else 100_000
        table = new_table(native)
        blob = os.urandom(32 * n)
        many = [blob[i : i + 32] for i in range(0, len(blob), 32)]
        for i in range(0, n, 10_000):
            table.add(many[i : i + 10_000], 0)
        probe = [bytes(bytearray(k)) for k in many[:64]]  # new objects, as a caller has
        lat = _timed_ns(functools.partial(table.prefix, probe), min(iters, 2000))
        kind = "native" if native else "python"
        out[f"table_{kind}_keys"] = n
        out[f"table_{kind}_bytes_per_key"] = table.nbytes / n
        out[f"table_{kind}_prefix64_p50_us"] = _p(lat, 50)
        del many, blob, table
    base = out["index_prefix_hits_p50_us"]
    print(f"presence lookup of 64 keys ({out['load']}):")
    print(f"  index prefix_hits p50 {base:.2f} us (p99 {out['index_prefix_hits_p99_us']:.2f}),"
          f" hits p50 {out['index_hits_p50_us']:.2f} us")  # fmt: skip
    print(f"  session Lookup RPC p50 {out['session_lookup_p50_us']:.0f} us "
          f"({out['session_lookup_p50_us'] / base:.0f}x the index)")  # fmt: skip
    if "lmcache_lookup_p50_us" in out:
        lm = out["lmcache_lookup_p50_us"]
        print(f"  LMCache lookup p50 {lm:.0f} us ({lm / base:.0f}x the index)")
    else:
        print(f"  LMCache: {out['lmcache']}")
    for kind in ("native", "python"):
        if f"table_{kind}_keys" in out:
            print(f"  {kind} table at {out[f'table_{kind}_keys']} keys: "
                  f"{out[f'table_{kind}_bytes_per_key']:.1f} B/key, prefix of 64 p50 "
                  f"{out[f'table_{kind}_prefix64_p50_us']:.2f} us")  # fmt: skip
    return out


def _watcher_main() -> None:
    """A watcher process: ``python -c 'from benchmarks.events import _watcher_main;
    _watcher_main()' ADDRESS SECONDS``. Prints "ready", then for each stored key the
    monotonic time it became visible in its index (CLOCK_MONOTONIC is one clock for
    every process of the machine), as JSON lines, when stdin closes or SECONDS pass."""
    address, seconds = sys.argv[1], float(sys.argv[2])
    seen: dict[str, float] = {}

    def applied(batch: Any) -> None:
        now = time.monotonic()
        for e in batch.events:
            if e.HasField("stored"):
                for k in e.stored.keys:
                    seen.setdefault(k.hex(), now)

    with KVCacheClient(address) as client, client.presence(PRESENCE_NS, on_batch=applied) as ix:
        if not ix.wait_fresh(30):
            raise SystemExit(f"watcher: never fresh: {ix.error}")
        print("ready", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end and sys.stdin.readline():
            pass
    print(json.dumps(seen), flush=True)


def _watchers(address: str, n: int, seconds: float) -> list[subprocess.Popen]:
    code = "from benchmarks.events import _watcher_main; _watcher_main()"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, address, str(seconds)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        line = p.stdout.readline() if p.stdout else ""
        if line.strip() != "ready":
            for q in procs:
                q.kill()
            raise RuntimeError(f"a watcher did not start (said {line!r})")
    return procs


def _finish(procs: list[subprocess.Popen]) -> list[dict[str, float]]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(input="", timeout=60)
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def presence_visibility(size: str = "quick") -> dict[str, Any]:
    """Store acknowledged -> visible in another process's index, at 1,000 Stores/s
    (one 4 KiB chunk each, paced over 4 threads): p50/p99/max over every Store (a
    key seen before its ack returned counts 0)."""
    seconds = PRESENCE_SIZES[size][1]
    shm = tempfile.mkdtemp(prefix="kvsvc-presence-")
    acked: dict[str, float] = {}
    senders = 4  # one sync put takes ~0.5-1 ms here: 4 paced threads reach 1,000/s
    with KvsvcServer(store_bytes=256 << 20, shm_dir=shm) as server:
        procs = _watchers(server.address, 1, seconds + 60)
        try:
            with KVCacheClient(server.address) as client:
                data = os.urandom(4096)
                start = time.monotonic()
                total = int(seconds * 1000)

                def send(j: int) -> None:
                    for i in range(j, total, senders):
                        due = start + i / 1000
                        if (wait := due - time.monotonic()) > 0:
                            time.sleep(wait)
                        key = b"vis-%012d" % i
                        client.put(PRESENCE_NS, [(key, data)])
                        acked[key.hex()] = time.monotonic()

                with concurrent.futures.ThreadPoolExecutor(senders) as pool:
                    for f in [pool.submit(send, j) for j in range(senders)]:
                        f.result(timeout=seconds * 10 + 60)
                rate = len(acked) / (time.monotonic() - start)
            time.sleep(0.5)  # the last events reach the watcher
        finally:
            seen = _finish(procs)[0]
    delays = [max(0.0, seen[k] - t) * 1e3 for k, t in acked.items() if k in seen]
    missing = len(acked) - len(delays)
    out = {"stores": len(acked), "stores_per_s": rate, "missing": missing,
           "p50_ms": _p(delays, 50), "p99_ms": _p(delays, 99),
           "max_ms": max(delays, default=float("nan")), "load": _uptime()}  # fmt: skip
    print(f"Store ack -> visible in another process's index at {rate:.0f} Stores/s "
          f"({len(acked)} Stores, {out['load']}): p50 {out['p50_ms']:.2f} ms, p99 "
          f"{out['p99_ms']:.2f} ms, max {out['max_ms']:.2f} ms, never seen {missing}; "
          f"--events-linger-ms {_linger_ms()}")  # fmt: skip
    if missing:
        raise RuntimeError(f"{missing} stored keys never reached the watcher's index")
    return out


def _linger_ms() -> str:
    """The server's --events-linger-ms, as this run sets it (KVSVC_EVENTS_LINGER_MS)."""
    return os.environ.get("KVSVC_EVENTS_LINGER_MS", "0")


def presence_watchers(size: str = "quick") -> dict[str, Any]:
    """Store throughput (closed loop, 1 caller, one 4 KiB chunk a Store) with 4
    watcher processes attached vs none, rounds alternating."""
    _, _, seconds, rounds = PRESENCE_SIZES[size]
    shm = tempfile.mkdtemp(prefix="kvsvc-presence-")
    rates: dict[int, list[float]] = {0: [], 4: []}
    server_us: dict[int, list[float]] = {0: [], 4: []}
    watcher_us: list[float] = []  # the 4 watcher processes' CPU a Store, together
    with (
        KvsvcServer(store_bytes=256 << 20, shm_dir=shm) as server,
        KVCacheClient(server.address) as client,
    ):
        data = os.urandom(4096)
        n = 0
        for _ in range(rounds):
            for watchers in (0, 4):
                procs = _watchers(server.address, watchers, seconds + 60)
                try:
                    cpu0 = cpu_seconds(server.pid)
                    wcpu0 = sum(cpu_seconds(p.pid) for p in procs)
                    start, count = time.monotonic(), 0
                    while time.monotonic() < start + seconds:
                        client.put(PRESENCE_NS, [(b"thr-%012d" % n, data)])
                        n += 1
                        count += 1
                    rates[watchers].append(count / (time.monotonic() - start))
                    used = cpu_seconds(server.pid) - cpu0
                    server_us[watchers].append(used / count * 1e6)
                    if procs:
                        wused = sum(cpu_seconds(p.pid) for p in procs) - wcpu0
                        watcher_us.append(wused / count * 1e6)
                finally:
                    _finish(procs)
    none, four = statistics.mean(rates[0]), statistics.mean(rates[4])
    cpu0, cpu4 = statistics.mean(server_us[0]), statistics.mean(server_us[4])
    out = {"none_per_s": none, "four_per_s": four, "ratio": four / none,
           "server_cpu_us_per_store_none": cpu0, "server_cpu_us_per_store_four": cpu4,
           "watchers_cpu_us_per_store": statistics.mean(watcher_us),
           "cores": os.cpu_count(), "load": _uptime()}  # fmt: skip
    print(f"Store throughput with 4 watchers {four:.0f}/s vs none {none:.0f}/s: "
          f"{out['ratio']:.2f} of none; server CPU a Store {cpu4:.0f} vs {cpu0:.0f} us, "
          f"the 4 watcher processes' {out['watchers_cpu_us_per_store']:.0f} us "
          f"({rounds} round(s) of {seconds} s each, {os.cpu_count()} cores, "
          f"{out['load']}; --events-linger-ms {_linger_ms()})")  # fmt: skip
    return out


# --- the server's resync (issue 29's "Measure": lost -> snapshot -> live at 1 M keys) ---
RESYNC_NS = "bench-resync"
#: present keys per run size
RESYNC_KEYS = {"smoke": 5_000, "quick": 200_000, "full": 1_000_000}


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def events_resync(size: str = "quick") -> dict[str, Any]:
    """A watcher with no cursor against a server holding N chunks: time from the
    request to ``lost``, to ``snapshot_done`` (every key received and counted) and to
    the first live event after it; the server's RSS sampled every 5 ms meanwhile
    (growth over its RSS before the request: the snapshot's references, the pages
    being written)."""
    n = RESYNC_KEYS[size]
    # A chunk holds a 4 KiB allocation and ~540 B of metadata, whatever its value.
    store = max(64 << 20, n * 4700 + (64 << 20))
    shm = tempfile.mkdtemp(prefix="kvsvc-resync-")
    with (
        KvsvcServer(store_bytes=store, shm_dir=shm) as server,
        KVCacheClient(server.address) as client,
    ):
        fill0 = time.monotonic()
        for base in range(0, n, 1000):
            chunk = [(b"rs-%012d" % i, b"v") for i in range(base, min(n, base + 1000))]
            client.put(RESYNC_NS, chunk)
        fill_s = time.monotonic() - fill0
        time.sleep(0.5)
        rss0 = _rss_kib(server.pid)
        peak = [rss0]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.005):
                peak[0] = max(peak[0], _rss_kib(server.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        options = [("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(server.address, options=options) as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)
            t0 = time.perf_counter()
            stream = stub.WatchEvents(pb.WatchEventsRequest(namespaces=[RESYNC_NS]), timeout=300)
            keys = 0
            lost_s = done_s = live_s = float("nan")
            for response in stream:
                batch = response.batch
                if response.WhichOneof("outcome") != "batch":
                    raise RuntimeError(f"error batch: {response.error.reason}")
                if batch.lost:
                    lost_s = time.perf_counter() - t0
                elif batch.snapshot:
                    keys += sum(len(e.stored.keys) for e in batch.events)
                    if batch.snapshot_done:
                        done_s = time.perf_counter() - t0
                        client.put(RESYNC_NS, [(b"rs-live", b"v")])
                elif any(b"rs-live" in e.stored.keys for e in batch.events):
                    live_s = time.perf_counter() - t0
                    break
            stream.cancel()
        sampling.set()
        sampler.join(5)
    if keys != n:
        raise RuntimeError(f"the snapshot held {keys} keys, {n} were stored")
    out = {"keys": n, "fill_s": fill_s, "lost_s": lost_s, "snapshot_done_s": done_s,
           "live_s": live_s, "rss_before_mib": rss0 / 1024,
           "rss_growth_mib": (peak[0] - rss0) / 1024, "load": _uptime()}  # fmt: skip
    print(f"resync at {n} present keys: lost after {1e3 * lost_s:.0f} ms, snapshot_done "
          f"after {done_s:.2f} s (the live Store put after it seen at {live_s:.2f} s); server "
          f"RSS +{out['rss_growth_mib']:.1f} MiB over {out['rss_before_mib']:.0f} MiB "
          f"({os.cpu_count()} cores, {out['load']})")  # fmt: skip
    return out


#: name -> section(size); benchmarks.run runs them all
SECTIONS: dict[str, Callable[[str], dict[str, Any]]] = {
    "lookup": presence_lookup,
    "visibility": presence_visibility,
    "watchers": presence_watchers,
    "resync": events_resync,
}


def run(size: str, only: list[str] | None = None) -> dict[str, Any]:
    """Every section (or ``only`` those); a failed one raises after the others ran."""
    results: dict[str, Any] = {}
    failed: list[str] = []
    for name, fn in SECTIONS.items():
        if only and name not in only:
            continue
        try:
            results[name] = fn(size)
        except Exception as exc:  # noqa: BLE001 - recorded; the others still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"events section {name} FAILED: {exc!r}", file=sys.stderr)
            failed.append(name)
    if failed:
        raise RuntimeError(f"events section(s) failed: {', '.join(failed)}")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sizes = ap.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true")
    sizes.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument("--only", nargs="*", choices=list(SECTIONS), default=None)
    args = ap.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    try:
        results = run(size, args.only)
    except RuntimeError as exc:
        print(f"benchmarks.events: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
