"""The remote tier (--remote) against raw redis-py, in the same run on the same Redis:

1. Store-to-Redis: node A (`kvsvc serve --remote`) stores block chunks from a shm
   region; timed from the Store call to the last byte acknowledged by Redis
   (kvsvc_remote_written_bytes_total on A's metrics port). Reference: one raw
   redis-py pipeline SET of the same bytes (values of the same size, hiredis).
2. Retrieve-from-Redis: node B (empty store) retrieves them into its own blocks:
   fetch, verify, copy into the store and into the blocks. Reference: one raw
   pipeline GET of the same values.
3. Lookup p50/p99 of 16 keys: remote tier off (node C), on with the keys in
   Redis only (one EXISTS round trip), on with the keys local (no Redis call).

    python -m benchmarks.redis_tier [--total-mib 256] [--rounds 3] [--lookups 2000]

Needs redis-server (scripts/install_redis.sh). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import redis

from benchmarks.common import REPO, KvsvcServer, machine_info, machine_line, md_table, pct
from kvsvc.client import KVCacheClient
from kvsvc.kvcache import SharedKVCache

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


def cache(shm: str, name: str, blocks: int) -> SharedKVCache:
    return SharedKVCache(name, num_layers=LAYERS, num_blocks=blocks, block_size=16, kv_heads=8,
                         head_dim=128, shm_dir=shm)  # fmt: skip


def node(shm: str, remote: str, metrics: int = 0) -> KvsvcServer:
    # --remote-timeout 5: on this shared 2-core host a process can stall past the
    # default 0.5 s under other jobs' load, and a miss would end the throughput run.
    args = ["--remote", remote, "--remote-timeout", "5"]
    if metrics:
        args += ["--metrics-port", str(metrics)]
    return KvsvcServer(store_bytes="1G", shm_dir=shm, extra_args=args)


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
    rs: RedisServer, shm: str, chunk_mib: int, n: int, tag: str, behind: list[float]
) -> tuple[float, float]:
    """Seconds from Store to the last write acknowledged, and of the Retrieve on B;
    appends to ``behind`` the seconds from the Store's reply to the last write."""
    per_chunk = chunk_mib * MiB // (BLOCK_BYTES * LAYERS)
    blocks = per_chunk * n
    port, port_b = free_port(), free_port()
    a = node(shm, rs.url, port)
    b = node(shm, rs.url, port_b)
    src, dst = cache(shm, f"src-{tag}", blocks), cache(shm, f"dst-{tag}", blocks)
    try:
        src.buffer.random_(0, 256)
        chunks = [
            (f"{tag}-{i}".encode(), list(range(i * per_chunk, (i + 1) * per_chunk)))
            for i in range(n)
        ]
        with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
            ma = ca.map("bench", [src.rank_region()])
            mb = cb.map("bench", [dst.rank_region()])
            want = float(n * chunk_mib * MiB)
            t0 = time.perf_counter()
            ca.store(ma, chunks, timeout=120)
            t_reply = time.perf_counter() - t0
            while metric(port, "kvsvc_remote_written_bytes_total") < want:
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError("writes did not reach Redis in 120 s (dropped?)")
                time.sleep(0.01)  # polling costs CPU the writers need
            t_store = time.perf_counter() - t0
            behind.append(t_store - t_reply)
            t0 = time.perf_counter()
            loaded = cb.retrieve(mb, chunks, timeout=120).loaded_chunks
            t_retrieve = time.perf_counter() - t0
            if loaded != n:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port_b}/metrics").read()
                why = [ln for ln in text.decode().splitlines() if ln.startswith("kvsvc_remote")]
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


def lookups(
    address: str, mapping: object, keys: list[bytes], count: int
) -> tuple[list[float], int]:
    lat, hits = [], 0
    with KVCacheClient(address) as c:
        for _ in range(count):
            t0 = time.perf_counter()
            hits += c.lookup(keys, mapping=mapping)  # type: ignore[arg-type]
            lat.append(time.perf_counter() - t0)
    return lat, hits


