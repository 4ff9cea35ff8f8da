"""The local disk tier (--disk-dir) beside dd on the same filesystem, in the same run:

1. Store-to-disk: sequential Stores of 32 MiB chunks, one chunk per Store from a
   shm region, with --disk-write through --disk-sync (each reply waits until the
   chunk file is fsynced, renamed and its directory fsynced): MB/s over the chunks.
   Reference: dd writing the same bytes from the same shm file, one 32 MiB file per
   chunk (bs=32M count=1 conv=fsync: the file fsynced, not its directory), both
   through the page cache and with oflag=direct (as kvsvc writes chunks >= 4 MiB).
2. Load-from-disk: a server restarted on that directory (memory empty) Retrieves
   the chunks one per call into another shm region: read, every byte checked
   against the header's CRC-32Cs, copied into the store and into the blocks.
   Reference: dd reading the same number of bytes (its own files, bs=32M, to
   /dev/null), buffered and with iflag=direct. Before each side reads, the
   files' pages are dropped from the page cache (fdatasync, then posix_fadvise
   DONTNEED per file: every side alike).
   Rounds run kvsvc, dd and dd direct (the order flips each round); the figures
   are medians over the rounds of each side's MB/s and of the per-round ratio of
   kvsvc to the faster dd of that round.
3. Warm restart: N small chunks (100k; 256 B each: the header page dominates)
   Stored through a server (write-behind), SIGTERM, then a restart on the
   directory: the index rebuild time the server logs and spawn -> SERVING, with
   the kernel's caches dropped first (when /proc/sys/vm/drop_caches is writable,
   else said) and again warm.

    python -m benchmarks.disk_tier [--dir DIR] [--chunks 8] [--rounds 5]
                                   [--rebuild-chunks 100000] [--smoke]

Prints markdown tables; ``run(size)`` is benchmarks.run's section.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import KvsvcServer, machine_info, machine_line, md_table
from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache

MiB = 1 << 20
LAYERS, BLOCK_BYTES = 4, 2 * 16 * 8 * 128 * 2  # 64 KiB per layer block, 256 KiB per block
#: run size -> (chunk MiB, chunks per round, rounds, rebuild chunks)
SIZES = {"full": (32, 8, 5, 100_000), "quick": (32, 4, 5, 100_000), "smoke": (4, 2, 1, 1000)}
GOAL_RATIO, GOAL_REBUILD_S = 0.8, 5.0
INDEXED_RE = re.compile(r"disk tier: (\d+) chunks .* indexed in ([0-9.]+) s")


def _drop_pages(paths: list[str]) -> None:
    """Each file's pages out of the page cache (clean first: DONTNEED keeps dirty ones)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _drop_caches() -> bool:
    """All of the kernel's clean caches (dentries and inodes too); False if not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _chunk_files(root: Path) -> list[str]:
    return glob.glob(str(root / "??" / "*.kv"))


def _server(shm: str, root: Path, *extra: str, store: str = "1G") -> KvsvcServer:
    return KvsvcServer(store_bytes=store, shm_dir=shm, extra_args=["--disk-dir", str(root), *extra])


def _wait_serving(address: str, limit: float = 120.0) -> None:
    end = time.monotonic() + limit
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            st = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if st == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.01)
    raise RuntimeError(f"{address} not SERVING after {limit} s")


def _cache(shm: str, name: str, blocks: int) -> SharedKVCache:
    return SharedKVCache(name, num_layers=LAYERS, num_blocks=blocks, block_size=16, kv_heads=8,
                         head_dim=128, shm_dir=shm)  # fmt: skip


def _kvsvc_round(shm: str, work: Path, mib: int, n: int, tag: str) -> tuple[float, float]:
    """(store MB/s, load MB/s) of ``n`` chunks of ``mib`` MiB through kvsvc."""
    per = mib * MiB // (BLOCK_BYTES * LAYERS)
    root = work / f"kv-{tag}"
    src, dst = _cache(shm, f"src-{tag}", per * n), _cache(shm, f"dst-{tag}", per * n)
    chunks = [(f"{tag}-{i}".encode(), list(range(i * per, (i + 1) * per))) for i in range(n)]
    try:
        src.buffer.random_(0, 256)
        with _server(shm, root, "--disk-sync") as srv, KVCacheClient(srv.address) as c:
            _wait_serving(srv.address)
            m = c.map("bench", [src.rank_region()])
            t0 = time.perf_counter()
            for chunk in chunks:
                if c.store(m, [chunk], timeout=120).stored_chunks != 1:
                    raise RuntimeError("a Store did not store its chunk")
            store_s = time.perf_counter() - t0
            c.unmap(m)
        files = _chunk_files(root)
        if len(files) != n:
            raise RuntimeError(f"{len(files)} chunk files for {n} chunks")
        _drop_pages(files)
        with _server(shm, root, store=f"{2 * mib + 64}M") as srv, KVCacheClient(srv.address) as c:
            _wait_serving(srv.address)
            m = c.map("bench", [dst.rank_region()])
            t0 = time.perf_counter()
            for chunk in chunks:
                if c.retrieve(m, [chunk], timeout=120).loaded_chunks != 1:
                    raise RuntimeError("a chunk was not loaded back from disk")
            load_s = time.perf_counter() - t0
            c.unmap(m)
        if not src.buffer.equal(dst.buffer):
            raise RuntimeError("the blocks loaded from disk differ from those stored")
    finally:
        src.close()
        dst.close()
        shutil.rmtree(root, ignore_errors=True)
    total = n * mib * MiB / 1e6
    return total / store_s, total / load_s


def _dd_round(
    shm: str, work: Path, mib: int, n: int, tag: str, direct: bool = False
) -> tuple[float, float]:
    """(write MB/s, read MB/s) of dd moving the same bytes on the same filesystem;
    ``direct``: oflag=direct / iflag=direct (as kvsvc writes and reads large chunks)."""
    root = work / f"dd-{tag}"
    root.mkdir()
    src = Path(shm) / f"dd-src-{tag}"
    src.write_bytes(os.urandom(mib * MiB))
    paths = [str(root / f"{i}") for i in range(n)]
    oflag, iflag = (["oflag=direct"], ["iflag=direct"]) if direct else ([], [])
    try:
        t0 = time.perf_counter()
        for path in paths:
            cmd = ["dd", f"if={src}", f"of={path}", f"bs={mib}M", "count=1", "conv=fsync"]
            subprocess.run([*cmd, *oflag, "status=none"], check=True, timeout=300)
        write_s = time.perf_counter() - t0
        _drop_pages(paths)
        t0 = time.perf_counter()
        for path in paths:
            subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={mib}M", *iflag,
                            "status=none"], check=True, timeout=300)  # fmt: skip
        read_s = time.perf_counter() - t0
    finally:
        src.unlink()
        shutil.rmtree(root, ignore_errors=True)
    total = n * mib * MiB / 1e6
    return total / write_s, total / read_s


def throughput(size: str, work: Path, shm: str = "/dev/shm") -> dict[str, Any]:
    mib, n, rounds, _ = SIZES[size]
    rows: list[dict[str, float]] = []
    for r in range(rounds):
        sides = {
            "kvsvc": _kvsvc_round,
            "dd": _dd_round,
            "dd_direct": lambda *a: _dd_round(*a, direct=True),
        }
        order = ["kvsvc", "dd", "dd_direct"]
        order = order if r % 2 == 0 else order[::-1]
        got = {name: sides[name](shm, work, mib, n, f"{os.getpid()}-{r}-{name}") for name in order}
        row = {
            "kvsvc_store": got["kvsvc"][0],
            "dd_write": got["dd"][0],
            "dd_direct_write": got["dd_direct"][0],
            "kvsvc_load": got["kvsvc"][1],
            "dd_read": got["dd"][1],
            "dd_direct_read": got["dd_direct"][1],
        }
        # against the faster dd of the round: buffered or direct
        row["store_ratio"] = row["kvsvc_store"] / max(row["dd_write"], row["dd_direct_write"])
        row["load_ratio"] = row["kvsvc_load"] / max(row["dd_read"], row["dd_direct_read"])
        rows.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
              f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)  # fmt: skip
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {"chunk_mib": mib, "chunks": n, "rounds": rounds, **med}


def rebuild(size: str, work: Path, shm: str = "/dev/shm") -> dict[str, Any]:
    """Index rebuild of ``SIZES[size][3]`` small chunks: (cold, warm) as the server logs it."""
    n = SIZES[size][3]
    root = work / "rebuild"
    out: dict[str, Any] = {"chunks": n}
    try:
        with _server(shm, root, "--metrics-port", "0", store="512M") as srv:
            _wait_serving(srv.address)
            with KVCacheClient(srv.address) as c:
                t0 = time.perf_counter()
                for start in range(0, n, 500):
                    batch = [
                        (b"r-%08d" % i, os.urandom(256)) for i in range(start, min(n, start + 500))
                    ]
                    c.put("rebuild", batch, timeout=60)
                end = time.monotonic() + 600
                while len(_chunk_files(root)) < n:  # the write-behind drains
                    if time.monotonic() > end:
                        raise RuntimeError(f"{len(_chunk_files(root))} of {n} files in 600 s")
                    time.sleep(0.5)
                out["write_s"] = time.perf_counter() - t0
        # smoke: no global cache drop (it slows everything else on the machine)
        for label in ("warm",) if size == "smoke" else ("cold", "warm"):
            dropped = _drop_caches() if label == "cold" else True
            t0 = time.perf_counter()
            with _server(shm, root, store="512M") as srv:
                _wait_serving(srv.address)
                out[f"{label}_serving_s"] = time.perf_counter() - t0
                m = INDEXED_RE.search(srv.log_text())
                if m is None or int(m.group(1)) != n:
                    raise RuntimeError(f"the index line is not {n} chunks: {m and m.group(0)}")
                out[f"{label}_index_s"] = float(m.group(2))
            if not dropped:
                out["cold"] = "not dropped: /proc/sys/vm/drop_caches is not writable"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _fs(work: Path) -> str:
    st = os.statvfs(work)
    dev = subprocess.run(["df", "--output=source,fstype", str(work)], capture_output=True,
                         text=True, timeout=10).stdout.split("\n")[1:2]  # fmt: skip
    where = " ".join(" ".join(dev).split()) or "?"  # "DEVICE FSTYPE"
    return f"{work} on {where} ({st.f_bavail * st.f_frsize >> 30} GiB free)"


def tables(t: dict[str, Any], r: dict[str, Any]) -> str:
    mb = "{:.0f}".format
    lines = [
        f"Chunks of {t['chunk_mib']} MiB, {t['chunks']} per round, median of {t['rounds']} "
        "alternating rounds (MB/s; ratio per round)",
        "",
        md_table(
            ["", "kvsvc", "dd", "dd direct", "kvsvc / faster dd", "goal"],
            [
                (
                    "Store-to-disk (--disk-sync) vs dd conv=fsync [oflag=direct]",
                    mb(t["kvsvc_store"]),
                    mb(t["dd_write"]),
                    mb(t["dd_direct_write"]),
                    f"{t['store_ratio']:.2f}",
                    f">= {GOAL_RATIO}",
                ),
                (
                    "load-from-disk (pages dropped) vs dd read [iflag=direct]",
                    mb(t["kvsvc_load"]),
                    mb(t["dd_read"]),
                    mb(t["dd_direct_read"]),
                    f"{t['load_ratio']:.2f}",
                    f">= {GOAL_RATIO}",
                ),
            ],
        ),
        "",
        f"Warm restart, {r['chunks']} chunks (written through the server in "
        f"{r.get('write_s', float('nan')):.1f} s)",
        "",
        md_table(
            ["caches", "index rebuild (server's log)", "spawn -> SERVING", "goal"],
            [
                (
                    r.get(label, "dropped") if label == "cold" else "warm",
                    f"{r[label + '_index_s']:.2f} s",
                    f"{r[label + '_serving_s']:.2f} s",
                    f"<= {GOAL_REBUILD_S} s",
                )
                for label in ("cold", "warm")
                if label + "_index_s" in r
            ],
        ),
    ]
    return "\n".join(lines)


def goals(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """benchmarks.run's goal rows: (goal, verdict, detail)."""
    t, r = d["throughput"], d["rebuild"]
    rows = [
        (f"disk: {what} >= {GOAL_RATIO} of dd", "met" if t[key] >= GOAL_RATIO else "MISSED",
         f"{t[key]:.2f} ({t['chunk_mib']} MiB chunks, median of {t['rounds']})")
        for what, key in (("Store-to-disk", "store_ratio"), ("load-from-disk", "load_ratio"))
    ]  # fmt: skip
    index_s = r.get("cold_index_s", r["warm_index_s"])
    rows.append((f"disk: index rebuild of 100k chunks <= {GOAL_REBUILD_S} s",
                 "met" if index_s <= GOAL_REBUILD_S and r["chunks"] >= 100_000 else
                 "MISSED" if index_s > GOAL_REBUILD_S else "not measured at this size",
                 f"{index_s:.2f} s for {r['chunks']} chunks"))  # fmt: skip
    return rows


def run(size: str, work_dir: str | None = None) -> dict[str, Any]:
    """benchmarks.run's section: both measures, printed; figures returned."""
    work = Path(tempfile.mkdtemp(prefix="kvsvc-disk-bench-", dir=work_dir))
    try:
        print(f"disk tier: {_fs(work)}", file=sys.stderr)
        t, r = throughput(size, work), rebuild(size, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(tables(t, r))
    return {"throughput": t, "rebuild": r, "filesystem": _fs(work.parent)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the files go (default: the temp dir)")
    ap.add_argument("--chunks", type=int, help="chunks per round (8)")
    ap.add_argument("--rounds", type=int, help="alternating rounds (5)")
    ap.add_argument("--rebuild-chunks", type=int, help="chunks of the restart (100000)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = ap.parse_args()
    size = "smoke" if args.smoke else "full"
    mib, n, rounds, rebuild_n = SIZES[size]
    SIZES[size] = (mib, args.chunks or n, args.rounds or rounds, args.rebuild_chunks or rebuild_n)
    print(f"machine: {machine_line(machine_info())}", file=sys.stderr)
    run(size, args.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
