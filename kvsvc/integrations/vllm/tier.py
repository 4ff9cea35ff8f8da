"""kvsvc as a secondary tier below vLLM's own CPU offloading: vLLM's
``OffloadingConnector`` with ``spec_name: "TieringOffloadingSpec"`` and
``secondary_tiers: [{"type": "KvsvcTier", "module_path": "kvsvc.integrations.vllm.tier",
...}]`` builds it by configuration alone (vLLM's ``tiering/factory.py``); the other
keys of that entry are the connector's (config.py: target, token_file, tls_*, ...).

vLLM calls every method on its scheduler's step and requires that none blocks. So
``lookup`` answers from kvsvc's presence index in local memory (HIT or MISS; RETRY
briefly while this tier stores the key), never an RPC; ``submit_*`` only queue the
job for the mover's threads (mover.py), which move bytes between vLLM's shared
offload file and kvsvc with Store/Retrieve by chunk ids; ``get_finished_jobs``
drains their outcomes. Every kvsvc fault becomes what vLLM survives: a miss, a
dropped store, a load that fails for exactly the keys not loaded. With vLLM's KV
events on, ``take_events`` reports what kvsvc holds of the namespace (stored by any
engine of the deployment, and removed), from the same index (events.py)."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np

from kvsvc.integrations.vllm.common import log, offload_namespace, setup_logging
from kvsvc.integrations.vllm.config import VllmConnectorConfig
from kvsvc.integrations.vllm.events import KvsvcKVEvents
from kvsvc.integrations.vllm.hints import Hints
from kvsvc.integrations.vllm.mover import Job, Mover, Outcome

# After the version gate in common.
from vllm.v1.kv_offload.base import (  # isort: skip
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (  # isort: skip
    JobResult,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # isort: skip

__all__ = ["KvsvcTier", "offload_fd"]


class KvsvcTier(SecondaryTierManager):
    """kvsvc below vLLM's CPU tier: every chunk vLLM offloads is also stored in
    kvsvc (shared by the host's engines, surviving an engine's restart), and a
    chunk vLLM's CPU tier lacks is promoted from kvsvc."""

    # kvsvc keeps chunks in this host's memory (and its disk tier); hits are not
    # vLLM's own host memory, so they are reported apart from it.
    medium: ClassVar[Medium | None] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **config: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        config.pop("locality", None)  # vLLM's back-pressure defaults read it; kvsvc is local
        self.locality = Locality.LOCAL
        self.cfg = VllmConnectorConfig.parse(config)
        setup_logging(self.cfg.log_level)
        num_chunks, row_bytes = primary_kv_view.shape or (0, 0)
        self.namespace = offload_namespace(offloading_spec.config, row_bytes, self.cfg)
        self.counters: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.deque[Outcome] = collections.deque()  # mover -> here
        self.failed: list[JobResult] = []  # answered at once, on the scheduler's thread
        self.storing: dict[bytes, float] = {}  # key -> when its store was queued
        # vLLM drains take_events only with its KV events on: else none are kept.
        kv_events = getattr(offloading_spec, "kv_events_config", None)
        self.events: KvsvcKVEvents | None = None
        if getattr(kv_events, "enable_kv_cache_events", False) and self.cfg.presence:
            self.events = KvsvcKVEvents(
                self.namespace, 1, "", self.cfg.reconnect_interval_s, whole_keys=True
            )
        self.hints = Hints(self.cfg, self.namespace, self.events.on_batch if self.events else None)
        if not self.cfg.presence:  # lookups never make an RPC on vLLM's step
            log.warning("kvsvc tier: presence is off, so every lookup is a miss")
        self.mover: Mover | None = None
        try:
            fd = offload_fd(offloading_spec, primary_kv_view)
        except (OSError, RuntimeError) as exc:
            log.error("kvsvc tier: vLLM's offload file not found (%s): the tier stays empty", exc)
        else:
            self.mover = Mover(
                self.cfg, self.namespace, fd, num_chunks, row_bytes, self.outcomes.append
            )
            self.mover.on_idle = self.hints.open  # (re)opened off the scheduler's step
        log.info(
            "kvsvc tier: target %s, namespace %s, %d chunks of %d bytes",
            self.cfg.target,
            self.namespace,
            num_chunks,
            row_bytes,
        )

    # --- the scheduler's step: local memory only ---
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            since = self.storing.get(key)
            if since is not None and time.monotonic() - since < self.cfg.lookup_timeout_s:
                return LookupResult.RETRY  # our own store of it is in flight
            index = self.hints.index
            hits = index.hits([key]) if index is not None else None
            if hits is not None and hits[0]:
                self.counters["lookup_hits"] += 1
                return LookupResult.HIT
            self.counters["lookup_misses" if hits is not None else "lookup_unknown"] += 1
        except Exception as exc:  # noqa: BLE001 - a miss, never an exception into vLLM
            self._hook_error("lookup", exc)
        return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        if self._submit(job_metadata, keys, load=False):
            now = time.monotonic()
            for k in keys:
                self.storing[k] = now
        else:
            self.counters["stores_dropped"] += len(keys)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        if not self._submit(job_metadata, keys, load=True):
            self.counters["loads_failed"] += len(keys)

    def _submit(self, job: TransferJob, keys: list[bytes], *, load: bool) -> bool:
        """Queue the job; when kvsvc cannot take it, answer it failed now."""
        try:
            ids = np.asarray(job.chunk_ids).tolist()
            if self.mover is not None and self.mover.submit(Job(job.job_id, keys, ids, load)):
                return True
        except Exception as exc:  # noqa: BLE001 - answered failed, never raised into vLLM
            self._hook_error("submit", exc)
        self.failed.append(JobResult(job_id=job.job_id, success=False))
        return False

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self.failed = self.failed, []
        while self.outcomes:
            o = self.outcomes.popleft()
            job, n = o.job, len(o.job.keys)
            result = JobResult(
                job_id=job.job_id,
                success=o.ok == n,
                transfer_time=o.seconds,
                transfer_bytes=o.nbytes,
            )
            if job.load:
                self.counters["loaded_chunks"] += o.ok
                self.counters["loads_failed"] += n - o.ok
                if 0 < o.ok < n:  # the leading chunks loaded: exactly the rest failed
                    result.successful_keys = [OffloadKey(k) for k in job.keys[: o.ok]]
            else:
                for k in job.keys:
                    self.storing.pop(k, None)
                self.counters["stored_chunks" if o.ok == n else "stores_failed"] += n
            out.append(result)
        self._expire_storing()
        return out

    def _expire_storing(self) -> None:
        """Forget in-flight marks past their RETRY window (a store answered late)."""
        if len(self.storing) > 4096:
            horizon = time.monotonic() - self.cfg.lookup_timeout_s
            self.storing = {k: t for k, t in self.storing.items() if t >= horizon}

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """What kvsvc stored and removed of this namespace since the last call (from
        the index in local memory; while it is unknown for ``reconnect_interval_s``,
        everything reported is withdrawn). ``ownership`` is this tier's type;
        ``removal_expected``: each stored chunk's removal is reported too."""
        if self.events is None:
            return []
        try:
            index = self.hints.index
            fresh = bool(index is not None and index.fresh)
            probe = index.hits if index is not None else (lambda keys: None)
            stored, removed = self.events.changes(probe, fresh)
        except Exception as exc:  # noqa: BLE001 - no events, never an exception into vLLM
            self._hook_error("take_events", exc)
            return []
        out = [
            OffloadingEvent(
                keys=[OffloadKey(k) for k in keys],
                medium=self.medium or Medium.CPU,
                removed=gone,
                locality=self.locality,
                ownership=self.tier_type,
                removal_expected=True,
            )
            for keys, gone in ((removed, True), (stored, False))
            if keys
        ]
        self.counters["kv_events_stored"] += len(stored)
        self.counters["kv_events_removed"] += len(removed)
        return out

    def has_pending_work(self) -> bool:
        busy = self.mover.pending() if self.mover is not None else 0
        return bool(busy or self.outcomes or self.failed)

    def drain_jobs(self) -> None:
        """Wait until no job touches vLLM's memory (bounded: deadlines plus a fence)."""
        if self.mover is None:
            return
        limit = max(self.cfg.load_timeout_s, self.cfg.store_timeout_s) + self.cfg.fence_timeout_s
        if not self.mover.drain(limit):
            log.error(
                "kvsvc tier: transfers still unproven after %.0f s; their slots stay held", limit
            )

    def shutdown(self) -> None:
        if self.mover is not None:
            self.mover.close()
        self.hints.close()
        log.info("kvsvc tier counters: %s", dict(self.counters))

    def _hook_error(self, hook: str, exc: BaseException) -> None:
        self.counters["hook_errors"] += 1
        log.warning("kvsvc tier %s: %s: %s", hook, type(exc).__name__, exc)


def offload_fd(spec: Any, view: memoryview) -> int:
    """A new read-write fd of vLLM's shared offload file, proven to be the file
    ``view`` maps (its inode in /proc/self/maps at the view's address): kvsvc
    copies into exactly the memory vLLM reads. vLLM keeps the scheduler's region
    on the spec (``_scheduler_mmap``, vLLM 0.32); else its path is opened."""
    region = getattr(spec, "_scheduler_mmap", None)
    own = getattr(region, "fd", None)
    if own is not None:
        fd = os.dup(own)
    else:
        path = getattr(region, "mmap_path", None) or (
            f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap"
        )
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        addr = int(np.asarray(view).ctypes.data)
        if st.st_size < view.nbytes or mapped_inode(addr) != (st.st_dev, st.st_ino):
            raise RuntimeError("the offload file is not the memory vLLM's view maps")
    except BaseException:
        os.close(fd)
        raise
    return fd


def mapped_inode(addr: int) -> tuple[int, int] | None:
    """(device, inode) of the file mapped at ``addr`` from its offset 0, or None."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) >= 5:
                if int(parts[2], 16) + (addr - lo) != 0:
                    return None
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                return os.makedev(major, minor), int(parts[4])
    return None