def lookup_rows(rs: RedisServer, shm: str, count: int) -> list[list[str]]:
    keys = [b"lk-%d" % i for i in range(16)]
    a, b = node(shm, rs.url), node(shm, rs.url)
    c = node(shm, "off")
    caches = [cache(shm, f"lk{i}", 16) for i in range(3)]
    rows = []
    try:
        with KVCacheClient(a.address) as ca:
            ma = ca.map("bench", [caches[0].rank_region()])
            ca.store(ma, [(k, [i]) for i, k in enumerate(keys)])
            time.sleep(1.0)  # the write-behind reaches Redis
        with KVCacheClient(b.address) as cb, KVCacheClient(c.address) as cc:
            mb = cb.map("bench", [caches[1].rank_region()])
            mc = cc.map("bench", [caches[2].rank_region()])
            cc.store(mc, [(k, [i]) for i, k in enumerate(keys)])
            cases = [("remote tier off, keys local", c.address, mc)]
            cases.append(("remote tier on, keys in Redis only (EXISTS)", b.address, mb))
            for name, address, m in cases:
                lat, hits = lookups(address, m, keys, count)
                rows.append([name, f"{1e3 * pct(lat, 50):.3f}", f"{1e3 * pct(lat, 99):.3f}",
                             f"{hits / count:.1f} of 16"])  # fmt: skip
            cb.retrieve(mb, [(k, [i]) for i, k in enumerate(keys)])
            lat, hits = lookups(b.address, mb, keys, count)
            rows.insert(1, ["remote tier on, keys local", f"{1e3 * pct(lat, 50):.3f}",
                            f"{1e3 * pct(lat, 99):.3f}", f"{hits / count:.1f} of 16"])  # fmt: skip
        # The reference for "one Redis round trip": the same pipelined EXISTS, raw.
        raw = redis.Redis(port=rs.port, socket_timeout=60)
        lat = []
        for _ in range(count):
            t0 = time.perf_counter()
            pipe = raw.pipeline(transaction=False)
            for k in keys:
                pipe.exists(b"bench:" + k)
            pipe.execute()
            lat.append(time.perf_counter() - t0)
        raw.close()
        rows.append(["raw redis-py pipelined EXISTS of 16 keys (one round trip)",
                     f"{1e3 * pct(lat, 50):.3f}", f"{1e3 * pct(lat, 99):.3f}", "-"])  # fmt: skip
    finally:
        for x in caches:
            x.close()
        for s in (a, b, c):
            s.stop()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total-mib", type=int, default=256, help="bytes per round and chunk size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--lookups-only", action="store_true", help="skip the throughput rounds")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvsvc-redis-bench-"))
    shm = tempfile.mkdtemp(prefix="kvsvc-redis-bench-", dir="/dev/shm")
    rs = RedisServer(work / "redis")
    try:
        raw = redis.Redis(port=rs.port, socket_timeout=60)
        rows: list[list[str]] = []
        client_rows: list[list[str]] = []
        for chunk_mib in () if args.lookups_only else (2, 32):
            n = args.total_mib // chunk_mib
            data = bytes(chunk_mib * MiB)
            res: dict[str, list[float]] = {
                "raw set": [],
                "raw get": [],
                "store": [],
                "retrieve": [],
                "behind": [],
                "async set": [],
                "async get": [],
            }
            for rnd in range(args.rounds):  # alternating: raw, tier, raw, tier...
                s, g = raw_round(raw, data, n, f"{chunk_mib}-{rnd}")
                res["raw set"].append(s)
                res["raw get"].append(g)
                s, g = raw_round_async(rs.port, data, n, f"{chunk_mib}-{rnd}")
                res["async set"].append(s)
                res["async get"].append(g)
                s, g = tier_round(rs, shm, chunk_mib, n, f"c{chunk_mib}r{rnd}", res["behind"])
                res["store"].append(s)
                res["retrieve"].append(g)
                rs.cli("flushall")
            gbs = {k: n * chunk_mib * MiB / statistics.median(v) / 1e9 for k, v in res.items()}
            client_rows.append(
                [
                    f"{chunk_mib} MiB x {n}",
                    f"{gbs['raw set']:.2f}",
                    f"{gbs['async set']:.2f}",
                    f"{gbs['raw get']:.2f}",
                    f"{gbs['async get']:.2f}",
                ]
            )
            rows.append(
                [
                    f"{chunk_mib} MiB x {n}",
                    f"{gbs['store']:.2f}",
                    f"{gbs['raw set']:.2f}",
                    f"{gbs['store'] / gbs['raw set']:.2f}",
                    f"{gbs['behind']:.2f}",
                    f"{gbs['retrieve']:.2f}",
                    f"{gbs['raw get']:.2f}",
                    f"{gbs['retrieve'] / gbs['raw get']:.2f}",
                ]
            )
        print(machine_line(machine_info()))
        print(f"\nThroughput, GB/s (median of {args.rounds} alternating rounds):\n")
        print(md_table(["chunks", "Store→Redis", "raw pipelined SET", "ratio", "after the reply",
                        "Retrieve←Redis", "raw pipelined GET", "ratio"], rows))  # fmt: skip
        print("\nThe client for the tier: redis-py pipelines, sync vs asyncio, GB/s:\n")
        print(
            md_table(["chunks", "sync SET", "asyncio SET", "sync GET", "asyncio GET"], client_rows)
        )
        print(f"\nLookup of 16 keys, {args.lookups} sequential calls, ms:\n")
        print(md_table(["case", "p50", "p99", "hits"], lookup_rows(rs, shm, args.lookups)))
        raw.close()
    finally:
        rs.kill()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
