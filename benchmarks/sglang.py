"""kvsvc as SGLang's HiCache storage, measured through SGLang's own controller code:
128 pages (Llama-3-8B-shaped: 32 layers, 8 KV heads, head dim 128, page 64 tokens,
bf16: 8 MiB a page, 1 GiB a batch) written and read by ``_page_set_zero_copy`` /
``_page_get_zero_copy`` (kvsvc's batch_set_v1 / batch_get_v1) beside SGLang's own
HiCacheFile backend on the same tmpfs (``_generic_page_set`` / ``_generic_page_get``:
HiCacheFile has no v1 calls) and a plain copy of the same bytes (torch ``copy_``);
then ``batch_exists`` of 128 keys, answered by the presence index, beside a session
Lookup of the same keys. Goals (issues 31, 41): kvsvc >= 2x HiCacheFile, >= 0.8x the
copy; batch_exists p50 <= the Lookup's. The copy runs in every round beside the
batches it is compared with, and the ratios are the medians of each round's own
ratio, so that a machine whose load changes between rounds compares like with like.

Needs SGLang (``make sglang`` makes .venv-sglang)::

    .venv-sglang/bin/python -m benchmarks.sglang [--smoke] [--rounds 5]

``benchmarks.run`` runs it when SGLang imports in its venv, else prints why not.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FULL = {"layers": 32, "heads": 8, "head_dim": 128, "page": 64, "pages": 128}
SMOKE = {"layers": 2, "heads": 2, "head_dim": 64, "page": 16, "pages": 16}


def unavailable() -> str | None:
    """Why this section cannot run in this venv, or None."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return "SGLang is not importable in this venv (make sglang runs it in .venv-sglang)"
    return None


def _setup_imports() -> None:
    sys.path[:0] = [str(REPO / "tests" / "e2e" / "sglang"), str(REPO / "tests")]
    from cpu_imports import absent_torchvision

    absent_torchvision()


def _controller(backend: Any, pool: Any) -> Any:
    """SGLang's HiCacheController with its own page methods, __init__ skipped (it
    needs a device pool and torch.distributed), as tests/e2e/sglang does."""
    from sglang.srt.managers import cache_controller as cc

    c = cc.HiCacheController.__new__(cc.HiCacheController)
    c.storage_backend = backend
    c.mem_pool_host = c.storage_host_pool = pool
    c.page_size = pool.page_size
    return c


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def measure(size: dict[str, int], rounds: int, shm: str = "/dev/shm") -> dict[str, Any]:
    _setup_imports()
    import torch
    from sglang.srt.managers import cache_controller as cc
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang_pools import fill_pages, indices, mha_pool

    from benchmarks.common import KvsvcServer

    n, page = size["pages"], size["page"]
    # One host pool: the batch is written from pages [0, n) and read into [n, 2n).
    pool = mha_pool(
        "page_first",
        layers=size["layers"],
        heads=size["heads"],
        head_dim=size["head_dim"],
        page=page,
        device_tokens=n * page,
        ratio=2.0,
    )
    fill_pages(pool, list(range(n)), seed=1)
    src, dst = indices(pool, list(range(n))), indices(pool, list(range(n, 2 * n)))
    nbytes = n * 2 * size["layers"] * page * size["heads"] * size["head_dim"] * 2
    work = Path(tempfile.mkdtemp(prefix="kvsvc-bench-sglang-", dir=shm))
    server = KvsvcServer(store_bytes=int(nbytes * 1.3) + (64 << 20), shm_dir=shm)
    results: dict[str, Any] = {"page_bytes": nbytes // n, "pages": n}
    try:
        extra = {
            "backend_name": "kvsvc",
            "module_path": "kvsvc.integrations.sglang",
            "class_name": "KvsvcHiCacheStorage",
            "interface_v1": 1,
            "target": server.address,
        }
        cfg = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name="bench/llama-3-8b-shaped",
            extra_config=extra,
        )
        kv = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        kv.register_mem_pool_host(pool)
        hf = HiCacheFile(
            dataclasses.replace(cfg, extra_config={"file_storage_path": str(work / "hf")})
        )
        hf.register_mem_pool_host(pool)
        ck, cf = _controller(kv, pool), _controller(hf, pool)
        op = cc.PrefetchOperation("bench", [])
        a = torch.empty(nbytes, dtype=torch.uint8)
        b = torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        b.fill_(2)
        names = ("copy", "kv_set", "kv_get", "hf_set", "hf_get")
        rows: dict[str, list[float]] = {k: [] for k in names}
        for r in range(rounds):
            keys = cc.get_storage_hash_str(list(range(r * 10**6, r * 10**6 + n * page)), None, page)
            for name, fn in (
                ("copy", lambda: b.copy_(a) is b),
                ("kv_set", lambda k=keys: ck._page_set_zero_copy(k, src)),
                ("kv_get", lambda k=keys: ck._page_get_zero_copy(op, k, dst) == n),
                ("hf_set", lambda k=keys: cf._generic_page_set(k, src)),
                ("hf_get", lambda k=keys: cf._generic_page_get(op, k, dst) == n),
            ):
                t0 = time.perf_counter()
                ok = fn()
                rows[name].append(time.perf_counter() - t0)
                if not ok:
                    raise RuntimeError(f"{name} failed in round {r}")
            bits = pool.kv_buffer.view(torch.int16)  # bytes, not values (NaN != NaN)
            if not torch.equal(bits[:, : n * page], bits[:, n * page : 2 * n * page]):
                raise RuntimeError("the pages read back differ from those written")
            hf.clear()  # its files, so that tmpfs holds one batch at a time
        for name, secs in rows.items():
            results[name + "_gbps"] = _gbps(nbytes, secs)
        results["memcpy_gbps"] = results.pop("copy_gbps")
        for name in ("kv_set", "kv_get"):  # each round's copy time over its batch's
            ratios = [c / t for c, t in zip(rows["copy"], rows[name], strict=True)]
            results[name + "_ratio"] = statistics.median(ratios)
        results.update(_exists(kv, keys, rounds * 200))
        kv.close()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return results


