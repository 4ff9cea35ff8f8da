"""The Mooncake tier (--mooncake-master) against Mooncake's raw client, in the
same run on the same ``mooncake_master``, inside a network namespace the
benchmark makes (Mooncake does not use loopback: tests/mooncake_servers.py).
The benchmark re-runs itself under ``unshare -n`` (root) for that.

Two tiers in this process, each with its own store and Mooncake client (node A
on 10.250.0.1, node B on 10.250.0.2), and a raw client beside them:

1. Store->tier: A's store holds the round's chunks (committed as a Store
   commits them); timed from handing them to A's write-behind until A counts
   every one written (each value put from the store's registered memory with its
   header, into A's segment). Reference: the raw client's ``batch_put_from`` of
   the same bytes from registered memory, the same number of values per call
   (the writer's batch), into its own segment.
2. Retrieve<-tier: B loads the keys (nothing in its memory): sizes from the
   master, the values straight into reserved chunks, every segment's CRC-32C
   checked, committed. Reference: the raw client's ``batch_get_into`` of the same
   values (from A's segment, as B's are) into registered memory, one call.
3. Lookup p50 of 16 keys (in Mooncake, not in memory) through a kvsvc server
   without the tier and one with it (keys it has not seen: one
   ``batch_is_exist``; keys it read: no call), beside the raw client's
   ``batch_is_exist`` of the same keys.

Ratios are tier / raw per round, the median over rounds with the spread.

    python -m benchmarks.mooncake_tier [--total-mib 128] [--rounds 3] [--lookups 300]
                                       [--sizes 2,32] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, machine_info, machine_line, md_table, pct
from benchmarks.kv_reuse import cross_node
from kvsvc.client import KVCacheClient
from kvsvc.server.config import ServerConfig
from kvsvc.server.data.copies import checksum, segments
from kvsvc.server.data.store import INLINE_LAYOUT, Chunk, ChunkStore
from kvsvc.server.tiers.mooncake import MooncakeTier
from kvsvc.server.tiers.mooncake.values import key_name
from kvsvc.server.tiers.mooncake.writer import BATCH

sys.path.insert(0, str(REPO / "tests"))
from mooncake_servers import HOST_A, HOST_B, NETNS_SETUP, Master, mooncake_missing
from support import ServerThread

MiB = 1 << 20
NS = "bench"
INSIDE = "KVSVC_MOONCAKE_BENCH_NETNS"
#: the goals of issue 44, printed beside the figures
READ_GOAL, WRITE_GOAL = 0.9, 0.8


def tier(master: Master, host: str, store: ChunkStore, loop: asyncio.AbstractEventLoop) -> Any:
    settings = master.settings(
        host,
        mooncake_segment_bytes=store.capacity // 2 + 64 * MiB,
        mooncake_timeout=30.0,
        mooncake_queue_bytes=store.capacity,
    )
    config = ServerConfig.from_settings(listen="127.0.0.1:0", **settings)
    t = MooncakeTier(config, store, loop)
    t.start(lambda: None)
    return t


async def ready(t: Any) -> None:
    end = time.monotonic() + 30
    while t.connection.client is None:
        assert time.monotonic() < end, "the tier did not set up in 30 s"
        await asyncio.sleep(0.01)


def fill(store: ChunkStore, keys: list[bytes], size: int) -> list[Chunk]:
    """Chunks committed in ``store`` as a Store commits them (random bytes)."""
    chunks, _ = store.reserve(NS, [(k, size) for k in keys], INLINE_LAYOUT)
    for c in chunks:
        view = store.buffer(c).view
        view[:] = os.urandom(size)
        store.commit(c, [checksum(view[lo:hi]) for lo, hi in segments(size)])
    return chunks


async def written(t: Any, n: int) -> None:
    end = time.monotonic() + 120
    while t.gate.writes < n:
        assert time.monotonic() < end, "the write-behind did not finish in 120 s"
        assert not t.gate.skipped, f"writes skipped: {t.gate.skipped}"
        await asyncio.sleep(0.001)


async def run(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    tmp = Path(tempfile.mkdtemp(prefix="kvsvc-mooncake-bench-"))
    master = Master(tmp / "master")
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    total = args.total_mib * MiB
    cap = total + 64 * MiB
    # the write-behind queues at most a quarter of the store: the whole round fits
    a_store, b_store = ChunkStore(4 * cap), ChunkStore(4 * cap)
    a, b = tier(master, HOST_A, a_store, loop), tier(master, HOST_B, b_store, loop)
    try:
        await ready(a)
        await ready(b)
        import mooncake.store

        raw = mooncake.store.MooncakeDistributedStore()
        s = master.settings(HOST_A)
        rc = raw.setup(
            HOST_A, s["mooncake_metadata"], cap + 64 * MiB, 16 * MiB, "tcp", "",
            s["mooncake_master"],
        )  # fmt: skip
        assert rc == 0, f"raw setup: {rc}"
        buf = mmap.mmap(-1, cap)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert raw.register_buffer(base, cap) == 0
        own = mooncake.store.ReplicateConfig()
        own.preferred_segment = raw.get_hostname()
        rows: dict[int, dict[str, list[float]]] = {}
        for rnd in range(args.rounds):
            for size in sizes:
                n = max(1, total // size)
                keys = [b"r%d-%d-%d" % (rnd, size, i) for i in range(n)]
                r = rows.setdefault(size, {"w": [], "rw": [], "r": [], "rr": []})
                chunks = fill(a_store, keys, size)
                before = a.gate.writes
                t0 = time.perf_counter()
                for c in chunks:
                    a.write_behind(c)
                await written(a, before + n)
                r["w"].append(n * size / (time.perf_counter() - t0) / 1e6)
                names = [key_name(a.prefix, NS, INLINE_LAYOUT, k) for k in keys]
                raw_names = [f"raw/{x}" for x in names]

                def raw_put(names: list[str] = raw_names, n: int = n, size: int = size) -> None:
                    for lo in range(0, n, BATCH):
                        part = names[lo : lo + BATCH]
                        codes = raw.batch_put_from(
                            part, [base + i * size for i in range(len(part))],
                            [size] * len(part), own,
                        )  # fmt: skip
                        assert all(c == 0 for c in codes), codes

                t0 = time.perf_counter()
                await loop.run_in_executor(None, raw_put)
                r["rw"].append(n * size / (time.perf_counter() - t0) / 1e6)

                t0 = time.perf_counter()
                await b.load(NS, INLINE_LAYOUT, keys, 120.0, lambda: None)
                r["r"].append(n * size / (time.perf_counter() - t0) / 1e6)
                assert b_store.lookup(NS, keys, INLINE_LAYOUT) == n, "B did not load every chunk"
                for k, c in zip(keys, chunks, strict=True):
                    got = b_store.get(NS, k, INLINE_LAYOUT)
                    assert got is not None and got.digests == c.digests
                totals = [size + (raw.get_size(x) - size) for x in names]

                def raw_get(names: list[str] = names, totals: list[int] = totals) -> None:
                    ptrs, at = [], base
                    for t in totals:
                        ptrs.append(at)
                        at += t
                    got = raw.batch_get_into(names, ptrs, totals)
                    assert list(got) == totals, got

                t0 = time.perf_counter()
                await loop.run_in_executor(None, raw_get)
                r["rr"].append(n * size / (time.perf_counter() - t0) / 1e6)
                # the next round starts from empty stores and a pool with room
                a_store.drop_namespace(NS)
                b_store.drop_namespace(NS)
                raw.batch_remove(raw_names, True)
                raw.batch_remove(names, True)
                a.known.forget_namespace(NS)
        lookups = await lookup_figures(args.lookups, master, tmp, a, raw)
        report(args, rows, lookups)
    finally:
        for t in (a, b):
            t.close(5.0)
        master.kill()
        shutil.rmtree(tmp, ignore_errors=True)


async def lookup_figures(
    count: int, master: Master, tmp: Path, a: Any, raw: Any
) -> dict[str, float]:
    """p50 ms of a Lookup of 16 keys (A wrote them to Mooncake) through a server
    without the tier, with it (keys it has not seen: one batch_is_exist; keys it
    read: no call), beside the raw client's batch_is_exist of the same keys."""
    keys = [b"l-%d" % i for i in range(16)]
    fill(a.store, keys, 4096)
    for c in [a.store.get(NS, k, INLINE_LAYOUT) for k in keys]:
        a.write_behind(c)
    await written(a, a.gate.writes + 16)
    names = [key_name(a.prefix, NS, INLINE_LAYOUT, k) for k in keys]
    servers = []
    for name, more in (("off", {}), ("on", master.settings(HOST_B))):
        shm = tmp / f"shm-{name}"
        shm.mkdir()
        config = ServerConfig.from_settings(
            listen="127.0.0.1:0", store_bytes=64 * MiB, shm_dir=str(shm), **more
        )
        servers.append(ServerThread(config))
    off, on = servers
    out: dict[str, float] = {}
    try:
        with KVCacheClient(off.address) as c_off, KVCacheClient(on.address) as c_on:

            def p50(c: KVCacheClient, hits: int) -> float:
                took = []
                for _ in range(count):
                    t0 = time.perf_counter()
                    assert c.lookup(keys, namespace=NS) == hits
                    took.append(time.perf_counter() - t0)
                return pct(took, 50) * 1e3

            out["off"] = p50(c_off, 0)
            out["asked"] = p50(c_on, 16)
            for k in keys:  # read once: the tier knows Mooncake holds them
                c_on.get(NS, k)

            async def forget() -> None:
                on.server.servicer.store.drop_namespace(NS)

            on.run(forget())
            out["known"] = p50(c_on, 16)
        took = []
        for _ in range(count):
            t0 = time.perf_counter()
            assert list(raw.batch_is_exist(names)) == [1] * 16
            took.append(time.perf_counter() - t0)
        out["raw"] = pct(took, 50) * 1e3
    finally:
        for st in servers:
            st.stop()
    return out


