"""The remote tier (--remote) against raw redis-py, in the same run on the same Redis:

1. Store-to-Redis: node A (`kvsvc serve --remote`) stores block chunks from a shm
   region; timed from the Store call until Redis holds every chunk (DBSIZE;
   then kvsvc_tier_written_bytes_total{tier="redis"} on A's metrics port checks that all
   were written). Reference: one raw redis-py pipeline SET of the same bytes
   (values of the same size, hiredis).
2. Retrieve-from-Redis: node B (empty store) retrieves them into its own blocks:
   fetch, verify, copy into the store and into the blocks. Reference: one raw
   pipeline GET of the same values.
3. Lookup p50/p99 of 16 keys: remote tier off (node C), on with the keys in
   Redis only (one EXISTS round trip), on with the keys local (no Redis call),
   and the raw pipelined EXISTS; optionally the same served by another checkout
   (``--baseline-src DIR``, e.g. the thread-hop version) in the same rounds.

Every round runs each target once, in an order rotated per round (Lookups: call
by call, each target in turn), so load swings on a shared host hit them alike;
ratios are per round (tier / raw of that round), reported as the median and the
spread (min-max). ``os.getloadavg()`` is printed
per round: read the figures with it.

    python -m benchmarks.redis_tier [--total-mib 256] [--rounds 5] [--lookups 2000] [--smoke]

Needs redis-server (scripts/install_redis.sh). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from benchmarks.common import REPO, KvsvcServer, machine_info, machine_line, md_table, pct
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.server.config import REMOTE_WRITERS
from kvsvc.server.tiers.redis import value_connection_settings
from kvsvc.v1 import kv_cache_service_pb2 as pb

sys.path.insert(0, str(REPO / "tests"))
from redis_servers import RedisServer, free_port

MiB = 1 << 20
BLOCK_BYTES = 2 * 16 * 8 * 128 * 2  # one layer's block: K+V, 16 tokens, 8 heads, 128 dims, bf16
LAYERS = 4  # 256 KiB per block over all layers


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def cache(shm: str, name: str, blocks: int, memfd: bool = False) -> SharedKVCache:
    return SharedKVCache(name, num_layers=LAYERS, num_blocks=blocks, block_size=16, kv_heads=8,
                         head_dim=128, shm_dir=shm, memfd=memfd)  # fmt: skip


def region(client: KVCacheClient, kv: SharedKVCache, memfd: bool) -> pb.RankRegion:
    """The engine's region as the Map sends it (a sealed memfd is registered first)."""
    return kv.rank_region(token=client.register_memfd(kv.fd) if memfd else "")


def node(shm: str, remote: str, metrics: int = 0, cwd: str | None = None) -> KvsvcServer:
    # --remote-timeout 5: on this shared 2-core host a process can stall past the
    # default 0.5 s under other jobs' load, and a miss would end the throughput run.
    args = ["--remote", remote, "--remote-timeout", "5"]
    if metrics:
        args += ["--metrics-port", str(metrics)]
    return KvsvcServer(store_bytes="1G", shm_dir=shm, extra_args=args, cwd=cwd)


def raw_round(r: redis.Redis, data: bytes, n: int, tag: str) -> tuple[float, float]:
    """Seconds for one pipelined SET of n values, then one pipelined GET of them."""
    keys = [f"raw:{tag}:{i}" for i in range(n)]
    t0 = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.set(k, data)
    pipe.execute()
    t_set = time.perf_counter() - t0
    t0 = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    got = pipe.execute()
    t_get = time.perf_counter() - t0
    assert all(len(g) == len(data) for g in got)
    r.delete(*keys)
    return t_set, t_get


def raw_round_like_tier(
    writers: list[redis.Redis], data: bytes, n: int, tag: str
) -> tuple[float, float]:
    """raw_round shaped as the tier works: its connection settings
    (kvsvc.server.tiers.redis.value_connection_settings), the SETs split over REMOTE_WRITERS
    connections at once (its writer threads), the GETs one pipeline (one reader)."""
    keys = [f"like:{tag}:{i}" for i in range(n)]
    share = [keys[i :: len(writers)] for i in range(len(writers))]

    def put(r: redis.Redis, ks: list[str]) -> None:
        pipe = r.pipeline(transaction=False)
        for k in ks:
            pipe.set(k, data)
        pipe.execute()

    with ThreadPoolExecutor(len(writers)) as pool:
        t0 = time.perf_counter()
        for f in [pool.submit(put, r, ks) for r, ks in zip(writers, share, strict=True)]:
            f.result()  # a failed SET fails the run
        t_set = time.perf_counter() - t0
    t0 = time.perf_counter()
    pipe = writers[0].pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    got = pipe.execute()
    t_get = time.perf_counter() - t0
    assert len(got) == n and all(g is not None and len(g) == len(data) for g in got)
    writers[0].delete(*keys)
    return t_set, t_get


