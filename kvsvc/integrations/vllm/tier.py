"""kvsvc as a secondary tier below vLLM's own CPU offloading: vLLM's
``OffloadingConnector`` with ``spec_name: "TieringOffloadingSpec"`` and
``secondary_tiers: [{"type": "KvsvcTier", "module_path": "kvsvc.integrations.vllm.tier",
...}]`` builds it by configuration alone (vLLM's ``tiering/factory.py``); the other
keys of that entry are the connector's (config.py: target, token_file, tls_*, ...).

vLLM calls every method on its scheduler's step and requires that none blocks. So
``lookup`` answers from kvsvc's presence index in local memory (HIT or MISS; RETRY
briefly while this tier stores the key), never an RPC; ``submit_*`` only queue the
job for the mover's threads (mover.py), which move bytes between the primary view
vLLM hands the tier (any C-contiguous memoryview: vLLM's shared offload region, a
private tensor) and kvsvc, through a staging memfd of the tier's own that kvsvc
maps, with Store/Retrieve by chunk ids; ``get_finished_jobs``
drains their outcomes. Every kvsvc fault becomes what vLLM survives: a miss, a
dropped store, a load that fails for exactly the keys not loaded. With vLLM's KV
events on, ``take_events`` reports what kvsvc holds of the namespace (stored by any
engine of the deployment, and removed), from the same index (events.py)."""

from __future__ import annotations

import collections
import dataclasses
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

__all__ = ["KvsvcTier", "namespace_config", "primary_rows"]


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
        # vLLM's factory passes these two keys of every tier config to the tier (and
        # reads ``locality`` for its back-pressure defaults); refused as vLLM's own
        # tiers refuse them, before anything starts.
        locality = config.pop("locality", None)
        self.locality = Locality(locality) if locality is not None else None
        enable_kv_events = config.pop("enable_kv_events", None)
        self.cfg = VllmConnectorConfig.parse(config)
        setup_logging(self.cfg.log_level)
        rows = primary_rows(primary_kv_view)
        num_chunks, row_bytes = rows.shape
        self.namespace = offload_namespace(
            namespace_config(offloading_spec.config), row_bytes, self.cfg
        )
        self.counters: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.deque[Outcome] = collections.deque()  # mover -> here
        self.failed: list[JobResult] = []  # answered at once, on the scheduler's thread
        self.storing: dict[bytes, float] = {}  # key -> when its store was queued
        # key -> when kvsvc acknowledged our store of it: a hit until the index has
        # caught up (its events arrive a moment after the Store's reply).
        self.stored: dict[bytes, float] = {}
        # req id -> keys whose load failed for that request: a miss for it from then
        # on, so vLLM does not promote the same doomed keys every step.
        self.failed_loads: dict[str, set[bytes]] = {}
        self.events = self._events(offloading_spec, enable_kv_events)
        self.hints = Hints(self.cfg, self.namespace, self.events.on_batch if self.events else None)
        if not self.cfg.presence:  # lookups never make an RPC on vLLM's step
            log.warning("kvsvc tier: presence is off, so every lookup is a miss")
        self.num_chunks = num_chunks
        self.mover = Mover(self.cfg, self.namespace, rows, self.outcomes.append)
        self.mover.on_idle = self.hints.open  # (re)opened off the scheduler's step
        log.info(
            "kvsvc tier: target %s, namespace %s, %d chunks of %d bytes, locality %s",
            self.cfg.target,
            self.namespace,
            num_chunks,
            row_bytes,
            self.locality.value if self.locality else "unset",
        )

    def _events(self, spec: Any, enable: Any) -> KvsvcKVEvents | None:
        """The KV-events bookkeeping: with vLLM's KV events on (its global flag) and
        ``enable_kv_events`` not false; a tier-level opt-in alone does nothing."""
        kv_events = getattr(spec, "kv_events_config", None)
        on = getattr(kv_events, "enable_kv_cache_events", False) is True
        if enable is not None and not isinstance(enable, bool):
            raise ValueError(f"enable_kv_events must be true or false, not {enable!r}")
        if enable and not on:
            log.warning(
                "kvsvc tier: enable_kv_events is set but vLLM's KV cache events are off; "
                "the tier emits none"
            )
        if not on or enable is False or not self.cfg.presence:
            return None
        return KvsvcKVEvents(self.namespace, 1, "", self.cfg.reconnect_interval_s, whole_keys=True)

    # --- the scheduler's step: local memory only ---
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            k = bytes(key)
            failed = self.failed_loads.get(req_context.req_id)
            if failed is not None and k in failed:
                self.counters["lookup_misses"] += 1
                return LookupResult.MISS  # its load failed for this request
            now = time.monotonic()
            since = self.storing.get(k)
            if since is not None and now - since < self.cfg.lookup_timeout_s:
                return LookupResult.RETRY  # our own store of it is in flight
            index = self.hints.index
            hits = index.hits([k]) if index is not None else None
            acked = self.stored.get(k)
            if (hits is not None and hits[0]) or (
                acked is not None and now - acked < self.cfg.reconnect_interval_s
            ):
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
            self._load_failed(_req_id(job_metadata), keys)

    def _submit(self, job: TransferJob, keys: list[bytes], *, load: bool) -> bool:
        """Queue the job; when kvsvc cannot take it, answer it failed now."""
        try:
            ids = [int(c) for c in np.asarray(job.chunk_ids).tolist()]
            if len(ids) != len(keys) or any(not 0 <= c < self.num_chunks for c in ids):
                self.counters["bad_jobs"] += 1  # rows the primary view does not have
            else:
                if self.mover.submit(Job(job.job_id, keys, ids, load, _req_id(job))):
                    return True
        except Exception as exc:  # noqa: BLE001 - answered failed, never raised into vLLM
            self._hook_error("submit", exc)
        self.failed.append(JobResult(job_id=job.job_id, success=False))
        return False

    def _load_failed(self, req_id: str, keys: list[bytes]) -> None:
        """``keys`` failed to load for request ``req_id``: misses for it from now on."""
        if len(self.failed_loads) >= 4096 and req_id not in self.failed_loads:
            self.failed_loads.pop(next(iter(self.failed_loads)))  # bounded: oldest request
        self.failed_loads.setdefault(req_id, set()).update(keys)

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
                if o.ok < n:
                    self.counters["loads_failed"] += n - o.ok
                    self._load_failed(job.req_id, job.keys[o.ok :])
                if 0 < o.ok < n:  # the leading chunks loaded: exactly the rest failed
                    result.successful_keys = [OffloadKey(k) for k in job.keys[: o.ok]]
            else:
                now = time.monotonic()
                for k in job.keys:
                    self.storing.pop(k, None)
                    if o.ok == n:
                        self.stored[k] = now
                self.counters["stored_chunks" if o.ok == n else "stores_failed"] += n
            out.append(result)
        self._expire_storing()
        return out

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.failed_loads.pop(req_context.req_id, None)

    def _expire_storing(self) -> None:
        """Forget in-flight marks past their RETRY window (a store answered late),
        and acknowledged stores past theirs (the index knows them by then)."""
        now = time.monotonic()
        if len(self.storing) > 4096:
            horizon = now - self.cfg.lookup_timeout_s
            self.storing = {k: t for k, t in self.storing.items() if t >= horizon}
        if len(self.stored) > 4096:
            horizon = now - self.cfg.reconnect_interval_s
            self.stored = {k: t for k, t in self.stored.items() if t >= horizon}

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
        return bool(self.mover.pending() or self.outcomes or self.failed)

    def drain_jobs(self) -> None:
        """Wait until no job touches vLLM's memory, its outcome then ready for
        ``get_finished_jobs`` (bounded: the jobs' deadlines)."""
        limit = max(self.cfg.load_timeout_s, self.cfg.store_timeout_s) + self.cfg.fence_timeout_s
        if not self.mover.drain(limit):
            log.error("kvsvc tier: jobs still running after %.0f s", limit)

    def shutdown(self) -> None:
        """Idempotent: jobs not started are answered failed, the threads stop, and
        the tier lets go of vLLM's primary view (vLLM unmaps it after its tiers'
        shutdown, which an exported buffer would prevent)."""
        self.mover.close()
        self.hints.close()
        self._release_rows()
        log.info("kvsvc tier counters: %s", dict(self.counters))

    def _release_rows(self) -> None:
        view = self.mover.rows.base
        self.mover.rows = np.empty((0, 0), np.uint8)
        if isinstance(view, memoryview):
            try:
                view.release()
            except BufferError:  # a job thread past its join still copies a row
                log.warning("kvsvc tier: the primary view is still in use at shutdown")

    def _hook_error(self, hook: str, exc: BaseException) -> None:
        self.counters["hook_errors"] += 1
        log.warning("kvsvc tier %s: %s: %s", hook, type(exc).__name__, exc)