def ratio(tier: list[float], raw: list[float]) -> str:
    rs = [t / r for t, r in zip(tier, raw, strict=True)]
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"


def report(
    args: argparse.Namespace, rows: dict[int, dict[str, list[float]]], lk: dict[str, float]
) -> None:
    print(machine_line(machine_info()))
    print(f"{args.rounds} round(s) of {args.total_mib} MiB per size; MB/s medians\n")
    table = []
    for size, r in rows.items():
        table.append([
            f"{size // MiB} MiB x {max(1, args.total_mib * MiB // size)}",
            f"{statistics.median(r['w']):.0f}", f"{statistics.median(r['rw']):.0f}",
            ratio(r["w"], r["rw"]), f">= {WRITE_GOAL}",
            f"{statistics.median(r['r']):.0f}", f"{statistics.median(r['rr']):.0f}",
            ratio(r["r"], r["rr"]), f">= {READ_GOAL}",
        ])  # fmt: skip
    print(md_table(
        ["chunks", "Store->tier MB/s", "raw batch_put_from MB/s", "write ratio", "goal",
         "Retrieve<-tier MB/s", "raw batch_get_into MB/s", "read ratio", "goal"],
        table,
    ))  # fmt: skip
    print()
    print(md_table(
        ["Lookup of 16 keys", "p50 ms", "on minus off, ms"],
        [["tier off", f"{lk['off']:.3f}", ""],
         ["tier on, keys it has not seen (one batch_is_exist)", f"{lk['asked']:.3f}",
          f"{lk['asked'] - lk['off']:+.3f}"],
         ["tier on, keys it read (no call)", f"{lk['known']:.3f}",
          f"{lk['known'] - lk['off']:+.3f}"],
         ["raw batch_is_exist of the 16 keys", f"{lk['raw']:.3f}", ""]],
    ))  # fmt: skip
    size = max(rows)
    read_bytes_per_s = statistics.median(rows[size]["r"]) * 1e6
    print()
    print(cross_node(
        "Mooncake", read_bytes_per_s,
        f"Retrieve<-tier of {size // MiB} MiB chunks above (one host: a veth pair, not a NIC)",
    ))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total-mib", type=int, default=128, help="MiB per round and size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lookups", type=int, default=300)
    p.add_argument("--sizes", default="2,32", help="chunk sizes in MiB")
    p.add_argument("--smoke", action="store_true", help="tiny: 64 MiB, one round, 20 lookups")
    args = p.parse_args()
    if args.smoke:
        args.total_mib, args.rounds, args.lookups = 64, 1, 20
    if os.environ.get(INSIDE):
        asyncio.run(run(args))
        return 0
    why = mooncake_missing()
    if why is not None:
        print(f"mooncake_tier: {why}", file=sys.stderr)
        return 1
    # Mooncake ignores loopback: the run goes on in a network namespace of its own.
    return subprocess.call(
        ["unshare", "-n", "sh", "-c", NETNS_SETUP + 'exec "$@"', "netns",
         sys.executable, "-m", "benchmarks.mooncake_tier", *sys.argv[1:]],
        env={**os.environ, INSIDE: "1", "GLOG_minloglevel": "2"},
        cwd=REPO,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
