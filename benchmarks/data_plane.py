"""Data-plane throughput: Store and Retrieve through a real `kvsvc serve` over
shared memory, against a plain in-process torch copy of the same bytes with the
same thread count, in one run.

Chunk = blocks of a Llama-3-8B-shaped KV cache in vLLM's layout (32 layers,
8 KV heads, head_dim 128, bf16, 16-token blocks: 2 MiB per block), so a 32 MiB
chunk is one 256-token chunk. Prints a markdown table; the ratio column is
kvsvc / plain copy (goal >= 0.95).

    python -m benchmarks.data_plane [--quick] [--threads N] [--clients N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvsvc.client import KVCacheClient
from kvsvc.kvcache import SharedKVCache

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2  # 2 MiB


def start_server(threads: int, store_bytes: int, shm_dir: str) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", "serve", "--listen", "127.0.0.1:0",
         "--transfer-threads", str(threads), "--store-bytes", str(store_bytes),
         "--shm-dir", shm_dir],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(r"serving on (127\.0\.0\.1:\d+)", Path(log.name).read_text())
        if m:
            return proc, m.group(1)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(Path(log.name).read_text())


def bench(fn, nbytes: int, seconds: float) -> float:  # noqa: ANN001
    """GB/s of ``fn`` moving ``nbytes`` per call: median over repeated calls."""
    fn()  # warm up (page faults, first-touch)
    rates, t_end = [], time.monotonic() + seconds
    while time.monotonic() < t_end or len(rates) < 3:
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="shorter measurements")
    ap.add_argument("--threads", type=int, default=2, help="server transfer threads = torch threads")
    ap.add_argument("--clients", type=int, nargs="*", default=[1], help="concurrent clients")
    ap.add_argument("--shm-dir", default="/dev/shm")
    args = ap.parse_args()
    seconds = 1.0 if args.quick else 3.0
    torch.set_num_threads(args.threads)
    rows = []
    proc, address = start_server(args.threads, 3 << 30, args.shm_dir)
    try:
        for chunk_blocks in (1, 16):  # 2 MiB and 32 MiB chunks
            for batch in (1, 16):
                for n_clients in args.clients:
                    rows.extend(run_case(address, args.shm_dir, chunk_blocks, batch, n_clients,
                                         seconds))
                    print(rows[-2]["line"], flush=True)
                    print(rows[-1]["line"], flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    print("\n| op | chunk | batch | clients | kvsvc GB/s | torch copy GB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['chunk']} MiB | {r['batch']} | {r['clients']} | "
              f"{r['kvsvc']:.2f} | {r['plain']:.2f} | {r['kvsvc'] / r['plain']:.2f} |")


def run_case(address: str, shm_dir: str, chunk_blocks: int, batch: int, n_clients: int,
             seconds: float) -> list[dict]:
    blocks = chunk_blocks * batch
    tag = f"bench-{os.getpid()}-{chunk_blocks}-{batch}"
    caches = [
        (SharedKVCache(f"{tag}-src{c}", num_layers=LAYERS, num_blocks=blocks, block_size=BLOCK,
                       kv_heads=HEADS, head_dim=HEAD_DIM, shm_dir=shm_dir),
         SharedKVCache(f"{tag}-dst{c}", num_layers=LAYERS, num_blocks=blocks, block_size=BLOCK,
                       kv_heads=HEADS, head_dim=HEAD_DIM, shm_dir=shm_dir))
        for c in range(n_clients)
    ]
    nbytes = blocks * BLOCK_BYTES
    out = []
    try:
        for src, dst in caches:
            for layer in src.layers:
                layer.random_()
        clients = [KVCacheClient(address, transfer_timeout=120) for _ in range(n_clients)]
        maps = [(c.map(f"{tag}-{i}", [s.rank_region()]), c.map(f"{tag}-{i}", [d.rank_region()]))
                for i, (c, (s, d)) in enumerate(zip(clients, caches, strict=True))]
        ids = [list(range(i * chunk_blocks, (i + 1) * chunk_blocks)) for i in range(batch)]
        counter = iter(range(10**9))

        # One persistent thread per client (threads made per call would each build
        # a new OpenMP team in torch and slow the reference down unfairly).
        pool = concurrent.futures.ThreadPoolExecutor(n_clients)

        def each(fn) -> list:  # noqa: ANN001
            if n_clients == 1:
                return [fn(0)]
            return list(pool.map(fn, range(n_clients)))

        def store_all() -> None:
            n = next(counter)
            each(lambda i: clients[i].store(
                maps[i][0], [(b"%d-%d" % (n, j), ids[j]) for j in range(batch)]))

        kv_store = bench(store_all, nbytes * n_clients, seconds)
        # the chunks of the last store are present: retrieve them repeatedly
        last = next(counter) - 1
        keys = [b"%d-%d" % (last, j) for j in range(batch)]

        def retrieve_all() -> None:
            results = each(lambda i: clients[i].retrieve(
                maps[i][1], [(keys[j], ids[j]) for j in range(batch)]))
            assert all(r.loaded_chunks == batch for r in results), results

        kv_retrieve = bench(retrieve_all, nbytes * n_clients, seconds)
        # reference: the same bytes gathered/scattered by torch in this process
        bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n_clients)]

        def plain(direction: str) -> None:
            # The fastest plain torch copy of the same bytes: one slice copy per
            # layer and chunk (the bench's block ids are consecutive).
            def one(i: int) -> None:
                src, dst = caches[i]
                pos = 0
                for j in range(batch):
                    lo, hi = ids[j][0], ids[j][-1] + 1
                    for s_layer, d_layer in zip(src.layers, dst.layers, strict=True):
                        n = s_layer.numel() // s_layer.shape[1] * (hi - lo) * 2
                        view = bufs[i][pos : pos + n].view(torch.bfloat16).view(
                            2, hi - lo, BLOCK, HEADS, HEAD_DIM)
                        if direction == "store":
                            view.copy_(s_layer[:, lo:hi])
                        else:
                            d_layer[:, lo:hi].copy_(view)
                        pos += n
            each(one)

        ref_store = bench(lambda: plain("store"), nbytes * n_clients, seconds)
        ref_retrieve = bench(lambda: plain("retrieve"), nbytes * n_clients, seconds)
        pool.shutdown()
        for c, (m_src, m_dst) in zip(clients, maps, strict=True):
            c.unmap(m_src)
            c.unmap(m_dst)
            c.close()
        mib = chunk_blocks * BLOCK_BYTES >> 20
        for op, kv, ref in (("store", kv_store, ref_store), ("retrieve", kv_retrieve, ref_retrieve)):
            out.append(dict(op=op, chunk=mib, batch=batch, clients=n_clients, kvsvc=kv, plain=ref,
                            line=f"{op:8} {mib:2} MiB x {batch:2} x {n_clients} clients: "
                                 f"kvsvc {kv:6.2f} GB/s  torch {ref:6.2f} GB/s  "
                                 f"ratio {kv / ref:.2f}"))
    finally:
        for src, dst in caches:
            src.close()
            dst.close()
    return out


if __name__ == "__main__":
    main()
