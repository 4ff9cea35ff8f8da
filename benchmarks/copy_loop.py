"""The copy path alone, without gRPC: one chunk of a Llama-3-8B-shaped vLLM KV
cache on a sealed memfd copied into the chunk store (Store) and back (Retrieve)
by kvsvc.server.data.copies' real pieces and tasks on 2 threads, with the native copy loop
and with the Python loop it falls back to, beside one plain torch copy of as
many contiguous bytes (torch's 2 intra-op threads), in alternating rounds.

Besides wall-clock GB/s it reports CPU seconds per GB of this process (all its
threads), which a loaded machine disturbs far less than wall time: on a shared
2-core machine the wall figures of all three move together with the load.

    python -m benchmarks.copy_loop [--rounds 7] [--chunk-blocks 1 16] [--smoke]
        [--also LABEL=PATH ...]

``--also`` measures other builds of the same loop in the same rounds, e.g. a
wheel's (``LABEL=<venv>/.../native/_copyloop.*.so``) beside this checkout's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import md_table
from kvsvc.client import fdpass
from kvsvc.client.kvcache import SharedKVCache, rank_context
from kvsvc.server.data import copies, nativecopy
from kvsvc.server.data.fdbroker import FdBroker
from kvsvc.server.data.regions import Mapping, open_rank
from kvsvc.server.data.store import ChunkStore

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # 2 MiB per block (all layers, K and V)
THREADS = 2


def measure(fn: Callable[[], None], nbytes: int, reps: int) -> tuple[float, float]:
    """(GB/s wall, CPU s per GB) of ``reps`` runs of ``fn``."""
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    c1, t1 = time.process_time(), time.perf_counter()
    gb = nbytes * reps / 1e9
    return gb / (t1 - t0), (c1 - c0) / gb


#: "native, cached": the native loop with non-temporal stores off (where it has them)
KINDS = ("native", "native, cached", "python", "torch")


def kvsvc_copy(
    mapping: Mapping, ids: list[int], buf: copies.ChunkBuffer, pool: concurrent.futures.Executor
) -> Callable[[bool], Callable[[], None]]:
    """One chunk's copy as the server runs it: pieces, tasks, the copy threads."""

    def make(to_store: bool) -> Callable[[], None]:
        def go() -> None:
            pieces = copies.Blocks(mapping, ids, 0).pieces(buf, 0, to_store=to_store)
            todo = copies.tasks(pieces, buf.size, THREADS)
            out = [d for f in [pool.submit(t) for t in todo] for d in f.result()]
            if to_store:
                buf.expected[:] = [d for _, _, d in sorted(out)]

        return go

    return make


def plain_copy(engine: torch.Tensor, chunk: torch.Tensor) -> Callable[[bool], Callable[[], None]]:
    """The reference: one torch copy of as many contiguous bytes (torch's threads)."""

    def make(to_store: bool) -> Callable[[], None]:
        dst, src = (chunk, engine) if to_store else (engine, chunk)

        def go() -> None:
            dst.copy_(src)

        return go

    return make


