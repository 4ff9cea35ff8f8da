"""The connector's worker half (each vLLM worker process): maps vLLM's KV cache into
kvsvc once (``register_kv_caches``; region.py), starts each step's loads and stores
as asynchronous Retrieve and Store calls, reports which requests finished loading
or storing, and which blocks failed to load (vLLM recomputes them). A transfer whose
outcome is unknown keeps its blocks until a Fence by the same server start proves
the copy ended. Reconnects and fences run on one maintainer thread, never in a vLLM
hook, so no hook waits on kvsvc."""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvsvc.client import MappingHandle
from kvsvc.errors import UNKNOWN, BoundedLog, KVServiceError, MappingLost
from kvsvc.integrations.vllm.common import (
    KVConnectorTransferResults,
    KvsvcConnectorMetadata,
    KvsvcConnectorStats,
    Op,
    chunk_key,
    deployment_namespace,
    log,
)
from kvsvc.integrations.vllm.config import VllmConnectorConfig
from kvsvc.integrations.vllm.link import LINK_ERRORS, Link
from kvsvc.integrations.vllm.region import Staging, describe_kv_caches
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: how long ``handle_preemptions`` waits for a preempted request's stores: well
#: under a scheduler step (a store through shared memory takes ~1 ms)
PREEMPT_WAIT_S = 0.005


@dataclass
class _Transfer:
    """A Retrieve or Store in flight, or ended without proof (kept for a Fence)."""

    req_id: str
    kind: str  # "load" | "store"
    future: Future[Any]
    blocks: list[list[int]]  # per chunk
    start_id: str
    transfer_id: str = ""
    unproven_since: float = 0.0
    started: float = field(default_factory=time.monotonic)


class KvsvcConnectorWorker:
    """The worker-side state: the mapping, transfers in flight or unproven, and
    what ``get_transfer_results`` and ``get_block_ids_with_load_errors`` report next."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: VllmConnectorConfig) -> None:
        self.cfg = cfg
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.rank = tp_rank()
        self.namespace = deployment_namespace(vllm_config, kv_cache_config, cfg)
        self.link = Link(cfg, cfg.fence_timeout_s)
        self.warn = BoundedLog(log, 10.0)
        self.counters: dict[str, int] = {}
        self.interval: dict[str, int] = {}
        self.lock = threading.Lock()
        self.region: pb.RankRegion | None = None
        self.fd = -1
        self.mm: mmap.mmap | None = None
        self.staging: Staging | None = None  # set: transfers copy through a mirror
        self.mapping: MappingHandle | None = None  # None: not usable now
        self.known: MappingHandle | None = None  # the last one made
        self.detached = False  # unregister_kv_caches: the KV memory is never used again
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
        kv = describe_kv_caches(kv_caches, self.num_blocks, self.rank, self.tp)
        self.region, self.fd, self.mm, self.staging = kv.region, kv.fd, kv.mm, kv.staging
        self.thread.start()
        self.wake.set()

    def detach(self) -> None:
        """vLLM frees (or remaps) the KV memory next: no transfer starts after this
        (loads fail, so vLLM computes; stores are skipped) and the mapping is not
        made again. Transfers still unproven keep their blocks as before."""
        with self.lock:
            if self.detached:
                return
            self.detached = True
            self.mapping = None
        log.warning("kvsvc connector (worker tp rank %d): KV caches unregistered", self.rank)

    def restored(self) -> None:
        if self.detached:
            self.warn.warning(
                "kvsvc connector: KV caches restored, but kvsvc cannot prove they are the "
                "memory it mapped: it stays off until the engine restarts"
            )

    def _connect(self) -> None:
        """Pass the memfd and Map (again, after a restart or an outage)."""
        client = self.link.get()
        if client is None or self.region is None or self.detached:
            return
        try:
            info = client.server_info(timeout=self.cfg.fence_timeout_s)
            known = self.known
            if known is not None and info.server_start_id == known.server_start_id:
                # The same server start (only the channel failed): its mapping holds.
                with self.lock:
                    if self.detached:
                        return
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
            if self.detached:  # unregistered while this Map ran
                return
            self.mapping = self.known = mapping
        log.info(
            "kvsvc: mapped as %s (server start %s)", mapping.mapping_id, mapping.server_start_id
        )

    def _lost(self, exc: BaseException) -> None:
        """A failure that may mean kvsvc is gone or restarted: map again later."""
        if isinstance(exc, LINK_ERRORS):
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
        """vLLM frees a preempted request's blocks without asking, and this step's
        forward may write them. Only a store can touch them (a load's blocks
        belong to a request waiting for it, which vLLM never preempts), and a store
        only reads them: the hook waits at most ``PREEMPT_WAIT_S`` for those
        stores, then goes on. A store still running may then read bytes vLLM
        rewrote (with a mirror: bytes the blocks' next owner's store copied in): it
        is counted and logged."""
        with self.lock:
            busy = [t for t in self.transfers if t.kind == "store" and t.req_id in meta.preempted]
        if not busy:
            return
        deadline = time.monotonic() + PREEMPT_WAIT_S
        for t in busy:
            with contextlib.suppress(Exception):
                t.future.exception(timeout=max(0.0, deadline - time.monotonic()))
        left = sorted({t.req_id for t in busy if not t.future.done()})
        if left:
            self._count("preempted_running_stores", len(left))
            self.warn.warning(
                "kvsvc: requests %s were preempted while a store still read their blocks "
                "(waited %.0f ms); those entries may hold KV that vLLM rewrote",
                left,
                PREEMPT_WAIT_S * 1000,
            )

    def _start(self, op: Op, kind: str) -> None:
        blocks = [b for _, b in op.chunks]
        with self.lock:
            mapping = self.mapping
        client = self.link.client
        if not op.chunks or mapping is None or client is None:
            raise ConnectionError("kvsvc is not connected")
        chunks = [(chunk_key(self.rank, h), b) for h, b in op.chunks]
        namespace = op.namespace or None  # a salted request's, else the mapping's
        fut: Future[Any]
        if kind == "store" and self.staging is not None:
            self.staging.to_mirror([b for ids in blocks for b in ids])
        if kind == "load":
            fut = client.retrieve_async(
                mapping, chunks, namespace=namespace, timeout=self.cfg.load_timeout_s
            )
        else:
            fut = client.store_async(
                mapping, chunks, namespace=namespace, timeout=self.cfg.store_timeout_s
            )
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
                    if self.staging is not None and loaded:
                        self.staging.from_mirror([b for ids in t.blocks[:loaded] for b in ids])
                    self._count("loaded_blocks", sum(len(b) for b in t.blocks[:loaded]))
                    if loaded < len(t.blocks):  # evicted since the lookup, or failed its check
                        self._fail_load(
                            t.req_id, t.blocks[loaded:], "not loaded (evicted or failed its check)"
                        )
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


def tp_rank() -> int:
    """This worker's tensor-parallel rank (read once, at the connector's start)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (single process): rank 0
        return 0
