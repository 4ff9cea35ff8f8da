"""Server memory: the resident set (VmRSS of the `kvsvc serve` process, from
/proc/PID/status) against the store capacity, at start, after filling the store
through shared memory, and after eviction churn (twice the capacity more);
then RSS drift over a bounded soak of mixed traffic (2 minutes by default,
20 s with --quick); then big inline Stores refused while a caller asks Lookups
(benchmarks/inline_flood.py: its Lookup latency and the server's peak RSS).

The store touches its memory up front (a private anonymous mapping with huge
pages, counted in RssAnon), so RSS is about the capacity from the start; what
matters is what comes on top of it and whether that grows.

    python -m benchmarks.memory [--quick | --smoke] [--soak-seconds S]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

from benchmarks import inline_flood
from benchmarks.common import KvsvcServer, NullProgress, Progress, md_table, proc_status
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.errors import KVServiceError

MiB = 1 << 20
GiB = 1 << 30
LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # 2 MiB blocks, as in data_plane
CHUNK_BLOCKS = 16  # 32 MiB chunks for filling


def capacities(quick: bool, smoke: bool = False) -> list[int]:
    if smoke:
        return [64 * MiB]
    return [256 * MiB] if quick else [256 * MiB, 1 * GiB, 4 * GiB]


def _cache(name: str, blocks: int, shm_dir: str) -> SharedKVCache:
    c = SharedKVCache(name, num_layers=LAYERS, num_blocks=blocks, block_size=BLOCK,
                      kv_heads=HEADS, head_dim=HEAD_DIM, shm_dir=shm_dir)  # fmt: skip
    for layer in c.layers:
        layer.random_()
    return c


def fill_and_churn(capacity: int, shm_dir: str) -> dict[str, Any]:
    """RSS of a fresh server at start, after storing ``capacity`` bytes, after
    storing 2x ``capacity`` more (LRU eviction throughout)."""
    tag = f"mem-{os.getpid()}-{capacity >> 20}"
    chunk_bytes = CHUNK_BLOCKS * 2 * MiB
    with KvsvcServer(store_bytes=capacity, shm_dir=shm_dir) as server, \
            KVCacheClient(server.address, transfer_timeout=120) as c, \
            _cache(tag, CHUNK_BLOCKS, shm_dir) as src:  # fmt: skip
        c.server_info()
        time.sleep(0.5)
        start = proc_status(server.pid)
        m = c.map(tag, [src.rank_region()])
        ids = list(range(CHUNK_BLOCKS))
        n_fill = capacity // chunk_bytes
        for i in range(n_fill):
            r = c.store(m, [(b"fill-%d" % i, ids)])
            assert r.stored_chunks == 1, r
        info = c.server_info()
        # Full: no room for one more chunk. The store counts each chunk's key and
        # metadata against the capacity too, so the last of ``n_fill`` chunks of
        # capacity / chunk bytes evicted the first (used >= n_fill x chunk fails).
        assert info.capacity_bytes - info.used_bytes < chunk_bytes, info
        assert info.evicted_chunks <= 1, info
        filled = proc_status(server.pid)
        evicted0 = info.evicted_chunks
        for i in range(2 * n_fill):
            c.store(m, [(b"churn-%d" % i, ids)])
        # and read back what is there (the newest of as many as the fill left held),
        # through the other direction
        held = n_fill - evicted0
        for i in range(2 * n_fill - min(4, held), 2 * n_fill):
            assert c.retrieve(m, [(b"churn-%d" % i, ids)]).loaded_chunks == 1
        info = c.server_info()
        churned = proc_status(server.pid)
        c.unmap(m)
    return {
        "capacity": capacity,
        "start": start,
        "filled": filled,
        "churned": churned,
        "chunks_stored": n_fill * 3,
        "evicted": info.evicted_chunks - evicted0,
    }


def soak(capacity: int, shm_dir: str, seconds: float, progress: Progress) -> dict[str, Any]:
    """Mixed traffic for ``seconds``; RSS sampled throughout."""
    tag = f"soak-{os.getpid()}"
    counts: dict[str, int] = {}
    errors: list[BaseException] = []
    samples: list[tuple[float, int]] = []
    with KvsvcServer(store_bytes=capacity, shm_dir=shm_dir) as server:
        t0 = time.monotonic()
        t_end = t0 + seconds
        stop = threading.Event()

        def count(what: str) -> None:
            counts[what] = counts.get(what, 0) + 1

        def data_traffic() -> None:
            # Block stores and retrieves of 2 MiB and 32 MiB chunks over a key space
            # larger than the store, so eviction runs all the time; reads of recent
            # keys hit, reads of old ones miss.
            rnd = random.Random(1)
            recent: collections.deque[tuple[bytes, list[int]]] = collections.deque(maxlen=6)
            with KVCacheClient(server.address, transfer_timeout=60) as c, \
                    _cache(f"{tag}-d", 32, shm_dir) as kv:  # fmt: skip
                m = c.map(f"{tag}-d", [kv.rank_region()])
                for i in itertools.count():
                    if stop.is_set() or time.monotonic() > t_end or i > 10**7:
                        break
                    blocks = rnd.choice((1, 16))
                    lo = rnd.randrange(0, 32 - blocks + 1)
                    ids = list(range(lo, lo + blocks))
                    key = b"d-%d" % i
                    c.store(m, [(key, ids)])
                    recent.append((key, ids))
                    count("store")
                    # mostly recent keys (hits), sometimes long-evicted ones (misses)
                    back = recent[rnd.randrange(len(recent))]
                    if rnd.random() < 0.1:
                        back = (b"gone-%d" % i, back[1])  # never stored: a miss
                    hit = c.retrieve(m, [back]).loaded_chunks
                    count("retrieve hit" if hit else "retrieve miss")
                c.unmap(m)

        def control_traffic() -> None:
            rnd = random.Random(2)
            with KVCacheClient(server.address) as c:
                for i in itertools.count():
                    if stop.is_set() or time.monotonic() > t_end or i > 10**8:
                        break
                    what = rnd.random()
                    if what < 0.5:
                        c.lookup([b"i-%d" % (i - j) for j in range(8)], namespace="soak")
                        count("lookup")
                    elif what < 0.8:
                        c.put("soak", [(b"i-%d" % i, os.urandom(64 << 10))])
                        count("inline put")
                    elif what < 0.95:
                        try:
                            c.get("soak", b"i-%d" % max(0, i - rnd.randrange(0, 8)))
                            count("inline get")
                        except KVServiceError:
                            count("inline get miss")
                    else:
                        with contextlib.suppress(KVServiceError):
                            c.get("soak", b"")  # empty key: InvalidRequest
                        count("invalid request")

        def mapping_churn() -> None:
            with KVCacheClient(server.address) as c:
                for i in itertools.count():
                    if stop.wait(0.5) or time.monotonic() > t_end or i > 10**6:
                        break
                    with _cache(f"{tag}-m{i % 4}", 2, shm_dir) as kv:
                        m = c.map(f"{tag}-m{i}", [kv.rank_region()])
                        c.store(m, [(b"m-%d" % i, [0, 1])])
                        c.fence(m)
                        c.unmap(m)
                    count("map/store/fence/unmap")

        def guarded(fn: Any) -> Any:
            def run() -> None:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - reported after the soak
                    errors.append(exc)
                    stop.set()

            return run

        threads = [threading.Thread(target=guarded(f), daemon=True)
                   for f in (data_traffic, control_traffic, mapping_churn)]  # fmt: skip
        for t in threads:
            t.start()
        period = max(0.25, seconds / 120)
        next_sample, shown = t0, 0
        while time.monotonic() < t_end and not stop.is_set():
            now = time.monotonic()
            if now >= next_sample:
                samples.append((now - t0, proc_status(server.pid)["VmRSS"]))
                next_sample += period
            if now - t0 >= shown + 10:
                shown += 10
                rss = samples[-1][1] / MiB
                progress.log(f"soak {shown:.0f}/{seconds:.0f} s, RSS {rss:.0f} MiB")
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(120)
        samples.append((time.monotonic() - t0, proc_status(server.pid)["VmRSS"]))
        alive = server.proc.poll() is None
    if errors:
        raise RuntimeError(f"soak traffic failed: {errors[0]!r}") from errors[0]
    if not alive:
        raise RuntimeError("the server died during the soak")
    # drift: from the end of the first tenth (warm-up) to the end
    warm = [s for s in samples if s[0] >= seconds * 0.1] or samples
    first, last = warm[0][1], warm[-1][1]
    half = [s for s in samples if s[0] >= seconds / 2]
    slope = 0.0
    if len(half) >= 3:
        xs = [s[0] for s in half]
        ys = [s[1] for s in half]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        den = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0
    return {
        "capacity": capacity,
        "seconds": seconds,
        "samples": samples,
        "rss_after_warmup": first,
        "rss_end": last,
        "rss_max": max(s[1] for s in samples),
        "drift": last - first,
        "slope_mib_per_min": slope * 60 / MiB,
        "counts": counts,
    }


def run(*, quick: bool, smoke: bool = False, soak_seconds: float | None = None,
        progress: Progress | None = None) -> dict[str, Any]:  # fmt: skip
    """``smoke``: a 64 MiB store and a 3 s soak (checks the section runs, measures
    nothing worth keeping)."""
    progress = progress or NullProgress()
    shm_dir = tempfile.mkdtemp(prefix="kvsvc-mem-", dir="/dev/shm")
    soak_bytes = 64 * MiB if smoke else 256 * MiB if quick else 1 * GiB
    default_soak = 3.0 if smoke else 20.0 if quick else 120.0
    try:
        fills = []
        for cap in capacities(quick, smoke):
            fills.append(fill_and_churn(cap, shm_dir))
            progress.step(f"memory fill {cap >> 20} MiB")
        s = soak(soak_bytes, shm_dir, soak_seconds or default_soak, progress)
        progress.step("memory soak")
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    clients, mib, store, rounds = (2, 8, 4, 1) if smoke else (8, 128, 64, 1 if quick else 3)
    flood = inline_flood.measure(clients=clients, message_mib=mib, store_mib=store, rounds=rounds)
    return {"fills": fills, "soak": s, "flood": flood}


def tables(result: dict[str, Any]) -> str:
    def mib(x: int) -> str:
        return f"{x / MiB:.0f}"

    fill_rows = []
    for f in result["fills"]:
        cap = f["capacity"]
        for label in ("start", "filled", "churned"):
            st = f[label]
            fill_rows.append((f"{mib(cap)}", {"start": "at start", "filled": "after fill",
                                               "churned": "after 2x churn"}[label],
                              mib(st["VmRSS"]), mib(st["VmRSS"] - cap), mib(st["RssAnon"]),
                              mib(st["RssFile"]), mib(st["RssShmem"])))  # fmt: skip
    s = result["soak"]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items()))
    return "\n".join([
        md_table(["capacity MiB", "when", "VmRSS MiB", "VmRSS - capacity MiB", "RssAnon MiB",
                  "RssFile MiB", "RssShmem MiB"], fill_rows),
        "",
        md_table(["soak", "store MiB", "RSS after warm-up MiB", "RSS at end MiB", "max MiB",
                  "drift MiB", "slope over 2nd half MiB/min"],
                 [(f"{s['seconds']:.0f} s mixed traffic", mib(s["capacity"]),
                   mib(s["rss_after_warmup"]), mib(s["rss_end"]), mib(s["rss_max"]),
                   f"{s['drift'] / MiB:+.1f}", f"{s['slope_mib_per_min']:+.2f}")]),
        "",
        f"Soak operations: {counts}.",
        "",
        inline_flood.table(result["flood"]),
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument("--soak-seconds", type=float, default=None)
    args = ap.parse_args()
    print(tables(run(quick=args.quick, smoke=args.smoke, soak_seconds=args.soak_seconds)))


if __name__ == "__main__":
    main()