def run(
    rounds: int, chunk_blocks: list[int], also: dict[str, nativecopy.NativeCopy] | None = None
) -> tuple[list[str], list[tuple]]:
    """(the kinds measured, one row per op and chunk size)."""
    also = also or {}
    kinds = [KINDS[0], *also, *KINDS[1:]]
    torch.set_num_threads(THREADS)
    tmp = tempfile.mkdtemp(prefix="kvsvc-copyloop-")
    broker = FdBroker(os.path.join(tmp, "fd.sock"))
    broker.start()
    blocks = max(chunk_blocks) * 2
    cache = SharedKVCache("bench", num_layers=LAYERS, num_blocks=blocks, block_size=BLOCK,
                          kv_heads=HEADS, head_dim=HEAD_DIM, memfd=True)  # fmt: skip
    for layer in cache.layers:
        layer.view(torch.uint8).fill_(7)
    token = fdpass.send_fd(broker.path, cache.fd)
    rank = open_rank(cache.rank_region(rank_context(), token=token), 0, tmp, broker)
    mapping = Mapping.of("bench", "ns", b"", [rank])
    store = ChunkStore(max(chunk_blocks) * mapping.block_bytes * 2 + (64 << 20))
    pool = concurrent.futures.ThreadPoolExecutor(THREADS)
    native = copies.NATIVE
    src = torch.frombuffer(rank.regions[next(iter(rank.regions))].mm, dtype=torch.uint8)
    rows = []
    try:
        for n in chunk_blocks:
            nbytes = n * mapping.block_bytes
            (chunk,), _ = store.reserve("ns", [(b"k%d" % n, nbytes)], mapping.fingerprint)
            buf = store.buffer(chunk)
            kvsvc = kvsvc_copy(mapping, list(range(n)), buf, pool)
            plain = plain_copy(src[:nbytes], buf.tensor)
            reps = max(2, (256 << 20) // nbytes)
            for op, to_store in (("store", True), ("retrieve", False)):
                got: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
                kvsvc(True)()  # checksums for the retrieves
                builds = [("native", native), *also.items()]
                for r in range(rounds):
                    # The builds compared take turns going first (the first after
                    # the previous round's torch copy ran slower here).
                    for label, lib in builds[r % len(builds) :] + builds[: r % len(builds)]:
                        copies.NATIVE = lib
                        got[label].append(measure(kvsvc(to_store), nbytes, reps))
                    copies.NATIVE = native
                    if native is not None:
                        streaming = native.streaming
                        native.stream(False)
                        got["native, cached"].append(measure(kvsvc(to_store), nbytes, reps))
                        native.stream(streaming)
                    copies.NATIVE = None
                    got["python"].append(measure(kvsvc(to_store), nbytes, reps))
                    copies.NATIVE = native
                    got["torch"].append(measure(plain(to_store), nbytes, reps))
                nan = (float("nan"), float("nan"))
                med = {k: (statistics.median(g for g, _ in v), statistics.median(c for _, c in v))
                       if v else nan for k, v in got.items()}  # fmt: skip
                rows.append((op, f"{nbytes >> 20} MiB", *(
                    f"{med[k][0]:.2f} / {med[k][1]:.3f}" for k in kinds),
                    f"{med['native'][0] / med['torch'][0]:.2f}",
                    f"{med['python'][0] / med['torch'][0]:.2f}",
                    f"{med['torch'][1] / med['native'][1]:.2f}",
                ))  # fmt: skip
    finally:
        copies.NATIVE = native
        pool.shutdown()
        mapping.close()
        cache.close()
        broker.close()
    return kinds, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunk-blocks", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument(
        "--also", nargs="*", default=[], metavar="LABEL=PATH",
        help="another build of the copy loop to measure beside this checkout's",
    )  # fmt: skip
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.chunk_blocks = 1, [1]
    also = {}
    for spec in args.also:
        label, _, path = spec.partition("=")
        also[label] = nativecopy.NativeCopy(Path(path))
        print(f"{label}: {path}")
    print(f"native: {nativecopy.native_path()}; {copies.copy_loop()}")
    print(f"load before: {os.getloadavg()}; native loop: {copies.NATIVE is not None}")
    _, rows = run(args.rounds, args.chunk_blocks, also)
    print(md_table(
        ["op", "chunk", "native GB/s / CPU s/GB", *(f"{k} GB/s / CPU s/GB" for k in also),
         "native, cached stores", "python loop", "torch copy",
         "native/torch (wall)", "python/torch (wall)", "torch CPU / native CPU"], rows,
    ))  # fmt: skip
    print(f"load after: {os.getloadavg()}; medians of {args.rounds} alternating rounds")


if __name__ == "__main__":
    main()
