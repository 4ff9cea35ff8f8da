"""kvsvc as vLLM's KV offload and prefix-sharing backend (vLLM's V1 connector API).

Load it with ``--kv-transfer-config '{"kv_connector": "KvsvcConnector",
"kv_connector_module_path": "kvsvc.integrations.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"target":
"127.0.0.1:50051"}}'`` (docs/vllm.md has every key).

Scheduler side (engine-core process): one Lookup per new request, bounded by
``lookup_timeout_s``; any error is a miss, and kvsvc then counts as down for
``reconnect_interval_s``. Loads are asynchronous: a request waits in
WAITING_FOR_REMOTE_KVS while its blocks load, so a Retrieve whose outcome is
unknown can keep the blocks until a Fence proves the copy ended.

Worker side (each worker process): vLLM's CPU KV cache is one allocation viewed
per layer; at ``register_kv_caches`` its memory is moved into a sealed memfd
(no copy: the cache is still zero) that the server maps once, so Retrieve and
Store copy straight between vLLM's blocks and the store. Every hook catches
everything: a kvsvc failure becomes a miss or blocks that vLLM recomputes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import vllm

TESTED_VERSIONS = ("0.32",)
_VERSION = ".".join(str(vllm.__version__).split(".")[:2])
if _VERSION not in TESTED_VERSIONS:
    raise ImportError(
        f"kvsvc.integrations.vllm supports vLLM {', '.join(v + '.x' for v in TESTED_VERSIONS)};"
        f" this is vLLM {vllm.__version__}, whose connector API it was not tested with"
    )

import torch  # noqa: E402 - after the version check, so an old vLLM fails with one line
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: E402

from kvsvc.client import KVCacheClient, MappingHandle  # noqa: E402
from kvsvc.client.fdpass import make_sealed_memfd  # noqa: E402
from kvsvc.client.kvcache import rank_context  # noqa: E402
from kvsvc.errors import (  # noqa: E402
    UNKNOWN,
    BoundedLog,
    Cancelled,
    DeadlineExceeded,
    KVServiceError,
    MappingLost,
    ServiceNotServing,
    ServiceUnavailable,
    TransferUnprovable,
)
from kvsvc.integrations.vllm.config import VllmConnectorConfig  # noqa: E402
from kvsvc.layout import dtype_code  # noqa: E402
from kvsvc.v1 import kv_cache_service_pb2 as pb  # noqa: E402

log = logging.getLogger("kvsvc.vllm")
# Failures after which the mapping may be gone (kvsvc down, restarted, stuck): map again.
_LINK_ERRORS = (
    MappingLost,
    ServiceUnavailable,
    ServiceNotServing,
    DeadlineExceeded,
    Cancelled,
    TransferUnprovable,
    ConnectionError,
)
T = TypeVar("T")

__all__ = ["KvsvcConnector", "KvsvcConnectorMetadata", "KvsvcConnectorStats"]


def _setup_logging(level: str) -> None:
    """vLLM configures only its own loggers: without a handler ours would print
    nothing below WARNING."""
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvsvc] %(message)s"))
        log.addHandler(handler)
        log.propagate = False


# --- what the scheduler sends the workers each step ---
@dataclass
class Op:
    """A load or store of one request: its chunks as (hash of the chunk's last
    vLLM block, the chunk's block ids). vLLM's block hashes chain, so the last
    block's hash names the whole prefix."""

    req_id: str
    chunks: list[tuple[bytes, list[int]]]


@dataclass
class KvsvcConnectorMetadata(KVConnectorMetadata):
    loads: list[Op] = field(default_factory=list)
    stores: list[Op] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass
class KvsvcConnectorStats(KVConnectorStats):
    """Counters since the last interval, summed over workers (vLLM logs them)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KvsvcConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def deployment_namespace(vllm_config: Any, kv_cache_config: Any, cfg: VllmConnectorConfig) -> str:
    """The namespace two engines share only when their KV is interchangeable:
    model, dtype, block size, KV spec, parallel sizes, vLLM minor version. The
    TP rank goes into each key, the worker's tensor layout into the mapping
    (the server refuses to load a chunk stored under another layout)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    specs = sorted({repr(g.kv_cache_spec) for g in getattr(kv_cache_config, "kv_cache_groups", [])})
    fingerprint = {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "block_size": int(cc.block_size),
        "kv_specs": specs,
        "tp": int(pc.tensor_parallel_size),
        "pp": int(pc.pipeline_parallel_size),
        "blocks_per_chunk": cfg.blocks_per_chunk,
        "vllm": _VERSION,
    }
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return f"{cfg.namespace}/{digest[:32]}"


def chunk_key(tp_rank: int, block_hash: bytes) -> bytes:
    """One key per chunk and TP rank: a hit needs every rank's shard."""
    return b"tp%d:" % tp_rank + block_hash


def _hash_bytes(h: Any) -> bytes:
    return h if isinstance(h, bytes) else hashlib.sha256(repr(h).encode()).digest()


def _guarded(default: Callable[..., T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """No exception escapes into vLLM (it would kill the engine): log, count, and
    return ``default(self, *args)`` instead."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        def hook(self: Any, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                self.counters["hook_errors"] = self.counters.get("hook_errors", 0) + 1
                self.warn.warning(
                    "kvsvc connector: %s raised %s: %s", fn.__name__, type(exc).__name__, exc
                )
                log.debug("traceback", exc_info=True)
                return default(self, *args)

        hook.__name__ = fn.__name__
        hook.__doc__ = fn.__doc__
        return hook

    return wrap


class _Link:
    """A client that is replaced by a fresh channel after a failure, at most
    once per ``reconnect_interval_s`` (gRPC's own reconnect backoff grows to
    minutes), and a "down until" time during which callers skip kvsvc."""

    def __init__(self, cfg: VllmConnectorConfig, control_timeout: float) -> None:
        self.cfg = cfg
        self.control_timeout = control_timeout
        self.client: KVCacheClient | None = None
        self.down_until = 0.0
        self.old: list[KVCacheClient] = []

    def get(self) -> KVCacheClient | None:
        """The client, or None while kvsvc counts as down."""
        if time.monotonic() < self.down_until:
            return None
        if self.client is None:
            # Over the client's Session stream (unary where the server lacks it): the
            # scheduler's Lookup per request costs about half a unary call's.
            self.client = KVCacheClient(
                self.cfg.target,
                control_timeout=self.control_timeout,
                transfer_timeout=self.cfg.load_timeout_s,
            )
        return self.client

    def failed(self) -> None:
        self.down_until = time.monotonic() + self.cfg.reconnect_interval_s
        if self.client is not None:
            # In-flight futures may still use it: closed later, not now. A call
            # still running on one closed here ends as Cancelled (UNKNOWN: fenced).
            self.old.append(self.client)
            self.client = None
            while len(self.old) > 4:
                with contextlib.suppress(Exception):
                    self.old.pop(0).close()

    def close(self) -> None:
        for c in [*self.old, *([self.client] if self.client else [])]:
            with contextlib.suppress(Exception):
                c.close()
        self.old.clear()
        self.client = None


# --- scheduler side ---
@dataclass
class _Req:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0  # chunks before it are stored, loaded or planned
    had_store: bool = False
    load_planned: bool = False


class _Scheduler:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: VllmConnectorConfig) -> None:
        self.cfg = cfg
        self.block_size = int(vllm_config.cache_config.block_size)
        self.chunk_blocks = cfg.blocks_per_chunk
        self.chunk_tokens = self.block_size * self.chunk_blocks
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.namespace = deployment_namespace(vllm_config, kv_cache_config, cfg)
        self.link = _Link(cfg, cfg.lookup_timeout_s)
        self.warn = BoundedLog(log, 10.0)
        self.counters: dict[str, int] = {}
        self.reqs: dict[str, _Req] = {}
        # req id -> (first chunk to load, chunks to load), from the last lookup
        self.matched: dict[str, tuple[int, int]] = {}
        self.loads: list[Op] = []
        self.lookup_seconds_max = 0.0
        log.info("kvsvc connector (scheduler): target %s, namespace %s", cfg.target, self.namespace)

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _chunk_hashes(self, request: Any, upto_chunks: int) -> list[bytes]:
        hashes = request.block_hashes
        return [_hash_bytes(hashes[(c + 1) * self.chunk_blocks - 1]) for c in range(upto_chunks)]

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
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
        client = self.link.get()
        if client is None:
            self._count("lookups_skipped_down")
            return 0, False
        keys = [
            chunk_key(r, h) for h in self._chunk_hashes(request, chunks) for r in range(self.tp)
        ]
        t0 = time.monotonic()
        try:
            hit_keys = client.lookup(
                keys, namespace=self.namespace, timeout=self.cfg.lookup_timeout_s
            )
        except KVServiceError as exc:
            log.debug(
                "kvsvc lookup %s: failed after %.1f ms",
                request.request_id,
                (time.monotonic() - t0) * 1000,
            )
            self.link.failed()
            self._count("lookup_errors")
            self.warn.warning(
                "kvsvc lookup failed (%s: %s): counted as a miss; kvsvc skipped for %.1f s",
                type(exc).__name__,
                exc.message,
                self.cfg.reconnect_interval_s,
            )
            return 0, False
        finally:
            took = time.monotonic() - t0
            self.lookup_seconds_max = max(self.lookup_seconds_max, took)
        hits = hit_keys // self.tp  # a chunk counts only when every rank's shard is there
        log.debug(
            "kvsvc lookup %s: %d of %d chunks stored (%.1f ms)",
            request.request_id,
            hits,
            chunks,
            took * 1000,
        )
        self._count("lookup_hit_chunks", hits)
        self._count("lookup_miss_chunks", chunks - hits)
        if hits <= first:
            return 0, False
        self.matched[request.request_id] = (first, hits - first)
        return hits * self.chunk_tokens - num_computed_tokens, True

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
        self.loads.append(Op(request.request_id, chunks))
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
            ops.append(Op(req_id, chunks))
            self._count("store_planned_chunks", len(chunks))
        return ops

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """Blocks a store read stay allocated until every worker says it ended."""
        self.matched.pop(request.request_id, None)
        req = self.reqs.pop(request.request_id, None)
        return (req is not None and req.had_store), None

    def shutdown(self) -> None:
        log.info(
            "kvsvc connector (scheduler) counters: %s, slowest lookup %.1f ms",
            self.counters,
            self.lookup_seconds_max * 1000,
        )
        self.link.close()


# --- worker side ---
@dataclass
class _Transfer:
    req_id: str
    kind: str  # "load" | "store"
    future: Future[Any]
    blocks: list[list[int]]  # per chunk
    start_id: str
    transfer_id: str = ""
    unproven_since: float = 0.0
    started: float = field(default_factory=time.monotonic)


class _Worker:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: VllmConnectorConfig) -> None:
        self.cfg = cfg
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.rank = _tp_rank()
        self.namespace = deployment_namespace(vllm_config, kv_cache_config, cfg)
        self.link = _Link(cfg, cfg.fence_timeout_s)
        self.warn = BoundedLog(log, 10.0)
        self.counters: dict[str, int] = {}
        self.interval: dict[str, int] = {}
        self.lock = threading.Lock()
        self.region: pb.RankRegion | None = None
        self.fd = -1
        self.mm: mmap.mmap | None = None
        self.mapping: MappingHandle | None = None  # None: not usable now
        self.known: MappingHandle | None = None  # the last one made
        self.transfers: list[_Transfer] = []  # in flight or unproven
        self.recv_done: set[str] = set()
        self.recv_failed_reqs: set[str] = set()
        self.failed_blocks: set[int] = set()
        self.store_reqs: set[str] = set()  # requests whose blocks a store read
        self.finished: set[str] = set()  # finished requests not yet reported sent
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.checked = 0.0
        self.thread = threading.Thread(target=self._maintain, name="kvsvc-connector", daemon=True)
        log.info(
            "kvsvc connector (worker tp rank %d/%d): target %s, namespace %s",
            self.rank,
            self.tp,
            cfg.target,
            self.namespace,
        )

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
        self.interval[name] = self.interval.get(name, 0) + n

    # --- registration ---
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        block_dim = _block_dim(tensors[0], self.num_blocks)
        if tensors[0].is_cuda:
            from kvsvc.client.kvcache import describe_cuda_tensors

            self.region = describe_cuda_tensors(
                tensors, block_dim=block_dim, context=rank_context(self.rank, self.tp)
            )
        else:
            self.region = self._memfd_region(tensors, block_dim)
        self.thread.start()
        self.wake.set()

    def _memfd_region(self, tensors: list[torch.Tensor], block_dim: int) -> pb.RankRegion:
        """Move the one storage all layers view into a sealed memfd, in place:
        every view, whoever holds it, then points into memory the server maps."""
        storage = tensors[0].untyped_storage()
        base = storage.data_ptr()
        if any(t.untyped_storage().data_ptr() != base for t in tensors):
            raise RuntimeError("the KV tensors do not share one storage (a newer vLLM?)")
        nbytes = storage.nbytes()
        t0 = time.perf_counter()
        fd = make_sealed_memfd(f"kvsvc-vllm-tp{self.rank}", nbytes)
        # Populated now, as vLLM's torch.zeros touched its allocation: otherwise each
        # first write to a block faults its pages in on the request path.
        populate = getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | populate)
        fresh = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()
        # No copy: vLLM 0.32 registers its cache before anything writes it (zeros).
        storage._swap_data_ptr_(fresh)  # type: ignore[attr-defined]
        del fresh  # holds vLLM's original allocation, freed now
        self.fd, self.mm = fd, mm
        new_base = storage.data_ptr()
        log.info(
            "kvsvc: vLLM's KV cache (%d layers, %.1f MiB) moved into a sealed memfd in %.1f ms",
            len(tensors),
            nbytes / (1 << 20),
            (time.perf_counter() - t0) * 1000,
        )
        return pb.RankRegion(
            context=rank_context(self.rank, self.tp),
            tensors=[
                pb.KVTensor(
                    name=f"layer.{i}",
                    handle=pb.MemoryHandle(
                        sealed_memfd=pb.SealedMemfdHandle(token="", size_bytes=nbytes)
                    ),
                    offset_bytes=t.data_ptr() - new_base,
                    shape=list(t.shape),
                    strides=list(t.stride()),
                    dtype=dtype_code(str(t.dtype)),  # type: ignore[arg-type]
                    block_dim=block_dim,
                )
                for i, t in enumerate(tensors)
            ],
        )

    def _connect(self) -> None:
        """Pass the memfd and Map (again, after a restart or an outage)."""
        client = self.link.get()
        if client is None or self.region is None:
            return
        try:
            info = client.server_info(timeout=self.cfg.fence_timeout_s)
            known = self.known
            if known is not None and info.server_start_id == known.server_start_id:
                # The same server start (only the channel failed): its mapping holds.
                with self.lock:
                    self.mapping = known
                log.info("kvsvc: reconnected; mapping %s still holds", known.mapping_id)
                return
            region = pb.RankRegion()
            region.CopyFrom(self.region)
            if self.fd >= 0:
                token = client.register_memfd(self.fd, timeout=self.cfg.fence_timeout_s)
                for t in region.tensors:
                    t.handle.sealed_memfd.token = token
            mapping = client.map(self.namespace, [region], timeout=self.cfg.fence_timeout_s)
        except KVServiceError as exc:
            self.link.failed()
            self.warn.warning(
                "kvsvc unreachable (%s: %s): no hits, no stores; retrying every %.1f s",
                type(exc).__name__,
                exc.message,
                self.cfg.reconnect_interval_s,
            )
            return
        with self.lock:
            self.mapping = self.known = mapping
        log.info(
            "kvsvc: mapped as %s (server start %s)", mapping.mapping_id, mapping.server_start_id
        )

    def _lost(self, exc: BaseException) -> None:
        """A failure that may mean kvsvc is gone or restarted: map again later."""
        if isinstance(exc, _LINK_ERRORS):
            with self.lock:
                self.mapping = None
            self.link.failed()
            self.wake.set()

    # --- loads and stores ---
    def start_load_kv(self, meta: KvsvcConnectorMetadata) -> None:
        for op in meta.loads:
            try:
                self._start(op, "load")
            except Exception as exc:  # noqa: BLE001 - this request still gets its answer
                self._fail_load(op.req_id, [b for _, b in op.chunks], exc)

    def save(self, meta: KvsvcConnectorMetadata) -> None:
        for op in meta.stores:
            with self.lock:
                self.store_reqs.add(op.req_id)
            try:
                self._start(op, "store")
            except Exception as exc:  # noqa: BLE001 - a store only loses the cache entry
                self._count("store_failures")
                self.warn.warning("kvsvc store not started: %s: %s", type(exc).__name__, exc)

    def preempted(self, meta: KvsvcConnectorMetadata) -> None:
        """vLLM frees a preempted request's blocks without asking: let its stores
        end first (bounded by their own deadline)."""
        with self.lock:
            busy = [t for t in self.transfers if t.kind == "store" and t.req_id in meta.preempted]
        deadline = time.monotonic() + self.cfg.store_timeout_s
        for t in busy:
            with contextlib.suppress(Exception):
                t.future.exception(timeout=max(0.0, deadline - time.monotonic()))
        self._poll()
        with self.lock:
            left = [
                t.req_id for t in self.transfers if t.kind == "store" and t.req_id in meta.preempted
            ]
        if left:
            self._count("preempted_unproven_stores", len(left))
            log.error(
                "kvsvc: requests %s were preempted while a store may still read their "
                "blocks; those entries may hold KV rewritten meanwhile",
                sorted(set(left)),
            )

    def _start(self, op: Op, kind: str) -> None:
        blocks = [b for _, b in op.chunks]
        with self.lock:
            mapping = self.mapping
        client = self.link.client
        if not op.chunks or mapping is None or client is None:
            raise ConnectionError("kvsvc is not connected")
        chunks = [(chunk_key(self.rank, h), b) for h, b in op.chunks]
        fut: Future[Any]
        if kind == "load":
            fut = client.retrieve_async(mapping, chunks, timeout=self.cfg.load_timeout_s)
        else:
            fut = client.store_async(mapping, chunks, timeout=self.cfg.store_timeout_s)
        with self.lock:
            self.transfers.append(_Transfer(op.req_id, kind, fut, blocks, mapping.server_start_id))

    def _fail_load(self, req_id: str, blocks: list[list[int]], why: BaseException | str) -> None:
        n = sum(len(b) for b in blocks)
        self._count("load_failed_blocks", n)
        with self.lock:
            if blocks:
                self.failed_blocks.update(b for ids in blocks for b in ids)
            else:
                self.recv_failed_reqs.add(req_id)
            self.recv_done.add(req_id)
        log.info(
            "kvsvc: load of request %s failed (%d blocks): %s; vLLM recomputes them",
            req_id,
            n,
            why if isinstance(why, str) else f"{type(why).__name__}: {why}",
        )

    def _poll(self) -> None:
        """Settle finished transfers: results, proven failures, or unproven ones
        (kept, with their blocks, for the maintainer's Fence)."""
        with self.lock:
            done = [t for t in self.transfers if t.future.done() and not t.unproven_since]
        for t in done:
            exc = t.future.exception()
            log.debug(
                "kvsvc %s of request %s settled %.1f ms after it started",
                t.kind,
                t.req_id,
                (time.monotonic() - t.started) * 1000,
            )
            if exc is None:
                r = t.future.result()
                if t.kind == "load":
                    loaded = int(r.loaded_chunks)
                    self._count("loaded_blocks", sum(len(b) for b in t.blocks[:loaded]))
                    if loaded < len(t.blocks):  # evicted since the lookup
                        self._fail_load(t.req_id, t.blocks[loaded:], "evicted since the lookup")
                    else:
                        with self.lock:
                            self.recv_done.add(t.req_id)
                else:
                    self._count("stored_blocks", sum(len(b) for b in t.blocks))
                self._forget(t)
                continue
            state = getattr(exc, "transfer_state", UNKNOWN)
            if state == UNKNOWN:
                t.transfer_id = getattr(exc, "request_id", "") or ""
                t.unproven_since = time.monotonic()
                self._count("unproven_transfers")
                log.warning(
                    "kvsvc: %s of request %s ended without proof (%s: %s); its %d blocks "
                    "stay with kvsvc until a Fence proves the copy ended",
                    t.kind,
                    t.req_id,
                    type(exc).__name__,
                    exc,
                    sum(len(b) for b in t.blocks),
                )
                self._lost(exc)
                self.wake.set()
                continue
            self._lost(exc)
            self._settle_failed(t, exc)

    def _settle_failed(self, t: _Transfer, exc: BaseException | str) -> None:
        if t.kind == "load":
            self._fail_load(t.req_id, t.blocks, exc)
        else:
            self._count("store_failures")
            self.warn.warning("kvsvc store failed (the entry is lost, not the request): %s", exc)
        self._forget(t)

    def _forget(self, t: _Transfer) -> None:
        with self.lock, contextlib.suppress(ValueError):
            self.transfers.remove(t)

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._poll()
        with self.lock:
            self.finished |= finished_req_ids & self.store_reqs
            busy = {t.req_id for t in self.transfers if t.kind == "store"}
            sent = {r for r in self.finished if r not in busy}
            self.finished -= sent
            self.store_reqs -= sent
            recv, self.recv_done = self.recv_done, set()
            failed, self.recv_failed_reqs = self.recv_failed_reqs, set()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=recv, failed_recving=failed
        )

    def load_errors(self) -> set[int]:
        with self.lock:
            out, self.failed_blocks = self.failed_blocks, set()
        return out

    def stats(self) -> KvsvcConnectorStats | None:
        if not self.interval:
            return None
        out, self.interval = self.interval, {}
        return KvsvcConnectorStats(data=out)

    # --- the maintainer thread: reconnects and fences, never in a vLLM hook ---
    def _maintain(self) -> None:
        while not self.stop.is_set():
            self.wake.wait(self.cfg.reconnect_interval_s / 2)
            self.wake.clear()
            try:
                with self.lock:
                    mapped = self.mapping is not None
                    unproven = [t for t in self.transfers if t.unproven_since]
                now = time.monotonic()
                if not mapped and now >= self.link.down_until:
                    self._connect()
                elif mapped and now - self.checked >= self.cfg.reconnect_interval_s:
                    self.checked = now
                    self._check()
                if unproven:
                    self._fence(unproven)
            except Exception as exc:  # noqa: BLE001 - the thread must keep going
                self.warn.warning("kvsvc maintainer: %s: %s", type(exc).__name__, exc)

    def _check(self) -> None:
        """Notice a restarted or vanished kvsvc between transfers, so that the
        mapping is made again before the next one needs it."""
        with self.lock:
            mapping = self.mapping
        client = self.link.client
        if mapping is None or client is None:
            return
        try:
            info = client.server_info(timeout=self.cfg.fence_timeout_s)
        except KVServiceError as exc:
            self.warn.warning("kvsvc unreachable (%s); mapping again when it is back", exc)
            self._lost(exc)
            return
        if info.server_start_id != mapping.server_start_id:
            log.info("kvsvc restarted (start %s): mapping again", info.server_start_id)
            self._lost(MappingLost("server restarted"))

    def _fence(self, unproven: list[_Transfer]) -> None:
        """Settle unproven transfers once a Fence by the same server start proves
        they ended. One that ran on a server start that is gone cannot be proven:
        its blocks stay held (docs/vllm.md)."""
        with self.lock:
            mapping = self.mapping
        client = self.link.get()
        if mapping is None or client is None:
            return
        mine = [t for t in unproven if t.start_id == mapping.server_start_id]
        for t in unproven:
            if t.start_id != mapping.server_start_id and not getattr(t, "_told", False):
                t._told = True  # type: ignore[attr-defined]
                log.error(
                    "kvsvc: the %s of request %s ran on server start %s, which is gone; "
                    "no Fence can prove it ended, so its blocks stay held",
                    t.kind,
                    t.req_id,
                    t.start_id,
                )
        if not mine:
            return
        ids = [t.transfer_id for t in mine if t.transfer_id]
        try:
            result = client.fence(transfer_ids=ids, timeout=self.cfg.fence_timeout_s)
        except KVServiceError as exc:
            self._lost(exc)
            self.warn.warning("kvsvc fence failed (%s); blocks stay held, retrying", exc)
            return
        if result.server_start_id != mapping.server_start_id:
            return  # another server answered: no proof
        self._count("fences")
        for t in mine:
            log.info(
                "kvsvc: fence proved the %s of request %s ended (%.1f s after it was unproven)",
                t.kind,
                t.req_id,
                time.monotonic() - t.unproven_since,
            )
            self._settle_failed(t, "its outcome was unknown; a fence proved it ended")

    def shutdown(self) -> None:
        self.stop.set()
        self.wake.set()
        log.info("kvsvc connector (worker tp rank %d) counters: %s", self.rank, self.counters)
        self.link.close()


def _warn_no_reserved_core(vllm_config: Any) -> None:
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


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (single process): rank 0
        return 0


def _block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension that indexes blocks: of size ``num_blocks`` and, if several
    are, the outermost of them (largest stride: a block is a contiguous run in
    every layout vLLM uses). vLLM's layouts differ by version and backend; none
    is hard-coded."""
    dims = [i for i, s in enumerate(t.shape) if s == num_blocks]
    if not dims:
        raise RuntimeError(f"no dimension of KV shape {tuple(t.shape)} has {num_blocks} blocks")
    return max(dims, key=lambda i: t.stride(i))


# --- the class vLLM loads ---
class KvsvcConnector(KVConnectorBase_V1):
    """kvsvc behind vLLM's KV connector API; see the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.cfg = VllmConnectorConfig.parse(extra)
        _setup_logging(self.cfg.log_level)
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning(
                "kvsvc connector: kv_load_failure_policy is %r: a failed load then fails "
                'the request; set it to "recompute" so vLLM recomputes instead',
                policy,
            )
        self.warn = BoundedLog(log, 10.0)
        self.counters: dict[str, int] = {}
        self.sched: _Scheduler | None = None
        self.worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            _warn_no_reserved_core(vllm_config)
            self.sched = _Scheduler(vllm_config, kv_cache_config, self.cfg)
            self.counters = self.sched.counters
        else:
            self.worker = _Worker(vllm_config, kv_cache_config, self.cfg)
            self.counters = self.worker.counters

    # --- scheduler side ---
    @_guarded(lambda self, *a: (0, False))
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self.sched is not None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @_guarded(lambda self, *a: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvsvcConnectorMetadata:
        assert self.sched is not None  # cannot raise: see _Scheduler.build_connector_meta
        return self.sched.build_connector_meta(scheduler_output)

    @_guarded(lambda self, *a: (False, None))
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        assert self.sched is not None
        return self.sched.request_finished(request, block_ids)

    # --- worker side ---
    @_guarded(lambda self, *a: None)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    @_guarded(lambda self, *a: None)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvsvcConnectorMetadata):
            self.worker.start_load_kv(meta)

    @_guarded(lambda self, *a: None)
    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        meta = kv_connector_metadata
        if self.worker is not None and isinstance(meta, KvsvcConnectorMetadata) and meta.preempted:
            self.worker.preempted(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: vLLM schedules a request once they ended

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the whole step's chunks are stored at wait_for_save

    @_guarded(lambda self, *a: None)
    def wait_for_save(self) -> None:
        """Starts this step's stores (the forward has written their blocks); their
        requests' blocks stay allocated until ``get_finished`` reports them."""
        assert self.worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvsvcConnectorMetadata):
                self.worker.save(meta)

    @_guarded(lambda self, *a: KVConnectorTransferResults())
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        return self.worker.transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    @_guarded(lambda self, *a: set())
    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def get_kv_connector_stats(self) -> KvsvcConnectorStats | None:
        try:
            return self.worker.stats() if self.worker is not None else None
        except Exception:  # noqa: BLE001 - the engine must survive
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvsvcConnectorStats:
        return KvsvcConnectorStats(data=dict(data or {}))

    @_guarded(lambda self, *a: None)
    def shutdown(self) -> None:
        for side in (self.sched, self.worker):
            if side is not None:
                side.shutdown()