def _req_id(job: TransferJob) -> str:
    return str(getattr(job.req_context, "req_id", ""))


def primary_rows(view: memoryview) -> np.ndarray:
    """vLLM's primary view as bytes, one row per chunk (``view[b]`` is chunk ``b``,
    ``strides[0]`` bytes, as vLLM's own tiers address it), over the same memory.
    A view the tier could not write rows of in place is refused at start."""
    shape, strides = view.shape or (), view.strides or ()
    if not shape or not strides or shape[0] == 0:
        raise ValueError(f"the primary view has no chunks (shape {shape})")
    if not view.c_contiguous or view.readonly:
        raise ValueError("the primary view must be writable and C-contiguous")
    num_chunks, row_bytes = int(shape[0]), int(strides[0])
    if num_chunks * row_bytes != view.nbytes:
        raise ValueError(f"the primary view's rows ({row_bytes} bytes) do not tile it")
    return np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(num_chunks, row_bytes)


def namespace_config(config: Any) -> Any:
    """The OffloadingConfig as the namespace sees it: where vLLM's own tiers share a
    row across topologies, the parallel sizes collapsed to one worker (rank 0) and
    the per-worker block bytes to the row's bytes per block, so every TP size
    derives the same namespace. vLLM declares two such layouts: the replicated one
    (one copy of the row, identical on every worker: MLA's latent) and a canonical
    layout it certified parallelism-agnostic (every worker writes its part of one
    topology-free page). Any other layout keeps its sizes: a miss across TP sizes,
    never another topology's bytes."""
    par = config.parallel
    # ``is True``: only vLLM's declared flags, never a truthy stand-in for one.
    replicated = getattr(config, "replicated_layout", False) is True
    canonical = getattr(config, "canonical_layout", False) is True and (
        getattr(par, "is_parallelism_agnostic", False) is True
    )
    if not (replicated or canonical):
        return config
    per_block = int(config.worker_kv_bytes_per_block) * (1 if replicated else int(par.world_size))
    one = dataclasses.replace(
        par, rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1
    )
    return dataclasses.replace(config, parallel=one, worker_kv_bytes_per_block=per_block)
