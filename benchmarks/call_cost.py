"""What one Store or Retrieve costs, besides its bytes: one client calls a real
`kvsvc serve` over the Session stream (sealed memfd, Llama-3-8B-shaped blocks of
2 MiB) in a loop; reports wall time per call and the CPU per call of the server
(all its threads, /proc) and of the calling process (all its threads: gRPC's
included). CPU per call is what a loaded machine disturbs least.

    python -m benchmarks.call_cost [--chunk-blocks 1] [--batch 1] [--calls 400] [--smoke]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time

from benchmarks.common import KvsvcServer, cpu_seconds
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
STORE_BYTES = 2 << 30


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(chunk_blocks: int, batch: int, calls: int) -> list[dict]:
    """One row per direction: µs per call of wall, server CPU and client CPU."""
    shm = tempfile.mkdtemp(prefix="kvsvc-cost-", dir="/dev/shm")
    rows = []
    try:
        blocks = chunk_blocks * batch
        # Retrieves run first: the Stores after them may evict (a full store).
        with KvsvcServer(store_bytes=STORE_BYTES, shm_dir=shm) as server, \
                SharedKVCache("cost", num_layers=LAYERS, num_blocks=blocks, block_size=BLOCK,
                              kv_heads=HEADS, head_dim=HEAD_DIM, shm_dir=shm,
                              memfd=True) as kv, \
                KVCacheClient(server.address, transfer_timeout=120) as client:  # fmt: skip
            for layer in kv.layers:
                layer.random_()
            m = client.map("cost", [kv.rank_region(token=client.register_memfd(kv.fd))])
            ids = [list(range(i * chunk_blocks, (i + 1) * chunk_blocks)) for i in range(batch)]
            keep = [(b"keep-%d" % j, ids[j]) for j in range(batch)]
            client.store(m, keep)
            for i in range(20):  # warm: connections, plans, the first touch
                client.store(m, [(b"warm-%d-%d" % (i, j), ids[j]) for j in range(batch)])
                client.retrieve(m, keep)
            for op in ("retrieve", "store"):
                s0, c0, t0 = cpu_seconds(server.pid), _own_cpu(), time.perf_counter()
                for i in range(calls):
                    if op == "store":
                        client.store(m, [(b"s-%d-%d" % (i, j), ids[j]) for j in range(batch)])
                    else:
                        assert client.retrieve(m, keep).loaded_chunks == batch
                wall = time.perf_counter() - t0
                server_cpu, own = cpu_seconds(server.pid) - s0, _own_cpu() - c0
                rows.append({"op": op, "chunk_mib": chunk_blocks * 2, "batch": batch,
                             "wall_us": wall / calls * 1e6,
                             "server_cpu_us": server_cpu / calls * 1e6,
                             "client_cpu_us": own / calls * 1e6})  # fmt: skip
            client.unmap(m)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-blocks", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.chunk_blocks, args.calls = [1], 10
    for cb in args.chunk_blocks:
        for r in measure(cb, args.batch, args.calls):
            print(f"{r['chunk_mib']:2} MiB x {r['batch']} {r['op']:8}: wall {r['wall_us']:6.0f} µs"
                  f"/call, server CPU {r['server_cpu_us']:6.0f} µs/call, client CPU "
                  f"{r['client_cpu_us']:5.0f} µs/call")  # fmt: skip


if __name__ == "__main__":
    main()
