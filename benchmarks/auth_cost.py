"""What authentication costs: Lookup latency (p50/p99, one closed-loop caller) and
block Store throughput (GB/s) against two `kvsvc serve` processes started alike,
one without authentication and one with a tenant file (every call carries a bearer
token, goes through the interceptor, and is scoped to its tenant). Rounds
alternate between the two so machine noise hits both alike.

    python -m benchmarks.auth_cost [--rounds 20] [--lookups 500] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from pathlib import Path

from benchmarks.common import KvsvcServer, md_table, pct
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache

TOKEN = secrets.token_hex(16)


def measure(rounds: int, lookups: int) -> dict[str, dict[str, float]]:
    shm = tempfile.mkdtemp(prefix="kvsvc-authbench-")
    tenants = Path(shm) / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"bench": {"tokens": [TOKEN], "namespaces": ["*"]}}}))
    servers = {
        "no auth": KvsvcServer(shm_dir=shm, store_bytes="2G"),
        "token auth": KvsvcServer(
            shm_dir=shm, store_bytes="2G", extra_args=["--auth-token-file", str(tenants)]
        ),
    }
    # 16 layers x 256 blocks x 64 KiB per block and layer: a 4 MiB chunk is 4 blocks.
    cache = SharedKVCache(
        "authbench", num_layers=16, num_blocks=256, block_size=16, kv_heads=8, head_dim=128,
        shm_dir=shm,
    )  # fmt: skip
    try:
        clients = {
            "no auth": KVCacheClient(servers["no auth"].address),
            "token auth": KVCacheClient(servers["token auth"].address, token=TOKEN),
        }
        mappings = {name: c.map("bench", [cache.rank_region()]) for name, c in clients.items()}
        lat: dict[str, list[float]] = {name: [] for name in clients}
        rates: dict[str, list[float]] = {name: [] for name in clients}
        keys = [b"k%d" % i for i in range(8)]
        seq = 0
        for c in clients.values():  # warm up
            for _ in range(50):
                c.lookup("bench", keys)
        for _ in range(rounds):
            for name, c in clients.items():
                samples = lat[name]
                for _ in range(lookups):
                    t0 = time.perf_counter()
                    c.lookup("bench", keys)
                    samples.append(time.perf_counter() - t0)
                # 16 chunks of 4 blocks (4 MiB each): 64 MiB per Store call, fresh keys.
                chunks = [(b"s%d" % (seq + i), list(range(4 * (i % 64), 4 * (i % 64) + 4)))
                          for i in range(16)]  # fmt: skip
                seq += 16
                t0 = time.perf_counter()
                r = c.store(mappings[name], chunks)
                rates[name].append(r.stored_bytes / (time.perf_counter() - t0) / 1e9)
        for c in clients.values():
            c.close()
    finally:
        cache.close()
        for s in servers.values():
            s.stop()
    return {
        name: {
            "lookup_p50_us": pct(lat[name], 50) * 1e6,
            "lookup_p99_us": pct(lat[name], 99) * 1e6,
            "store_gbps_median": sorted(rates[name])[len(rates[name]) // 2],
        }
        for name in lat
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lookups", type=int, default=500)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.lookups = 1, 20
    res = measure(args.rounds, args.lookups)
    base, auth = res["no auth"], res["token auth"]
    rows = [
        [name, f"{r['lookup_p50_us']:.0f}", f"{r['lookup_p99_us']:.0f}",
         f"{r['store_gbps_median']:.2f}"]
        for name, r in res.items()
    ]  # fmt: skip
    print(md_table(["server", "Lookup p50 (µs)", "Lookup p99 (µs)", "Store GB/s (median)"], rows))
    print(
        f"\nauth/no-auth: Lookup p50 {auth['lookup_p50_us'] / base['lookup_p50_us'] - 1:+.1%}, "
        f"p99 {auth['lookup_p99_us'] / base['lookup_p99_us'] - 1:+.1%}, "
        f"Store {auth['store_gbps_median'] / base['store_gbps_median'] - 1:+.1%}"
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