def _exists(kv: Any, keys: list[str], calls: int) -> dict[str, float]:
    """batch_exists of 128 keys (presence index) vs a session Lookup of the same keys."""
    client = kv.link.get()
    deadline = time.monotonic() + 10
    while kv.index is None or not kv.index.fresh:
        kv.batch_exists(keys)
        if time.monotonic() > deadline:
            raise RuntimeError("the presence index did not become fresh in 10 s")
        time.sleep(0.01)
    ks = [kv.key(k) for k in keys[:128]]
    local, rpc = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        hits = kv.batch_exists(keys[:128])
        local.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        n = client.lookup(ks, namespace=kv.namespace, timeout=5.0)
        rpc.append(time.perf_counter() - t0)
        if hits != n:
            raise RuntimeError(f"batch_exists said {hits}, Lookup {n}")
    return {
        "exists_p50_us": statistics.median(local) * 1e6,
        "lookup_p50_us": statistics.median(rpc) * 1e6,
        "exists_local": kv.counters.get("exists_local", 0),
    }


def table(r: dict[str, Any]) -> str:
    mib = r["page_bytes"] / (1 << 20)
    lines = [
        f"{r['pages']} pages of {mib:.2f} MiB (median of rounds):",
        "",
        "| path | write GB/s | read GB/s |",
        "| --- | ---: | ---: |",
        f"| kvsvc (batch_set_v1 / batch_get_v1) | {r['kv_set_gbps']:.2f}"
        f" | {r['kv_get_gbps']:.2f} |",
        f"| SGLang HiCacheFile, same tmpfs | {r['hf_set_gbps']:.2f} | {r['hf_get_gbps']:.2f} |",
        f"| torch copy_ of the same bytes | {r['memcpy_gbps']:.2f} | {r['memcpy_gbps']:.2f} |",
        "",
        f"kvsvc / copy, median of each round's ratio: write {r['kv_set_ratio']:.2f}, read "
        f"{r['kv_get_ratio']:.2f} (goal >= 0.8)",
        "",
        f"batch_exists of 128 keys p50: {r['exists_p50_us']:.1f} us (presence index); "
        f"session Lookup p50: {r['lookup_p50_us']:.1f} us",
    ]
    return "\n".join(lines)


def goals(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """benchmarks.run's goal rows: (goal, verdict, detail)."""
    kv = min(r["kv_set_gbps"], r["kv_get_gbps"])
    hf = min(r["hf_set_gbps"], r["hf_get_gbps"])
    ratio = min(r["kv_set_ratio"], r["kv_get_ratio"])
    ex, lk = r["exists_p50_us"], r["lookup_p50_us"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    return [
        ("sglang: v1 read/write >= 2x HiCacheFile", verdict(kv >= 2 * hf),
         f"{kv:.2f} vs {hf:.2f} GB/s (slower direction of each)"),
        ("sglang: v1 read/write >= 0.8x a copy", verdict(ratio >= 0.8),
         f"{ratio:.2f} of the copy in the same rounds (slower direction)"),
        ("sglang: batch_exists(128) p50 <= session Lookup", verdict(ex <= lk),
         f"{ex:.0f} vs {lk:.0f} us"),
    ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks it runs")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"sglang: skipped: {why}")
        return 0
    size = SMOKE if args.smoke else FULL
    r = measure(size, 2 if args.smoke else args.rounds)
    print(table(r))
    for goal, verdict, detail in goals(r):
        print(f"{verdict}: {goal} ({detail})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
