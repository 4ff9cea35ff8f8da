"""The connector's scheduler half (vLLM's engine-core process): asks the presence
index (hints.py: local memory, no RPC) which of a new request's chunks kvsvc holds,
else kvsvc itself: one Lookup on a thread of its own (bounded by
``lookup_timeout_s``; any error is a miss and kvsvc then counts as down for
``reconnect_interval_s``), vLLM being told "not yet" until it ends, so the
scheduler's thread never waits on kvsvc. It then plans
the loads of the matched chunks into the blocks vLLM allocated, plans a store for
each prompt chunk a step completes, and keeps each request's blocks allocated
while a store may still read them. Loads are asynchronous: a request waits in
WAITING_FOR_REMOTE_KVS while its blocks load, so a Retrieve whose outcome is
unknown can keep the blocks until a Fence proves the copy ended. Nothing here
touches KV memory: the plans travel to the workers as ``KvsvcConnectorMetadata``.
With vLLM's KV events on, ``take_events`` publishes the chunks this engine
stored once kvsvc holds them, and their removal (events.py).
With ``salt_namespaces``, a request with a ``cache_salt`` looks up and plans its
chunks in its salt's namespace (config.salt_namespace; each Op names it for the
workers); the presence index follows the deployment's namespace only, so a salted
request asks kvsvc (Lookup, off the scheduler's thread as above)."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvsvc.errors import BoundedLog, KVServiceError
from kvsvc.integrations.vllm.common import (
    KvsvcConnectorMetadata,
    Op,
    chunk_key,
    deployment_namespace,
    hash_bytes,
    log,
)
from kvsvc.integrations.vllm.config import VllmConnectorConfig, salt_namespace
from kvsvc.integrations.vllm.events import KvsvcKVEvents
from kvsvc.integrations.vllm.hints import Hints
from kvsvc.integrations.vllm.link import Link

#: the ``locality`` and ``ownership`` of the KV events of this engine's blocks in
#: kvsvc: served from this node (shared memory), by the tier named kvsvc
KV_EVENTS_LOCALITY = "LOCAL"
KV_EVENTS_OWNERSHIP = "kvsvc"


@dataclass
class _Req:
    """A request the scheduler has seen, until vLLM says it finished."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0  # chunks before it are stored, loaded or planned
    had_store: bool = False
    load_planned: bool = False


