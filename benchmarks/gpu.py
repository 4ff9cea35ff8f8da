"""GPU data plane: pinned D2H (Store) and H2D (Retrieve) throughput through a real
`kvsvc serve --device cuda` mapping the engine's KV tensors by CUDA IPC
(kvsvc.client.kvcache.describe_cuda_tensors), against a raw ``copy_`` of the same bytes
between a pinned host buffer and the same device tensors, in one run, in
alternating rounds. Only where a GPU exists; elsewhere it prints why it skipped
and exits 0. Any inconsistency (no CUDA on the server side, unpinned buffer,
short transfer, bytes that differ after the round trip) is an error, exit 1.

References, per direction:
* ``copy_ per layer``: for each chunk and layer, one ``copy_`` of the layer's
  ``[:, lo:hi]`` block slice to/from the pinned buffer (non_blocking, one
  synchronize per call) - the plain way an engine would offload these blocks;
* ``copy_ contiguous``: one ``copy_`` of the same number of bytes between one
  contiguous device tensor and the pinned buffer - the link's peak.

    python -m benchmarks.gpu [--quick | --smoke] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch

from benchmarks.common import KvsvcServer, NullProgress, Progress, bench_interleaved, md_table

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2  # 2 MiB per block, bf16
CASES = [(c, b) for c in (1, 16) for b in (1, 16)]  # (blocks per chunk, chunks per call)
SMOKE_CASES = [(1, 1)]


class GpuBenchError(RuntimeError):
    """Something is off: the figures would be meaningless."""


def gpu_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, (
            f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
            "GPU benchmark skipped"
        )
    name = torch.cuda.get_device_name(0)
    return True, f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def run(
    *, quick: bool, smoke: bool = False, threads: int = 2, progress: Progress | None = None
) -> dict[str, Any]:
    """``smoke``: one 2 MiB case for 0.1 s (checks that it runs)."""
    progress = progress or NullProgress()
    ok, why = gpu_available()
    if not ok:
        return {"skipped": why, "rows": []}
    seconds = 0.1 if smoke else 1.0 if quick else 3.0
    cases = SMOKE_CASES if smoke else CASES
    rows: list[dict[str, Any]] = []
    largest = max(c * b for c, b in cases) * BLOCK_BYTES
    shm_dir = tempfile.mkdtemp(prefix="kvsvc-gpu-")
    with KvsvcServer(threads=threads, store_bytes=4 * largest, shm_dir=shm_dir,
                     extra_args=["--device", "cuda"]) as server:  # fmt: skip
        for chunk_blocks, batch in cases:
            rows.extend(run_case(server, chunk_blocks, batch, seconds))
            torch.cuda.empty_cache()  # the case's tensors are gone with run_case
            for r in rows[-2:]:
                progress.log(r["line"])
            progress.step(f"gpu {chunk_blocks * 2} MiB x {batch}")
        if server.proc.poll() is not None:
            raise GpuBenchError(f"the server exited:\n{server.log_text()[-3000:]}")
    return {"skipped": "", "device": why, "rows": rows}


def run_case(server: KvsvcServer, chunk_blocks: int, batch: int, seconds: float) -> list[dict]:
    from kvsvc.client import KVCacheClient
    from kvsvc.client.kvcache import describe_cuda_tensors

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    blocks = chunk_blocks * batch
    shape = (2, blocks, BLOCK, HEADS, HEAD_DIM)  # vLLM's per-layer layout, blocks on dim 1
    src = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    nbytes = blocks * BLOCK_BYTES
    if sum(t.numel() * t.element_size() for t in src) != nbytes:
        raise GpuBenchError("layer shapes do not add up to the chunk bytes")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if not host.is_pinned():
        raise GpuBenchError("the reference host buffer is not pinned")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    ids = [list(range(i * chunk_blocks, (i + 1) * chunk_blocks)) for i in range(batch)]
    tag = f"gpu-{chunk_blocks}-{batch}"
    with KVCacheClient(server.address, transfer_timeout=120) as c:
        info = c.server_info()
        if info.device != "cuda":
            raise GpuBenchError(f"the server runs on {info.device!r}, not cuda (--device cuda)")
        m_src = c.map(tag + "-src", [describe_cuda_tensors(src, block_dim=1)])
        m_dst = c.map(tag + "-dst", [describe_cuda_tensors(dst, block_dim=1)])
        if m_src.block_bytes != BLOCK_BYTES or m_src.num_blocks != blocks:
            raise GpuBenchError(f"mapping has {m_src.num_blocks} blocks of {m_src.block_bytes} B")
        counter = iter(range(10**9))

        def kv_store() -> None:
            n = next(counter)
            r = c.store(m_src, [(b"%d-%d" % (n, j), ids[j]) for j in range(batch)])
            if r.stored_chunks != batch:
                raise GpuBenchError(f"stored {r.stored_chunks} of {batch} chunks: {r}")

        def per_layer(direction: str) -> None:
            pos = 0
            for j in range(batch):
                lo, hi = ids[j][0], ids[j][-1] + 1
                for s, d in zip(src, dst, strict=True):
                    n = s.numel() // s.shape[1] * (hi - lo) * s.element_size()
                    view = host[pos : pos + n].view(torch.bfloat16).view(
                        2, hi - lo, BLOCK, HEADS, HEAD_DIM)  # fmt: skip
                    if direction == "d2h":
                        view.copy_(s[:, lo:hi], non_blocking=True)
                    else:
                        d[:, lo:hi].copy_(view, non_blocking=True)
                    pos += n
            torch.cuda.synchronize(dev)

        def contiguous(direction: str) -> None:
            if direction == "d2h":
                host.copy_(flat, non_blocking=True)
            else:
                flat.copy_(host, non_blocking=True)
            torch.cuda.synchronize(dev)

        stores = bench_interleaved(
            {"kvsvc": kv_store, "layer": lambda: per_layer("d2h"),
             "flat": lambda: contiguous("d2h")}, nbytes, seconds,
        )  # fmt: skip
        last = next(counter) - 1
        keys = [b"%d-%d" % (last, j) for j in range(batch)]

        def kv_retrieve() -> None:
            r = c.retrieve(m_dst, [(keys[j], ids[j]) for j in range(batch)])
            if r.loaded_chunks != batch:
                raise GpuBenchError(f"loaded {r.loaded_chunks} of {batch} chunks: {r}")

        retrieves = bench_interleaved(
            {"kvsvc": kv_retrieve, "layer": lambda: per_layer("h2d"),
             "flat": lambda: contiguous("h2d")}, nbytes, seconds,
        )  # fmt: skip
        # The per-layer H2D reference also wrote dst; retrieve once more, then check
        # that the blocks came back bit-exact through the service.
        for d in dst:
            d.zero_()
        torch.cuda.synchronize(dev)
        kv_retrieve()
        torch.cuda.synchronize(dev)
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            if not torch.equal(s, d):
                raise GpuBenchError(f"layer {i}: the retrieved blocks differ from the stored ones")
        c.unmap(m_src)
        c.unmap(m_dst)
    mib = chunk_blocks * BLOCK_BYTES >> 20
    out = []
    for op, r in (("store D2H", stores), ("retrieve H2D", retrieves)):
        if r["kvsvc"] > 1.5 * max(r["flat"], r["layer"]):
            raise GpuBenchError(
                f"{op} {mib} MiB x {batch}: kvsvc {r['kvsvc']:.1f} GB/s is far above the link's "
                f"{r['flat']:.1f} GB/s peak: the copy cannot have happened as measured"
            )
        out.append(dict(op=op, chunk=mib, batch=batch, kvsvc=r["kvsvc"], layer=r["layer"],
                        flat=r["flat"],
                        line=f"{op:12} {mib:2} MiB x {batch:2}: kvsvc {r['kvsvc']:6.2f} GB/s  "
                             f"copy_ per layer {r['layer']:6.2f} "
                             f"({r['kvsvc'] / r['layer']:.2f})  contiguous {r['flat']:6.2f} "
                             f"({r['kvsvc'] / r['flat']:.2f})"))  # fmt: skip
    return out


def table(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return f"Not run: {result['skipped']}."
    return md_table(
        ["op", "chunk", "batch", "kvsvc GB/s", "copy_ per layer GB/s", "kvsvc/per layer",
         "copy_ contiguous GB/s", "kvsvc/contiguous"],
        [(r["op"], f"{r['chunk']} MiB", r["batch"], f"{r['kvsvc']:.2f}", f"{r['layer']:.2f}",
          f"{r['kvsvc'] / r['layer']:.2f}", f"{r['flat']:.2f}", f"{r['kvsvc'] / r['flat']:.2f}")
         for r in result["rows"]],
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument("--threads", type=int, default=2, help="server transfer threads")
    args = ap.parse_args()
    try:
        result = run(quick=args.quick, smoke=args.smoke, threads=args.threads)
    except GpuBenchError as exc:
        print(f"GPU benchmark FAILED: {exc}", file=sys.stderr)
        return 1
    if result["skipped"]:
        print(result["skipped"])
        return 0
    print(f"device: {result['device']}")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