def raw_round_async(port: int, data: bytes, n: int, tag: str) -> tuple[float, float]:
    """The same as raw_round with redis.asyncio (issue: the client chosen is measured)."""
    import asyncio

    import redis.asyncio as aredis

    async def run() -> tuple[float, float]:
        r = aredis.Redis(port=port, socket_timeout=60)
        keys = [f"async:{tag}:{i}" for i in range(n)]
        t0 = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.set(k, data)
        await pipe.execute()
        t_set = time.perf_counter() - t0
        t0 = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got = await pipe.execute()
        t_get = time.perf_counter() - t0
        assert all(len(g) == len(data) for g in got)
        await r.delete(*keys)
        await r.aclose()
        return t_set, t_get

    return asyncio.run(run())


def tier_round(
    rs: RedisServer,
    shm: str,
    chunk_mib: int,
    n: int,
    tag: str,
    behind: list[float],
    cwd: str | None = None,
    memfd: bool = False,
) -> tuple[float, float]:
    """Seconds from Store to the last write acknowledged, and of the Retrieve on B;
    appends to ``behind`` the seconds from the Store's reply to the last write."""
    per_chunk = chunk_mib * MiB // (BLOCK_BYTES * LAYERS)
    blocks = per_chunk * n
    port, port_b = free_port(), free_port()
    a = node(shm, rs.url, port, cwd)
    b = node(shm, rs.url, port_b, cwd)
    src, dst = cache(shm, f"src-{tag}", blocks, memfd), cache(shm, f"dst-{tag}", blocks, memfd)
    try:
        src.buffer.random_(0, 256)
        chunks = [
            (f"{tag}-{i}".encode(), list(range(i * per_chunk, (i + 1) * per_chunk)))
            for i in range(n)
        ]
        with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
            ma = ca.map("bench", [region(ca, src, memfd)])
            mb = cb.map("bench", [region(cb, dst, memfd)])
            want = float(n * chunk_mib * MiB)
            t0 = time.perf_counter()
            ca.store(ma, chunks, timeout=120)
            t_reply = time.perf_counter() - t0
            # Polled with DBSIZE (O(1) in Redis; one key per chunk: no value is split
            # here) rather than node A's /metrics, whose rendering every 10 ms took
            # CPU and the GIL from A's writers.
            probe = redis.Redis(port=rs.port, socket_timeout=60)
            while probe.dbsize() < n:
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError("writes did not reach Redis in 120 s (dropped?)")
                time.sleep(0.01)
            t_store = time.perf_counter() - t0
            probe.close()
            behind.append(t_store - t_reply)
            end = time.perf_counter() + 30  # A counts a batch once Redis answered it
            while (written := metric(port, 'kvsvc_tier_written_bytes_total{tier="redis"}')) != want:
                if time.perf_counter() > end:
                    raise RuntimeError(f"node A wrote {written:.0f} bytes, not {want:.0f}")
                time.sleep(0.05)
            t0 = time.perf_counter()
            loaded = cb.retrieve(mb, chunks, timeout=120).loaded_chunks
            t_retrieve = time.perf_counter() - t0
            if loaded != n:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port_b}/metrics").read()
                lines = text.decode().splitlines()
                why = [ln for ln in lines if ln.startswith(("kvsvc_remote", "kvsvc_tier"))]
                raise RuntimeError(f"retrieved {loaded} of {n} chunks: " + "; ".join(why))
            if not src.buffer.equal(dst.buffer):
                raise RuntimeError("retrieved blocks differ from the stored ones")
            cb.unmap(mb)
            ca.unmap(ma)
    finally:
        src.close()
        dst.close()
        a.stop()
        b.stop()
    return t_store, t_retrieve


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """median (min-max) of per-round values."""
    return (
        f"{fmt.format(statistics.median(values))} "
        f"({fmt.format(min(values))}-{fmt.format(max(values))})"
    )