class KvsvcConnectorScheduler:
    """The scheduler-side state: the last lookup's matches, the loads planned since
    the last step, and each running request's blocks and next chunk to store."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: VllmConnectorConfig) -> None:
        warn_no_reserved_core(vllm_config)
        self.cfg = cfg
        self.block_size = int(vllm_config.cache_config.block_size)
        self.chunk_blocks = cfg.blocks_per_chunk
        self.chunk_tokens = self.block_size * self.chunk_blocks
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.namespace = deployment_namespace(vllm_config, kv_cache_config, cfg)
        self.link = Link(cfg, cfg.lookup_timeout_s)
        self.warn = BoundedLog(log, 10.0)
        self.counters: dict[str, int] = {}
        self.reqs: dict[str, _Req] = {}
        # req id -> (first chunk to load, chunks to load), from the last lookup
        self.matched: dict[str, tuple[int, int]] = {}
        self.loads: list[Op] = []
        # Lookups run here, never on vLLM's scheduler thread: until one ends, vLLM
        # is told "not yet" (None) and asks again next step.
        self.lookups = ThreadPoolExecutor(1, thread_name_prefix="kvsvc-lookup")
        self.pending: dict[str, Future[tuple[int, float, Any]]] = {}
        self.lookup_seconds_max = 0.0
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self.events: KvsvcKVEvents | None = None
        if kv_events is not None and kv_events.enable_kv_cache_events and cfg.presence:
            self.events = KvsvcKVEvents(
                self.namespace,
                self.tp,
                cfg.kv_events_medium,
                cfg.reconnect_interval_s,
                locality=KV_EVENTS_LOCALITY,
                ownership=KV_EVENTS_OWNERSHIP,
                claimed_only=True,
            )
        self.hints = Hints(cfg, self.namespace, self.events.on_batch if self.events else None)
        self.hints.open()  # now: it follows the stream while vLLM starts
        log.info("kvsvc connector (scheduler): target %s, namespace %s", cfg.target, self.namespace)

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _namespace_of(self, request: Any) -> str:
        """Where ``request``'s chunks live: its salt's namespace (``salt_namespaces``
        and a ``cache_salt``), else the deployment's."""
        if not self.cfg.salt_namespaces:
            return self.namespace
        return salt_namespace(self.namespace, getattr(request, "cache_salt", None))

    def _op(self, request: Any, chunks: list[tuple[bytes, list[int]]]) -> Op:
        """A load or store of ``request``'s chunks, naming its namespace for the
        workers when it is not the mapping's."""
        namespace = self._namespace_of(request)
        return Op(request.request_id, chunks, "" if namespace == self.namespace else namespace)

    def _chunk_hashes(self, request: Any, upto_chunks: int) -> list[bytes]:
        hashes = request.block_hashes
        return [hash_bytes(hashes[(c + 1) * self.chunk_blocks - 1]) for c in range(upto_chunks)]

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.matched.pop(request.request_id, None)
        req = self.reqs.get(request.request_id)
        if req is not None and req.load_planned:
            # Asked again after a load: it failed and vLLM recomputes. One load per
            # request, so a persistent failure cannot loop (lookup, load, fail, ...).
            return 0, False
        # Never the whole prompt: vLLM computes at least its last token.
        chunks = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        chunks //= self.chunk_blocks
        first = -(-num_computed_tokens // self.chunk_tokens)  # whole chunks past local hits
        if chunks <= first:
            return 0, False
        keys = [
            chunk_key(r, h) for h in self._chunk_hashes(request, chunks) for r in range(self.tp)
        ]
        t0 = time.monotonic()
        namespace = self._namespace_of(request)
        # The index follows the deployment's namespace: a salt's is asked by Lookup.
        hit_keys = self.hints.prefix_hits(keys) if namespace == self.namespace else None
        if hit_keys is not None:
            self._count("lookups_from_index")
            took = time.monotonic() - t0
            return self._matched(request, num_computed_tokens, chunks, hit_keys, took, "index")
        pending = self.pending.get(request.request_id)
        if pending is not None:
            if not pending.done():
                self._count("lookups_not_yet")
                return None, False  # vLLM skips the request this step and asks again
            del self.pending[request.request_id]
            return self._looked_up(request, num_computed_tokens, chunks, pending.result())
        client = self.link.get()
        if client is None:
            self._count("lookups_skipped_down")
            return 0, False
        self.pending[request.request_id] = self.lookups.submit(
            _lookup, client, keys, namespace, self.cfg.lookup_timeout_s
        )
        self._count("lookups_rpc")
        return None, False

    def _looked_up(
        self, request: Any, computed: int, chunks: int, outcome: tuple[int, float, Any]
    ) -> tuple[int, bool]:
        """vLLM's answer from a Lookup that ended: its hits, or a miss when it
        failed (kvsvc then counts as down for ``reconnect_interval_s``)."""
        hit_keys, took, exc = outcome
        self.lookup_seconds_max = max(self.lookup_seconds_max, took)
        if exc is None:
            return self._matched(request, computed, chunks, hit_keys, took, "rpc")
        log.debug("kvsvc lookup %s: failed after %.1f ms", request.request_id, took * 1000)
        self.link.failed()
        self._count("lookup_errors")
        self.warn.warning(
            "kvsvc lookup failed (%s: %s): counted as a miss; kvsvc skipped for %.1f s",
            type(exc).__name__,
            getattr(exc, "message", exc),
            self.cfg.reconnect_interval_s,
        )
        return 0, False

    def _matched(
        self, request: Any, computed: int, chunks: int, hit_keys: int, took: float, source: str
    ) -> tuple[int, bool]:
        """vLLM's answer for ``hit_keys`` leading keys found (by the index or a Lookup)."""
        first = -(-computed // self.chunk_tokens)
        self.lookup_seconds_max = max(self.lookup_seconds_max, took)
        hits = hit_keys // self.tp  # a chunk counts only when every rank's shard is there
        log.debug(
            "kvsvc lookup %s: %d of %d chunks stored (%.3f ms, %s)",
            request.request_id,
            hits,
            chunks,
            took * 1000,
            source,
        )
        self._count("lookup_hit_chunks", hits)
        self._count("lookup_miss_chunks", chunks - hits)
        if hits <= first:
            return 0, False
        self.matched[request.request_id] = (first, hits - first)
        return hits * self.chunk_tokens - computed, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req = self.reqs.setdefault(request.request_id, _Req(request))
        matched = self.matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        first, n = matched
        ids = list(blocks.get_block_ids()[0])
        try:
            hashes = self._chunk_hashes(request, first + n)
            chunks = [
                (hashes[c], ids[c * self.chunk_blocks : (c + 1) * self.chunk_blocks])
                for c in range(first, first + n)
            ]
            if any(len(b) != self.chunk_blocks for _, b in chunks):
                raise ValueError(f"{len(ids)} blocks allocated for {first + n} chunks")
        except Exception:
            # The request now waits for its load: the worker must still report it.
            req.load_planned = True
            self.loads.append(Op(request.request_id, []))
            raise
        req.next_chunk = first + n
        req.load_planned = True
        self.loads.append(self._op(request, chunks))
        self._count("load_planned_chunks", n)

    def build_connector_meta(self, out: Any) -> KvsvcConnectorMetadata:
        meta = KvsvcConnectorMetadata(loads=self.loads)
        self.loads = []
        meta.preempted = set(getattr(out, "preempted_req_ids", None) or ())
        try:
            meta.stores = self._stores(out)
        except Exception as exc:  # noqa: BLE001 - the loads must reach the workers
            self._count("hook_errors")
            self.warn.warning("kvsvc: planning stores failed: %s: %s", type(exc).__name__, exc)
        return meta

    def _stores(self, out: Any) -> list[Op]:
        """The prompt's chunks that this step completes."""
        for new in out.scheduled_new_reqs:
            if new.req_id in self.reqs:
                self.reqs[new.req_id].block_ids = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self.reqs.get(req_id)
            new_ids = cached.new_block_ids[i]
            if req is None or new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                req.block_ids = list(new_ids[0])
            else:
                req.block_ids.extend(new_ids[0])
        if self.link.get() is None:
            return []  # kvsvc is down: nothing is stored (a later request recomputes)
        ops = []
        for req_id, n_sched in out.num_scheduled_tokens.items():
            req = self.reqs.get(req_id)
            if req is None:
                continue
            r = req.request
            done_tokens = min(r.num_computed_tokens + n_sched, r.num_prompt_tokens)
            ready = min(done_tokens // self.block_size, len(r.block_hashes), len(req.block_ids))
            ready //= self.chunk_blocks
            if ready <= req.next_chunk:
                continue
            hashes = self._chunk_hashes(r, ready)
            chunks = [
                (hashes[c], req.block_ids[c * self.chunk_blocks : (c + 1) * self.chunk_blocks])
                for c in range(req.next_chunk, ready)
            ]
            req.next_chunk = ready
            req.had_store = True
            if self.events is not None and self._namespace_of(r) == self.namespace:
                self.events.claim([h for h, _ in chunks])  # announced once kvsvc holds them
            ops.append(self._op(r, chunks))
            self._count("store_planned_chunks", len(chunks))
        return ops

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """Blocks a store read stay allocated until every worker says it ended."""
        self.matched.pop(request.request_id, None)
        self.pending.pop(request.request_id, None)
        req = self.reqs.pop(request.request_id, None)
        return (req is not None and req.had_store), None

    def take_events(self) -> list[Any]:
        """vLLM KV events of kvsvc's blocks since the last step (none when vLLM's
        KV events are off)."""
        if self.events is None:
            return []
        out = self.events.take(self.hints.hits, self.hints.fresh)
        if out:
            self.counters.update(self.events.counters)
            log.debug("kvsvc KV events: %s", self.events.counters)
        return out

    def shutdown(self) -> None:
        self.lookups.shutdown(wait=False, cancel_futures=True)
        self.hints.close()
        log.info(
            "kvsvc connector (scheduler) counters: %s, slowest lookup %.1f ms",
            self.counters,
            self.lookup_seconds_max * 1000,
        )
        self.link.close()


def _lookup(
    client: Any, keys: list[bytes], namespace: str, timeout: float
) -> tuple[int, float, Any]:
    """(leading keys found, seconds taken, None) or (0, seconds, the error): the
    scheduler thread then reads it (counters and the link are its own)."""
    t0 = time.monotonic()
    try:
        return (
            client.lookup(keys, namespace=namespace, timeout=timeout),
            time.monotonic() - t0,
            None,
        )
    except KVServiceError as exc:
        return 0, time.monotonic() - t0, exc


def warn_no_reserved_core(vllm_config: Any) -> None:
    """vLLM's CPU platform reserves one more core per worker once any KV connector is
    set (meant for NIXL's transfer thread). Where that leaves no core to bind (<= 2 cores
    per worker), vLLM reserves none at all: the model's OpenMP threads get every core,
    the engine's busy loop and kvsvc preempt one of them, and each parallel region waits
    for it. Measured on 2 CPUs: a miss 1.8-3.3x the no-connector time, an engine without
    a connector bound so ~2x; with one CPU reserved, within the host's noise (docs/vllm.md).
    Logical CPUs are counted (an SMT host of 2 cores x 2 threads is not caught)."""
    from vllm import envs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not hasattr(os, "sched_getaffinity"):
        return
    if envs.VLLM_CPU_OMP_THREADS_BIND != "auto" or envs.VLLM_CPU_NUM_OF_RESERVED_CPU is not None:
        return
    workers = max(1, int(getattr(vllm_config.parallel_config, "local_world_size", 1)))
    cpus = len(os.sched_getaffinity(0))
    if cpus <= 2 * workers:
        log.warning(
            "kvsvc connector: with a KV connector set, vLLM reserves no CPU for its engine "
            "loop on <= %d CPUs (here %d): its OpenMP threads take every CPU and prefill "
            "slows down (~2x measured on 2 CPUs). Set VLLM_CPU_NUM_OF_RESERVED_CPU=%d "
            "(what vLLM reserves without a connector).",
            2 * workers,
            cpus,
            workers,
        )
