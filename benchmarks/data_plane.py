"""Data-plane throughput: Store and Retrieve through a real `kvsvc serve` over
shared memory, against in-process references moving the same bytes, in one run,
in alternating rounds (so machine noise hits them all alike):

* torch: a plain torch copy between the shm-backed KV tensors (an mmap of the
  file under /dev/shm) and a buffer, with the server's thread count as torch's
  intra-op threads. Two of them: into/out of the same buffer every round (hot:
  it stays in the L3 cache when it fits), and over a cold set, a ring of
  buffers as big as the store (``STORE_BYTES``), one after another, so each
  round's buffer has left the cache as a Store's fresh chunk has (a cache
  server's Store never writes where it wrote last). Beside the cold set's
  reference, kvsvc's Retrieve reads the chunks the Store phase left in the
  store in turn, an equal number of them (its other figure reads the last
  chunk every round, as the hot reference reads its one buffer); its Store
  writes a fresh chunk every round, so its one figure stands beside both;
* preadv: raw ``os.preadv``/``os.pwritev`` of the same byte runs from/to the same
  shm file, split over the server's thread count. The server copies shared
  memory this way (not through mmap, so a client truncating its file cannot
  SIGBUS the server), so this is its ceiling on this machine;
* memcpy: the physical limit, a contiguous torch copy of the same number of
  bytes from one hot buffer to another (no layout: one run, not 64 of 32 KiB a
  chunk), on torch's intra-op threads;
* echo RT: a bare gRPC round trip of kvsvc's transport (a bidi-stream echo of a
  one-chunk Store's message sizes, benchmarks/echo_server.py) in the same
  rounds, so under the same cache and scheduling state as kvsvc's calls. A
  call cannot beat the torch copy plus this round trip; ``kvsvc/(torch + RT)``
  is kvsvc against that floor.

While kvsvc's calls run, the cores its copy threads (``kvsvc-copy-N``) and its
event-loop thread keep busy are read from /proc/PID/task/*/stat: a copy thread
that waits (for the GIL, for work) shows as a share of a core under 1. Copies of
at most ``--inline-copy-bytes`` (4 MiB) run on the loop thread, not the copy threads.

Chunk = blocks of a Llama-3-8B-shaped KV cache in vLLM's layout (32 layers,
8 KV heads, head_dim 128, bf16, 16-token blocks: 2 MiB per block), so a 32 MiB
chunk is one 256-token chunk. Prints a markdown table; the ratio columns are
kvsvc / reference (goal >= 0.95 of the plain copy). A ring of buffers rather
than fresh memory each round: the store's buffer is allocated (and its pages
faulted) once, so a fresh ``torch.empty`` per round would charge the reference
page faults kvsvc never pays.

The cold set a Retrieve reads is the stored rounds still all in the store,
asked of the server (Lookup) rather than assumed: the store's first-fit
allocator does not move chunks, so after one size of chunk another size packs
less tightly than capacity / size (driven directly, a 3 GiB store that held
2 MiB chunks then holds 82, not 95, chunks of 32 MiB), and the rounds counted from
the capacity were no longer all there.

    python -m benchmarks.data_plane [--quick | --smoke] [--threads N] [--clients N ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Sequence

import grpc
import torch

from benchmarks.common import (
    KvsvcServer,
    NullProgress,
    Progress,
    ThreadsBusy,
    bench_interleaved,
    md_table,
)
from benchmarks.control_plane import Subprocess
from benchmarks.echo_server import REPLY_BYTES, REQUEST_BYTES, BidiEcho
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.limits import channel_options
from kvsvc.v1 import kv_cache_service_pb2 as pb

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2  # 2 MiB
HALF_BLOCK_BYTES = BLOCK * HEADS * HEAD_DIM * 2  # one block's K (or V) bytes in one layer
CHUNK_BLOCKS = (1, 16)  # 2 MiB and 32 MiB chunks
BATCHES = (1, 16)
STORE_BYTES = 3 << 30
#: --smoke: 2 MiB chunks, batches of 4, a 128 MiB store (checks that it runs)
SMOKE_CHUNK_BLOCKS, SMOKE_BATCHES, SMOKE_STORE_BYTES = (1,), (4,), 128 << 20

Op = tuple[int, int, memoryview]  # (fd, file offset, buffer slice)


REGIONS = ("memfd", "file")


def cases(
    clients: list[int], regions: Sequence[str] = REGIONS, smoke: bool = False
) -> list[tuple[str, int, int, int]]:
    chunk_blocks, batches = (
        (SMOKE_CHUNK_BLOCKS, SMOKE_BATCHES) if smoke else (CHUNK_BLOCKS, BATCHES)
    )
    return [(r, c, b, n) for r in regions for c in chunk_blocks for b in batches for n in clients]


def run(
    *,
    quick: bool,
    smoke: bool = False,
    threads: int = 2,
    clients: list[int] | None = None,
    regions: Sequence[str] = REGIONS,
    shm_dir: str = "/dev/shm",
    progress: Progress | None = None,
) -> list[dict]:
    """Every case; one row per (op, chunk, batch, clients)."""
    clients = clients or [1, 4]
    progress = progress or NullProgress()
    seconds = 0.1 if smoke else 1.0 if quick else 3.0
    store_bytes = SMOKE_STORE_BYTES if smoke else STORE_BYTES
    torch.set_num_threads(threads)
    rows: list[dict] = []
    echo = Subprocess([sys.executable, "-m", "benchmarks.echo_server", "grpc", "--listen",
                       "127.0.0.1:0", "--reply-bytes", str(REPLY_BYTES)])  # fmt: skip
    try:
        with KvsvcServer(threads=threads, store_bytes=store_bytes, shm_dir=shm_dir) as server:
            for region, chunk_blocks, batch, n_clients in cases(clients, regions, smoke):
                rows.extend(
                    run_case(server.address, shm_dir, region, chunk_blocks, batch, n_clients,
                             seconds, threads, server.pid, store_bytes, echo.address)
                )  # fmt: skip
                for r in rows[-2:]:
                    progress.log(r["line"])
                progress.step(f"data plane {region} {chunk_blocks * 2} MiB x {batch} x {n_clients}")
    finally:
        echo.stop()
    return rows


def table(rows: list[dict]) -> str:
    return md_table(
        ["region", "op", "chunk", "batch", "clients", "kvsvc GB/s", "torch copy GB/s",
         "kvsvc/torch", "cold set", "kvsvc, cold set GB/s", "torch, cold set GB/s",
         "kvsvc/torch, cold set", "preadv GB/s", "kvsvc/preadv", "memcpy GB/s", "kvsvc/memcpy",
         "echo RT µs", "kvsvc/(torch + RT)", "copy threads busy (cores)", "loop thread busy"],
        [(r["region"], r["op"], f"{r['chunk']} MiB", r["batch"], r["clients"], f"{r['kvsvc']:.2f}",
          f"{r['plain']:.2f}", f"{r['kvsvc'] / r['plain']:.2f}",
          f"{r['cold_bytes'] / (1 << 30):.2f} GiB", f"{r['kvsvc_cold']:.2f}",
          f"{r['plain_cold']:.2f}", f"{r['kvsvc_cold'] / r['plain_cold']:.2f}", f"{r['pread']:.2f}",
          f"{r['kvsvc'] / r['pread']:.2f}", f"{r['memcpy']:.2f}", f"{r['kvsvc'] / r['memcpy']:.2f}",
          f"{r['rt_us']:.0f}", f"{r['kvsvc'] / r['floor']:.2f}",
          f"{r['copy_cores']:.2f} of {r['threads']}",
          f"{r['loop_cores']:.2f}") for r in rows],
    )  # fmt: skip


def split_ops(ops: list[Op], parts: int) -> list[list[Op]]:
    """``ops`` cut into ``parts`` groups of about equal bytes (runs split as needed)."""
    total = sum(len(v) for _, _, v in ops)
    share = -(-total // parts)
    groups: list[list[Op]] = [[]]
    room = share
    for fd, off, view in ops:
        while len(view):
            if room == 0:
                groups.append([])
                room = share
            n = min(room, len(view))
            groups[-1].append((fd, off, view[:n]))
            off, view, room = off + n, view[n:], room - n
    return groups


def _pread_all(ops: list[Op]) -> None:
    for fd, off, view in ops:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], off + done)
            if n <= 0:
                raise OSError(f"short read at {off + done}")
            done += n


def _pwrite_all(ops: list[Op]) -> None:
    for fd, off, view in ops:
        done = 0
        while done < len(view):
            n = os.pwritev(fd, [view[done:]], off + done)
            if n <= 0:
                raise OSError(f"short write at {off + done}")
            done += n


def run_case(address: str, shm_dir: str, region: str, chunk_blocks: int, batch: int,
             n_clients: int, seconds: float, threads: int = 2,
             server_pid: int | None = None,
             store_bytes: int = STORE_BYTES, echo: str | None = None) -> list[dict]:  # fmt: skip
    """One case against a server of ``store_bytes``; with ``server_pid``, the cores
    its copy threads and event-loop thread keep busy while kvsvc's calls run
    (from /proc); with ``echo`` (an echo_server's address), the bare round trip
    in the same rounds."""
    blocks = chunk_blocks * batch
    tag = f"bench-{os.getpid()}-{region}-{chunk_blocks}-{batch}-{n_clients}"
    memfd = region == "memfd"

    def cache(name: str) -> SharedKVCache:
        return SharedKVCache(name, num_layers=LAYERS, num_blocks=blocks, block_size=BLOCK,
                             kv_heads=HEADS, head_dim=HEAD_DIM, shm_dir=shm_dir,
                             memfd=memfd)  # fmt: skip

    def describe(client: KVCacheClient, kv: SharedKVCache) -> pb.RankRegion:
        return kv.rank_region(token=client.register_memfd(kv.fd) if memfd else "")

    caches: list[tuple[SharedKVCache, SharedKVCache]] = []
    fds: list[int] = []
    nbytes = blocks * BLOCK_BYTES
    out = []
    stack = contextlib.ExitStack()
    try:
        for c in range(n_clients):
            caches.append((cache(f"{tag}-src{c}"), cache(f"{tag}-dst{c}")))
        for src, _ in caches:
            for layer in src.layers:
                layer.random_()
        clients = [KVCacheClient(address, transfer_timeout=120) for _ in range(n_clients)]
        maps = [(c.map(f"{tag}-{i}", [describe(c, s)]), c.map(f"{tag}-{i}", [describe(c, d)]))
                for i, (c, (s, d)) in enumerate(zip(clients, caches, strict=True))]  # fmt: skip
        ids = [list(range(i * chunk_blocks, (i + 1) * chunk_blocks)) for i in range(batch)]
        counter = iter(range(10**9))

        # One persistent thread per client (threads made per call would each build
        # a new OpenMP team in torch and slow the reference down unfairly).
        pool = concurrent.futures.ThreadPoolExecutor(n_clients)
        # The preadv reference: the server's number of copy threads.
        io_pool = concurrent.futures.ThreadPoolExecutor(threads)

        def each(fn: Callable[[int], object]) -> list:
            if n_clients == 1:
                return [fn(0)]
            return list(pool.map(fn, range(n_clients)))

        stored: list[int] = []  # the rounds kvsvc stored, in order

        def store_all() -> None:
            n = next(counter)
            each(lambda i: clients[i].store(
                maps[i][0], [(b"%d-%d" % (n, j), ids[j]) for j in range(batch)]))  # fmt: skip
            stored.append(n)

        bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n_clients)]
        # The physical limit: a contiguous copy of the same bytes, buffer to buffer.
        flat = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n_clients)]
        # The cold set: per client, as many buffers as the store holds of its
        # rounds (less one, for the keys' share of the capacity), together about
        # the store's capacity, the memory kvsvc's Stores cycle through.
        ring_len = max(1, store_bytes // (nbytes * n_clients) - 1)
        rings = [[torch.empty(nbytes, dtype=torch.uint8) for _ in range(ring_len)]
                 for _ in range(n_clients)]  # fmt: skip
        for b in [*bufs, *flat, *(b for ring in rings for b in ring)]:
            b.fill_(0)  # touch the reference buffers before timing (no page faults in rounds)
        turns = [itertools.count() for _ in range(n_clients)]

        def hot(i: int) -> torch.Tensor:
            return bufs[i]

        def cold(length: int) -> Callable[[int], torch.Tensor]:
            """Client i's next buffer of the first ``length`` of its ring, in turn."""
            return lambda i: rings[i][next(turns[i]) % length]

        def plain(direction: str, buf_of: Callable[[int], torch.Tensor]) -> Callable[[], None]:
            # The fastest plain torch copy of the same bytes: one slice copy per
            # layer and chunk (the bench's block ids are consecutive).
            def one(i: int) -> None:
                src, dst = caches[i]
                buf = buf_of(i)
                pos = 0
                for j in range(batch):
                    lo, hi = ids[j][0], ids[j][-1] + 1
                    for s_layer, d_layer in zip(src.layers, dst.layers, strict=True):
                        n = s_layer.numel() // s_layer.shape[1] * (hi - lo) * 2
                        view = buf[pos : pos + n].view(torch.bfloat16).view(
                            2, hi - lo, BLOCK, HEADS, HEAD_DIM)  # fmt: skip
                        if direction == "store":
                            view.copy_(s_layer[:, lo:hi])
                        else:
                            d_layer[:, lo:hi].copy_(view)
                        pos += n

            return lambda: each(one)

        def memcpy() -> None:
            each(lambda i: flat[i].copy_(bufs[i]))

        refs: dict[str, Callable[[], None]] = {"memcpy": memcpy}
        if echo is not None:
            channel = stack.enter_context(grpc.insecure_channel(echo, options=channel_options()))
            echoes = [
                stack.enter_context(BidiEcho(channel, b"\x01" * REQUEST_BYTES))
                for _ in range(n_clients)
            ]
            refs["rt"] = lambda: each(lambda i: echoes[i]())

        def byte_ops(direction: str) -> list[list[Op]]:
            """The chunk's byte runs in the server's order (per chunk, per layer:
            the K run then the V run), against each client's src (store) or dst
            (retrieve) file, split over the copy threads."""
            ops: list[Op] = []
            for i, (src, dst) in enumerate(caches):
                kv = src if direction == "store" else dst
                fd = os.dup(kv.fd) if memfd else os.open(kv.path, os.O_RDWR | os.O_CLOEXEC)
                fds.append(fd)
                view = memoryview(bufs[i].numpy()).cast("B")
                pos = 0
                for j in range(batch):
                    lo, hi = ids[j][0], ids[j][-1] + 1
                    run_len = (hi - lo) * HALF_BLOCK_BYTES
                    for layer in range(LAYERS):
                        for half in range(2):
                            off = (layer * src.layer_bytes + half * src.layer_bytes // 2
                                   + lo * HALF_BLOCK_BYTES)  # fmt: skip
                            ops.append((fd, off, view[pos : pos + run_len]))
                            pos += run_len
                assert pos == nbytes, (pos, nbytes)
            return split_ops(ops, threads)

        def raw(direction: str) -> Callable[[], None]:
            groups = byte_ops(direction)
            fn = _pread_all if direction == "store" else _pwrite_all

            def go() -> None:
                for f in [io_pool.submit(fn, g) for g in groups]:
                    f.result()

            return go

        total = nbytes * n_clients
        busy = {op: ThreadsBusy(server_pid) if server_pid else None for op in ("store", "retrieve")}

        def phase(op: str, fns: dict[str, Callable[[], None]]) -> dict[str, float]:
            meter = busy[op]
            if meter is None:
                return bench_interleaved(fns, total, seconds)
            meter.start()  # the server's threads work only during kvsvc's calls
            try:
                # both kvsvc targets' calls (and no reference's) make its threads work
                return bench_interleaved(
                    {k: meter.measure(f) if k.startswith("kvsvc") else f for k, f in fns.items()},
                    total, seconds)  # fmt: skip
            finally:
                meter.stop()

        stores = phase("store", {"kvsvc": store_all, "plain": plain("store", hot),
                                 "plain_cold": plain("store", cold(ring_len)),
                                 "pread": raw("store"), **refs})  # fmt: skip
        stores["kvsvc_cold"] = stores["kvsvc"]  # every Store writes a fresh chunk

        # The chunks of the last store are present: "kvsvc" retrieves them
        # repeatedly; "kvsvc_cold" the last rounds still all in the store (the
        # server says which: Lookup), in turn, beside the torch copy out of as
        # many ring buffers.
        def whole(n: int) -> bool:
            keys = [b"%d-%d" % (n, j) for j in range(batch)]
            return all(
                c.lookup(keys, mapping=m[1]) == batch for c, m in zip(clients, maps, strict=True)
            )

        present: list[int] = []
        for n in reversed(stored[-ring_len:]):
            if not whole(n):
                break
            present.insert(0, n)
        if not present:
            raise RuntimeError(f"the last Store's chunks are not in the store ({tag})")
        rounds = itertools.cycle(present)  # oldest first: the longest out of the cache

        def retrieve_all(n: int | None = None) -> None:
            n = stored[-1] if n is None else n
            results = each(lambda i: clients[i].retrieve(
                maps[i][1], [(b"%d-%d" % (n, j), ids[j]) for j in range(batch)]))  # fmt: skip
            assert all(r.loaded_chunks == batch for r in results), results

        retrieves = phase(
            "retrieve",
            {"kvsvc": retrieve_all, "kvsvc_cold": lambda: retrieve_all(next(rounds)),
             "plain": plain("retrieve", hot), "plain_cold": plain("retrieve", cold(len(present))),
             "pread": raw("retrieve"), **refs},
        )  # fmt: skip
        # the blocks kvsvc retrieves are the stored ones, bit for bit (the references
        # wrote dst too: clear it first)
        for _, dst in caches:
            dst.buffer.zero_()
        retrieve_all()
        for src, dst in caches:
            assert torch.equal(src.buffer, dst.buffer), "retrieved bytes differ from stored"
        pool.shutdown()
        io_pool.shutdown()
        for c, (m_src, m_dst) in zip(clients, maps, strict=True):
            c.unmap(m_src)
            c.unmap(m_dst)
            c.close()
        mib = chunk_blocks * BLOCK_BYTES >> 20
        for op, r in (("store", stores), ("retrieve", retrieves)):
            kv, ref, pread = r["kvsvc"], r["plain"], r["pread"]
            # the round trip's µs, and the floor: the torch copy then one round trip
            rt_us = total / r["rt"] / 1e3 if "rt" in r else float("nan")
            floor = 1 / (1 / ref + 1 / r["rt"]) if "rt" in r else float("nan")
            kv_cold, ref_cold = r["kvsvc_cold"], r["plain_cold"]
            cold_bytes = (ring_len if op == "store" else len(present)) * nbytes * n_clients
            meter = busy[op]
            copy_cores, loop_cores = meter.cores() if meter else (float("nan"),) * 2
            out.append(dict(region=region, op=op, chunk=mib, batch=batch, clients=n_clients,
                            kvsvc=kv, plain=ref, pread=pread, threads=threads,
                            memcpy=r["memcpy"], rt_us=rt_us, floor=floor,
                            kvsvc_cold=kv_cold, plain_cold=ref_cold, cold_bytes=cold_bytes,
                            copy_cores=copy_cores, loop_cores=loop_cores,
                            line=f"{region:5} {op:8} {mib:2} MiB x {batch:2} x {n_clients} "
                                 "clients: "
                                 f"kvsvc {kv:6.2f} GB/s  torch {ref:6.2f} GB/s ({kv / ref:.2f})  "
                                 f"cold set {cold_bytes / (1 << 30):.2f} GiB: kvsvc "
                                 f"{kv_cold:6.2f} GB/s  torch {ref_cold:6.2f} GB/s "
                                 f"({kv_cold / ref_cold:.2f})  "
                                 f"preadv {pread:6.2f} GB/s ({kv / pread:.2f})  "
                                 f"memcpy {r['memcpy']:6.2f} GB/s ({kv / r['memcpy']:.2f})  "
                                 f"echo RT {rt_us:5.0f} µs: kvsvc/(torch + RT) {kv / floor:.2f}  "
                                 f"copy threads busy {copy_cores:.2f} of {threads} cores, "
                                 f"loop thread {loop_cores:.2f}"))  # fmt: skip
    finally:
        stack.close()
        for fd in fds:
            os.close(fd)
        for src, dst in caches:
            src.close()
            dst.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter measurements")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument("--threads", type=int, default=2,
                    help="server transfer threads = torch threads")  # fmt: skip
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 4], help="concurrent clients")
    ap.add_argument("--regions", nargs="*", default=list(REGIONS), choices=REGIONS,
                    help="region kinds: sealed memfd (memcpy) and file (preadv)")  # fmt: skip
    ap.add_argument("--shm-dir", default="/dev/shm")
    args = ap.parse_args()
    rows = run(quick=args.quick, smoke=args.smoke, threads=args.threads, clients=args.clients,
               regions=args.regions, shm_dir=args.shm_dir)  # fmt: skip
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
