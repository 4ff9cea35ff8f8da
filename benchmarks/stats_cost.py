"""What `kvsvc stats` costs a server under load: Store latency (p50/p99, one
closed-loop caller storing 4 fresh 32 KiB chunks from mapped blocks per call) with
and without a stats poller beside it, a `kvsvc stats --watch --json` process
asking for the FULL view every ``--poll-ms`` (20 times a second by default: 40x
what a person's --watch asks). The store is filled first with ``--chunks`` small
chunks, so a stats call that walked them would show. Rounds alternate between
the two so machine noise hits both alike; the stats call's own latency is
measured last.

    python -m benchmarks.stats_cost [--rounds 10] [--stores 300] [--chunks 100000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from benchmarks.common import KvsvcServer, machine_info, machine_line, md_table, pct
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache

#: blocks of 32 KiB (4 layers x 8 KiB); one chunk is one block
BLOCKS = 256


def poller(address: str, poll_ms: int) -> subprocess.Popen[bytes]:
    """`kvsvc stats --watch --json` every ``poll_ms``; returns once it has answered."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", "stats", "--target", address, "--watch", "--json",
         "--interval", str(poll_ms / 1000), "--timeout", "60"],  # a loaded host is slow
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    if not proc.stdout.readline():
        proc.wait(10)
        raise RuntimeError(f"kvsvc stats --watch ended before its first reply ({proc.returncode})")
    return proc


def drain_and_stop(proc: subprocess.Popen[bytes]) -> int:
    """Stop the poller; how many replies it printed."""
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    return 1 + out.count(b"\n")


def fill(client: KVCacheClient, chunks: int) -> None:
    """``chunks`` 1 KiB inline chunks in namespaces of 1000."""
    for start in range(0, chunks, 1000):
        n = min(1000, chunks - start)
        items = [(b"fill-%d" % (start + i), b"f" * 1024) for i in range(n)]
        client.put(f"fill-{start // 1000}", items, timeout=60)


def measure(rounds: int, stores: int, chunks: int, poll_ms: int) -> dict[str, object]:
    shm = tempfile.mkdtemp(prefix="kvsvc-statsbench-")
    server = KvsvcServer(shm_dir=shm, store_bytes="2G")  # the fill and every Store fit
    cache = SharedKVCache(
        "statsbench", num_layers=4, num_blocks=BLOCKS, block_size=16, kv_heads=2, head_dim=64,
        shm_dir=shm,
    )  # fmt: skip
    lat: dict[str, list[float]] = {"no poller": [], "stats poller": []}
    polls = 0
    try:
        with KVCacheClient(server.address) as client:
            fill(client, chunks)
            mapping = client.map("bench", [cache.rank_region()], timeout=30)
            seq = 0

            def store_round(samples: list[float]) -> None:
                nonlocal seq
                for _ in range(stores):
                    blocks = [(b"s%d" % (seq + i), [(seq + i) % BLOCKS]) for i in range(4)]
                    seq += 4
                    t0 = time.perf_counter()
                    client.store(mapping, blocks, timeout=30)
                    samples.append(time.perf_counter() - t0)

            store_round([])  # warm up
            for _ in range(rounds):
                store_round(lat["no poller"])
                proc = poller(server.address, poll_ms)
                try:
                    store_round(lat["stats poller"])
                finally:
                    polls += drain_and_stop(proc)
            calls: list[float] = []
            for _ in range(max(20, rounds * 20)):
                t0 = time.perf_counter()
                info = client.server_info(stats=True, timeout=30)
                calls.append(time.perf_counter() - t0)
            held = info.stats.tiers[0].chunks
    finally:
        cache.close()
        server.stop()
    return {
        "store_us": {
            name: {"p50": pct(s, 50) * 1e6, "p99": pct(s, 99) * 1e6, "n": len(s)}
            for name, s in lat.items()
        },
        "stats_call_us": {"p50": pct(calls, 50) * 1e6, "p99": pct(calls, 99) * 1e6},
        "polls": polls,
        "chunks_held": held,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--stores", type=int, default=300, help="Store calls per round")
    parser.add_argument("--chunks", type=int, default=100_000, help="chunks held meanwhile")
    parser.add_argument("--poll-ms", type=int, default=50, help="the poller's interval")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.stores, args.chunks = 1, 20, 1000
    info = machine_info()
    res = measure(args.rounds, args.stores, args.chunks, args.poll_ms)
    store = res["store_us"]
    assert isinstance(store, dict)
    rows = [[name, f"{r['p50']:.0f}", f"{r['p99']:.0f}", r["n"]] for name, r in store.items()]
    print(md_table(["beside the Stores", "Store p50 (µs)", "Store p99 (µs)", "Stores"], rows))
    base, polled = store["no poller"], store["stats poller"]
    call = res["stats_call_us"]
    assert isinstance(call, dict)
    print(
        f"\nwith the poller: Store p50 {polled['p50'] / base['p50'] - 1:+.1%}, "
        f"p99 {polled['p99'] / base['p99'] - 1:+.1%}; {res['polls']} stats replies polled "
        f"(every {args.poll_ms} ms) while {res['chunks_held']} chunks were held; one stats "
        f"call: p50 {call['p50']:.0f} µs, p99 {call['p99']:.0f} µs"
    )
    print(machine_line(info))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