def rotated(items: list, rnd: int) -> list:
    k = rnd % len(items)
    return items[k:] + items[:k]


def lookups(c: KVCacheClient, mapping: object, keys: list[bytes], count: int) -> list[float]:
    """Seconds per Lookup; negative where it answered less than all keys (the budget)."""
    lat = []
    for _ in range(count):
        t0 = time.perf_counter()
        hits = c.lookup(keys, mapping=mapping)  # type: ignore[arg-type]
        lat.append(time.perf_counter() - t0)
        if hits != len(keys):  # past the budget: answered from the local tier only
            lat[-1] = -lat[-1]
    return lat


def raw_exists(raw: redis.Redis, keys: list[bytes], count: int) -> list[float]:
    """The reference for "one Redis round trip": the same pipelined EXISTS, raw."""
    lat = []
    for _ in range(count):
        t0 = time.perf_counter()
        pipe = raw.pipeline(transaction=False)
        for k in keys:
            pipe.exists(b"bench:" + k)
        pipe.execute()
        lat.append(time.perf_counter() - t0)
    return lat


def lookup_rows(
    rs: RedisServer, shm: str, count: int, rounds: int, baseline: str
) -> tuple[list[list[str]], list[list[str]]]:
    """(per-case p50/p99 over all rounds, per-round extra cost of Redis vs raw EXISTS)."""
    keys = [b"lk-%d" % i for i in range(16)]
    a, b, c = node(shm, rs.url), node(shm, rs.url), node(shm, "off")
    d = node(shm, rs.url, cwd=baseline) if baseline else None  # keys in Redis only
    e = node(shm, rs.url)  # keys local
    caches = [cache(shm, f"lk{i}", 16) for i in range(5)]
    off, on_local, on_redis = (
        "remote tier off, keys local",
        "remote tier on, keys local",
        "remote tier on, keys in Redis only (EXISTS)",
    )
    base_redis = f"baseline ({baseline}), keys in Redis only"
    raw_name = "raw redis-py pipelined EXISTS of 16 keys (one round trip)"
    lat: dict[str, list[float]] = {}
    per_round: list[dict[str, float]] = []
    raw = redis.Redis(port=rs.port, socket_timeout=60)
    clients: list[KVCacheClient] = []
    try:
        with KVCacheClient(a.address) as ca:
            ma = ca.map("bench", [caches[0].rank_region()])
            ca.store(ma, [(k, [i]) for i, k in enumerate(keys)])
            time.sleep(1.0)  # the write-behind reaches Redis
        targets: dict[str, tuple[KVCacheClient, object]] = {}
        for name, srv, cch, store_locally in (
            (off, c, caches[2], True),
            (on_redis, b, caches[1], False),
            (on_local, e, caches[3], "retrieve"),
            *([(base_redis, d, caches[4], False)] if d is not None else []),
        ):
            cl = KVCacheClient(srv.address)
            clients.append(cl)
            m = cl.map("bench", [cch.rank_region()])
            if store_locally == "retrieve":  # from Redis into the local store
                cl.retrieve(m, [(k, [i]) for i, k in enumerate(keys)])
            elif store_locally:
                cl.store(m, [(k, [i]) for i, k in enumerate(keys)])
            targets[name] = (cl, m)
            lookups(cl, m, keys, 50)  # warm: connections made, code paths run
        raw_exists(raw, keys, 50)
        per = max(1, count // rounds)
        names = [*targets, raw_name]
        for rnd in range(rounds):
            # Call by call, each target in turn: neighbouring samples share the load.
            got: dict[str, list[float]] = {name: [] for name in names}
            for i in range(per):
                for name in rotated(names, i + rnd):
                    if name == raw_name:
                        got[name] += raw_exists(raw, keys, 1)
                    else:
                        got[name] += lookups(*targets[name], keys, 1)
            p50: dict[str, float] = {}
            for name in names:
                lat.setdefault(name, []).extend(got[name])
                p50[name] = statistics.median(abs(x) for x in got[name])
            p50["load"] = os.getloadavg()[0]
            per_round.append(p50)
        rows = [
            [
                name,
                f"{1e3 * pct([abs(x) for x in v], 50):.3f}",
                f"{1e3 * pct([abs(x) for x in v], 99):.3f}",
                f"{sum(x > 0 for x in v)} of {len(v)}" if name != raw_name else "-",
            ]
            for name, v in lat.items()
        ]
        cost = [
            [
                str(i + 1),
                f"{r['load']:.1f}",
                f"{1e3 * (r[on_redis] - r[off]):.3f}",
                *([f"{1e3 * (r[base_redis] - r[off]):.3f}"] if d is not None else []),
                f"{1e3 * r[raw_name]:.3f}",
                f"{(r[on_redis] - r[off]) / r[raw_name]:.2f}",
            ]
            for i, r in enumerate(per_round)
        ]
        ratios = [(r[on_redis] - r[off]) / r[raw_name] for r in per_round]
        cost.append(["median (min-max)", "", "", *([""] if d is not None else []), "",
                     spread(ratios)])  # fmt: skip
        return rows, cost
    finally:
        for cl in clients:
            cl.close()
        raw.close()
        for x in caches:
            x.close()
        for s in (a, b, c, d, e):
            if s is not None:
                s.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total-mib", type=int, default=256, help="bytes per round and chunk size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--lookups", type=int, default=2000, help="Lookups per case, all rounds")
    p.add_argument("--lookups-only", action="store_true", help="skip the throughput rounds")
    p.add_argument("--region", choices=("file", "memfd"), default="file",
                   help="the engines' KV regions: shm files (the default cache) or sealed "
                        "memfds (the vLLM connector's)")  # fmt: skip
    p.add_argument("--baseline-src", default="", help="another checkout: its Lookup too")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = p.parse_args()
    if args.smoke:
        args.total_mib, args.rounds, args.lookups = 32, 1, 40
    work = Path(tempfile.mkdtemp(prefix="kvsvc-redis-bench-"))
    shm = tempfile.mkdtemp(prefix="kvsvc-redis-bench-", dir="/dev/shm")
    rs = RedisServer(work / "redis")
    print(machine_line(machine_info()))
    print(f"\nstart {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {load()}")
    try:
        raw = redis.Redis(port=rs.port, socket_timeout=60)
        like = [
            redis.Redis(
                connection_pool=redis.ConnectionPool(
                    port=rs.port, socket_timeout=60, **value_connection_settings()
                )
            )
            for _ in range(REMOTE_WRITERS)
        ]
        rows: list[list[str]] = []
        like_rows: list[list[str]] = []
        ab_rows: list[list[str]] = []
        client_rows: list[list[str]] = []
        for chunk_mib in () if args.lookups_only else (2, 32):
            n = args.total_mib // chunk_mib
            data = bytes(chunk_mib * MiB)
            res: dict[str, list[float]] = {}
            loads = []

            targets = ["raw", "tier", "like", "async"] + (["base"] if args.baseline_src else [])
            for rnd in range(args.rounds):  # each target once per round, order rotated
                for target in rotated(targets, rnd):
                    tag = f"{chunk_mib}-{rnd}"
                    if target == "raw":
                        s, g = raw_round(raw, data, n, tag)
                    elif target == "like":
                        s, g = raw_round_like_tier(like, data, n, tag)
                    elif target == "async":
                        s, g = raw_round_async(rs.port, data, n, tag)
                    else:
                        behind: list[float] = []
                        cwd = args.baseline_src if target == "base" else None
                        s, g = tier_round(
                            rs, shm, chunk_mib, n, f"{target}{chunk_mib}r{rnd}", behind, cwd,
                            args.region == "memfd",
                        )  # fmt: skip
                        res.setdefault(f"{target} behind", []).append(behind[0])
                    res.setdefault(f"{target} set", []).append(s)
                    res.setdefault(f"{target} get", []).append(g)
                    rs.cli("flushall")
                loads.append(os.getloadavg()[0])
            nbytes = n * chunk_mib * MiB
            gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in res.items()}
            # tier time / raw time of the same round: raw/tier throughput
            set_ratio = [r / t for r, t in zip(res["raw set"], res["tier set"], strict=True)]
            get_ratio = [r / t for r, t in zip(res["raw get"], res["tier get"], strict=True)]
            like_set = [r / t for r, t in zip(res["like set"], res["tier set"], strict=True)]
            like_get = [r / t for r, t in zip(res["like get"], res["tier get"], strict=True)]
            if args.baseline_src:
                ab_set = [b / t for b, t in zip(res["base set"], res["tier set"], strict=True)]
                ab_get = [b / t for b, t in zip(res["base get"], res["tier get"], strict=True)]
                ab_rows.append([f"{chunk_mib} MiB x {n}", f"{gbs['tier set']:.2f}",
                                f"{gbs['base set']:.2f}", spread(ab_set), f"{gbs['tier get']:.2f}",
                                f"{gbs['base get']:.2f}", spread(ab_get)])  # fmt: skip
            # The write-behind alone (Store reply -> last value in Redis) against the same.
            like_behind = [r / t for r, t in zip(res["like set"], res["tier behind"], strict=True)]
            like_rows.append([f"{chunk_mib} MiB x {n}", f"{gbs['tier set']:.2f}",
                              f"{gbs['like set']:.2f}", spread(like_set),
                              f"{gbs['tier behind']:.2f}", spread(like_behind),
                              f"{gbs['tier get']:.2f}", f"{gbs['like get']:.2f}",
                              spread(like_get)])  # fmt: skip
            client_rows.append([f"{chunk_mib} MiB x {n}", f"{gbs['raw set']:.2f}",
                                f"{gbs['async set']:.2f}", f"{gbs['raw get']:.2f}",
                                f"{gbs['async get']:.2f}"])  # fmt: skip
            rows.append([f"{chunk_mib} MiB x {n}", spread(loads, "{:.1f}"),
                         f"{gbs['tier set']:.2f}", f"{gbs['raw set']:.2f}", spread(set_ratio),
                         f"{gbs['tier behind']:.2f}", f"{gbs['tier get']:.2f}",
                         f"{gbs['raw get']:.2f}", spread(get_ratio)])  # fmt: skip
        if rows:
            print(f"\nThroughput, GB/s (median of {args.rounds} rounds, "
                  f"{args.total_mib} MiB each, engines' regions: {args.region}); "
                  "ratio: per round, median (min-max):\n")  # fmt: skip
            print(md_table(["chunks", "load1", "Store→Redis", "raw pipelined SET", "ratio",
                            "after the reply", "Retrieve←Redis", "raw pipelined GET", "ratio"],
                           rows))  # fmt: skip
            print(f"\nThe same against raw redis-py with the tier's connection settings "
                  f"(Python packer, {value_connection_settings()['socket_read_size'] >> 10} KiB "
                  f"reads; SETs over {REMOTE_WRITERS} connections at once), GB/s:\n")  # fmt: skip
            print(md_table(["chunks", "Store→Redis", "raw SET like the tier", "ratio",
                            "after the reply", "ratio", "Retrieve←Redis",
                            "raw GET like the tier", "ratio"], like_rows))  # fmt: skip
            if ab_rows:
                print(f"\nThis checkout against --baseline-src {args.baseline_src} (its "
                      "own nodes, the same rounds), GB/s; ratio: this / baseline:\n")  # fmt: skip
                print(md_table(["chunks", "Store→Redis", "baseline", "ratio", "Retrieve←Redis",
                                "baseline", "ratio"], ab_rows))  # fmt: skip
            print("\nThe client for the tier: redis-py pipelines, sync vs asyncio, GB/s:\n")
            print(md_table(["chunks", "sync SET", "asyncio SET", "sync GET", "asyncio GET"],
                           client_rows))  # fmt: skip
        lk, cost = lookup_rows(rs, shm, args.lookups, args.rounds, args.baseline_src)
        print(f"\nLookup of 16 keys, {args.lookups} sequential calls per case in "
              f"{args.rounds} rounds, ms (hits: calls answered with all 16):\n")  # fmt: skip
        print(md_table(["case", "p50", "p99", "full answers"], lk))
        print("\nPer round: p50 of Lookup with the keys in Redis only minus p50 with the "
              "tier off, against the raw EXISTS p50 (goal: ratio ≤ 1), ms:\n")  # fmt: skip
        base = ["baseline - off"] if args.baseline_src else []
        print(md_table(["round", "load1", "on (Redis) - off", *base, "raw EXISTS",
                        "ratio"], cost))  # fmt: skip
        raw.close()
        for r in like:
            r.close()
    finally:
        rs.kill()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nend {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
