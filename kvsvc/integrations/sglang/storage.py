"""``KvsvcHiCacheStorage``: kvsvc as SGLang's HiCache storage tier (L3), the class
SGLang's dynamic backend factory builds from ``--hicache-storage-backend dynamic``.

SGLang calls it from its prefetch, backup and scheduler threads and survives only
the answers it expects: ``batch_exists`` an int, the v1 calls a list of bools as
long as the keys. So every kvsvc failure here becomes a miss (0, False for that
page and the pages after it) within the call's deadline, never an exception or
None; after a failure kvsvc counts as down for ``reconnect_interval_s`` (0 hits,
writes refused) and the backend then maps its staging regions again. Reads and
writes each have their own staging region (a ``Lane``), so a prefetch never waits
on a backup. A transfer whose end is unproven bars its lane's region until a Fence
(or a new server start) proves no late copy can land in it.

The version gate (kvsvc.integrations.sglang.gate) runs when this module is
imported: missing seams are an ImportError, an untested release one warning."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.errors import BoundedLog, DeadlineExceeded, KVServiceError, Miss
from kvsvc.integrations.common import Link
from kvsvc.integrations.identity import fingerprint_weights
from kvsvc.integrations.sglang import inline
from kvsvc.integrations.sglang.config import SglangStorageConfig, model_source
from kvsvc.integrations.sglang.gate import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from kvsvc.integrations.sglang.lanes import Lane, make_lanes
from kvsvc.integrations.sglang.pages import (
    HostPages,
    LayoutRefused,
    PagesUnavailable,
    host_pages,
)

log = logging.getLogger("kvsvc.sglang")

# Pages per Store/Retrieve of a batch: small enough that gathering one piece overlaps
# kvsvc's copy of the last, large enough that the calls' overhead stays small.
PIECE_PAGES = 16
# How long past a call's own deadline a kvsvc future may take before it counts as
# unproven: every kvsvc future ends by its deadline, so this is only a backstop.
BACKSTOP_S = 1.0


class _SglangLink(Link):
    log = log


class KvsvcHiCacheStorage(HiCacheStorage):
    """kvsvc as an SGLang HiCache storage backend (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.cfg = cfg = SglangStorageConfig.parse(storage_config.extra_config)
        _setup_logging(cfg.log_level)
        if storage_config.should_split_heads:
            raise LayoutRefused(
                "kvsvc: heterogeneous TP (should_split_heads) is not supported: each rank "
                "stores its own heads"
            )
        self.sc = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        self.rank, self.tp = int(storage_config.tp_rank), int(storage_config.tp_size)
        self.link = _SglangLink(cfg, cfg.fence_timeout_s)
        self.warn = BoundedLog(log, 10.0)
        self.pages: HostPages | None = None
        self.lanes: dict[str, Lane] = {}
        # Pages as kvsvc stores them, (pages, elements) in the pool's dtype, and their
        # block dim: the geometry the namespace fingerprints.
        self.view: torch.Tensor | None = None
        self.dim = 0
        self.namespace = ""
        self.prefix = b""
        self.refused_once = False
        self.closed = False
        self.index: Any = None
        self.index_client: KVCacheClient | None = None
        self.counters: dict[str, int] = {}
        # (pages, GB/s) of each batch since get_stats, when SGLang asks for metrics.
        self.metrics = bool(storage_config.enable_storage_metrics)
        self.batches: dict[str, list[tuple[int, float]]] = {"get": [], "set": []}

    # --- setup ---
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's pages from SGLang's description of them and make the
        staging regions; a pool whose pages cannot be copied is refused here, at start,
        with one line (LayoutRefused)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = host_pages(mem_pool_host, self.is_mla)
        # MLA pages are the same on every rank: one region identity for all of them.
        rank, tp = (0, 1) if self.is_mla else (self.rank, self.tp)
        lanes = make_lanes(pages, STORAGE_BATCH_SIZE, rank, tp)
        self.page_size = pages.page_size
        itemsize = pages.dtype.itemsize
        staged = lanes["get"].staging.tensor
        self.view = staged.view(pages.dtype) if pages.page_bytes % itemsize == 0 else staged
        self.namespace = self._namespace(mem_pool_host)
        self.pages, self.lanes = pages, lanes
        sc = self.sc
        # MHA: a rank holds its own heads; MLA: one latent shared by every rank.
        part = b"mla" if self.is_mla else b"tp%d/%d" % (self.rank, self.tp)
        if sc.pp_size > 1:
            part += b".pp%d/%d" % (sc.pp_rank, sc.pp_size)
        if sc.attn_cp_size > 1:
            part += b".cp%d/%d" % (sc.attn_cp_rank, sc.attn_cp_size)
        self.prefix = part + b"|"
        log.info(
            "kvsvc HiCache storage (tp %d/%d%s): target %s, namespace %s, layout %s, "
            "pages of %d runs (%d bytes), two %d-page staging regions (%.1f MiB each)",
            self.rank,
            self.tp,
            ", MLA" if self.is_mla else "",
            self.cfg.target,
            self.namespace,
            getattr(mem_pool_host, "layout", "?"),
            len(pages.sizes),
            pages.page_bytes,
            STORAGE_BATCH_SIZE,
            STORAGE_BATCH_SIZE * pages.page_bytes / (1 << 20),
        )

    def _namespace(self, pool: Any) -> str:
        """Shared only by engines whose pages are interchangeable byte for byte."""
        assert self.view is not None
        path, revision, known = model_source(self.sc.model_name)
        weights = fingerprint_weights(
            path, revision, self.cfg.model_identity, log, revision_known=known
        )
        fingerprint = {
            "model": str(self.sc.model_name),
            "weights": weights,
            "mla": self.is_mla,
            "layout": str(pool.layout),
            "dtype": str(self.view.dtype),
            "page_size": self.page_size,
            "page_shape": [*self.view.shape[: self.dim], int(self.view.shape[self.dim + 1])],
            "tp": 1 if self.is_mla else self.tp,
        }
        digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
        return f"{self.cfg.namespace}/{digest[:32]}"

    def key(self, k: str) -> bytes:
        return self.prefix + k.encode()

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _registered(self, call: str) -> bool:
        """Whether the host pool is registered; before that every call is refused,
        said once (SGLang registers right after building the backend)."""
        if self.pages is not None and not self.closed:
            return True
        self._count("refused_unregistered")
        if not self.refused_once:
            self.refused_once = True
            if self.closed:
                log.error("kvsvc: %s called after close(): refused (misses)", call)
            else:
                log.error(
                    "kvsvc: %s called before register_mem_pool_host: refused (misses) "
                    "until SGLang registers its host pool",
                    call,
                )
        return False

    def _failed(self, what: str, exc: BaseException) -> None:
        self._count("errors")
        self.link.failed()
        for lane in self.lanes.values():
            lane.mapping = None
        self.warn.warning(
            "kvsvc %s failed (%s: %s): misses for %.1f s",
            what,
            type(exc).__name__,
            getattr(exc, "message", exc),
            self.cfg.reconnect_interval_s,
        )

    def _mapped(self, lane: Lane, deadline: float) -> tuple[KVCacheClient, MappingHandle] | None:
        """The client and the lane's mapping (made again after a restart or an
        outage, within the call's ``deadline``), or None: kvsvc counts as down.
        Called under ``lane.lock``."""
        client = self.link.get()
        if client is None:
            return None
        if lane.mapping is not None:
            return client, lane.mapping
        timeout = min(self.cfg.fence_timeout_s, max(deadline - time.monotonic(), 0.001))
        try:
            mapping = lane.map(client, self.namespace, timeout)
        except (KVServiceError, OSError) as exc:
            self._failed("map", exc)
            return None
        log.info("kvsvc: %s staging region mapped as %s", lane.name, mapping.mapping_id)
        return client, mapping

    def _unproven(
        self, lane: Lane, ids: list[str], mapping: MappingHandle, exc: BaseException
    ) -> None:
        """A transfer failed without proof that its copy ended: bar the lane's
        staging region for this server start until a Fence proves it."""
        lane.bar(mapping, ids)
        self._failed("transfer", exc)

    # --- zero-copy (v1) ---
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        # Every rank that is called stores (an MLA non-writer the same bytes as the
        # writer): SGLang's controller itself calls only is_storage_writer ranks.
        return self._v1_call("set", keys, host_indices)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._v1_call("get", keys, host_indices)

    def _v1_call(self, kind: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        call = f"batch_{kind}_v1"
        try:
            if not self._registered(call):
                return [False] * len(keys)
            return self._batch_v1(keys, host_indices, store=kind == "set")
        except PagesUnavailable as exc:
            self._count("pages_refused")
            self.warn.warning("kvsvc %s refused: %s", call, exc)
        except Exception as exc:  # noqa: BLE001 - SGLang's prefetch/backup thread must not see it
            self._failed(call, exc)
        return [False] * len(keys)

    def _batch_v1(self, keys: list[str], host_indices: torch.Tensor, *, store: bool) -> list[bool]:
        assert self.pages is not None
        if len(host_indices) != len(keys) * self.page_size:
            raise PagesUnavailable(
                f"{len(keys)} keys but {len(host_indices)} host indices (pages of {self.page_size})"
            )
        out: list[bool] = []
        cap = STORAGE_BATCH_SIZE
        for start in range(0, len(keys), cap):
            part = keys[start : start + cap]
            idx = host_indices[start * self.page_size : (start + len(part)) * self.page_size]
            done = self._one_batch(part, idx, store=store)
            out.extend(i < done for i in range(len(part)))
            if done < len(part):
                out.extend([False] * (len(keys) - len(out)))
                break
        return out

    def _one_batch(self, keys: list[str], host_indices: torch.Tensor, *, store: bool) -> int:
        """How many leading pages of the batch were stored or loaded. The batch goes
        in pieces, pipelined: this thread gathers (or scatters) one piece while
        kvsvc copies another, so the staging copy overlaps kvsvc's."""
        assert self.pages is not None
        pages, lane = self.pages, self.lanes["set" if store else "get"]
        runs = pages.runs(host_indices)
        n, page_bytes, per = len(keys), pages.page_bytes, len(pages.sizes)
        t0 = time.perf_counter()
        timeout = self.cfg.store_timeout_s if store else self.cfg.load_timeout_s
        deadline = time.monotonic() + timeout
        if not lane.lock.acquire(timeout=timeout):
            self._count(f"{lane.name}_lane_busy")
            self.warn.warning(
                "kvsvc: the %s staging region stayed busy %.1f s: a miss", lane.name, timeout
            )
            return 0
        try:
            got = self._mapped(lane, deadline)
            if got is None:
                return 0
            client, mapping = got
            staged = lane.staging.address
            chunks = [(self.key(k), [i]) for i, k in enumerate(keys)]
            pieces = [(a, min(a + PIECE_PAGES, n)) for a in range(0, n, PIECE_PAGES)]
            futures: list[Future[Any]] = []
            for a, b in pieces:
                if store:
                    pages.gather(runs[a * per : b * per], staged + a * page_bytes)
                left = max(deadline - time.monotonic(), 0.001)
                call = client.store_async if store else client.retrieve_async
                futures.append(call(mapping, chunks[a:b], timeout=left))
            done, errors = 0, []
            for (a, b), f in zip(pieces, futures, strict=True):
                try:
                    r = f.result(max(deadline - time.monotonic(), 0) + BACKSTOP_S)
                except (KVServiceError, FutureTimeout) as exc:
                    errors.append(exc)
                    continue
                if done != a:  # an earlier piece fell short: later pages do not count
                    continue
                if store:
                    self._count("pages_stored", int(r.stored_chunks))
                    done = b if r.stored_chunks + r.present_chunks == b - a else a
                else:
                    loaded = int(r.loaded_chunks)
                    if loaded:
                        pages.scatter(staged + a * page_bytes, runs[a * per : (a + loaded) * per])
                    self._count("pages_loaded", loaded)
                    done = a + loaded
            if errors:
                self._settle(lane, client, mapping, errors[0], "store" if store else "retrieve")
            self._timed("set" if store else "get", done, t0)
            return done
        finally:
            lane.lock.release()

    def _settle(
        self,
        lane: Lane,
        client: KVCacheClient,
        mapping: MappingHandle,
        exc: BaseException,
        what: str,
    ) -> None:
        """After a failed transfer: bar the staging region while a copy may still run,
        else count kvsvc as down (a plain miss counts as nothing)."""
        ids = client.unproven_transfers(mapping)
        if ids or isinstance(exc, FutureTimeout):
            self._unproven(lane, ids, mapping, exc)
        elif not isinstance(exc, Miss):
            self._failed(what, exc)

    # --- hit queries ---
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        try:
            if not self._registered("batch_exists"):
                return 0
            return self._leading(keys)
        except Exception as exc:  # noqa: BLE001 - SGLang's hit query must get an int
            self._failed("batch_exists", exc)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _leading(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        client = self.link.get()
        if client is None:
            return 0
        ks = [self.key(k) for k in keys]
        hits = self._index_hits(client, ks)
        if hits is not None:
            self._count("exists_local")
            return hits
        try:
            n = client.lookup(ks, namespace=self.namespace, timeout=self.cfg.lookup_timeout_s)
        except DeadlineExceeded as exc:
            # Slow, not gone: this query is a miss; the channel and mapping stay.
            self._count("exists_timeouts")
            self.warn.warning("kvsvc Lookup slower than lookup_timeout_s (%s): 0 hits", exc)
            return 0
        except KVServiceError as exc:
            self._failed("lookup", exc)
            return 0
        self._count("exists_rpc")
        return int(n)

    def _index_hits(self, client: KVCacheClient, keys: list[bytes]) -> int | None:
        """From the presence index while it can prove itself current, else None."""
        if not self.cfg.presence:
            return None
        if self.index is None or self.index_client is not client:
            try:
                self.index = client.presence(self.namespace)
                self.index_client = client
            except (KVServiceError, OSError, RuntimeError) as exc:
                self.warn.warning("kvsvc presence index not opened (%s): Lookup RPCs", exc)
                return None
        hits: int | None = self.index.prefix_hits(keys)
        return hits

    # --- the calls without interface_v1: pages inline over gRPC, named either by
    # tensors or (as SGLang's other backends also take them) by host pointers
    # (kvsvc.integrations.sglang.inline) ---
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> Any:
        """The page as a tensor (into ``target_location`` when it is one), or None;
        with a host pointer and size, True when the bytes were loaded there."""
        if inline.is_pointer(target_location):
            return self.batch_get([key], [target_location], [target_sizes]) == 1
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if isinstance(got, list) else None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> Any:
        """Tensors (None from the first miss on), or with host pointers the number
        of leading keys loaded into them."""
        by_pointer = target_locations is not None and inline.is_pointer(
            next(iter(target_locations), None)
        )
        try:
            if not self._registered("batch_get"):
                return 0 if by_pointer else [None] * len(keys)
            assert self.pages is not None
            if by_pointer:
                spans = inline.spans(
                    self.pages, list(target_locations or ()), target_sizes, len(keys)
                )
                return inline.into_spans(self._fetch(keys), spans)
            return inline.into_tensors(
                self._fetch(keys), len(keys), self.pages.dtype, target_locations
            )
        except PagesUnavailable as exc:
            self.warn.warning("kvsvc batch_get refused: %s", exc)
        except Exception as exc:  # noqa: BLE001 - SGLang's prefetch thread must not see it
            self._failed("get", exc)
        return 0 if by_pointer else [None] * len(keys)

    def _fetch(self, keys: list[str]) -> list[bytes]:
        client = self.link.get()
        if client is None or not keys:
            return []
        return list(
            client.get_many(
                self.namespace, [self.key(k) for k in keys], timeout=self.cfg.load_timeout_s
            )
        )

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if inline.is_pointer(target_location):
            return self.batch_set([key], None, [target_location], [target_sizes])
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Pages sent inline, taken from ``values`` (tensors) or from host pointers."""
        try:
            if not self._registered("batch_set"):
                return False
            if not keys:
                return True
            assert self.pages is not None
            blobs = inline.page_bytes(self.pages, len(keys), values, target_locations, target_sizes)
            client = self.link.get()
            if client is None:
                return False
            chunks = [(self.key(k), b) for k, b in zip(keys, blobs, strict=True)]
            r = client.put(self.namespace, chunks, timeout=self.cfg.store_timeout_s)
            return int(r.stored_chunks + r.present_chunks) == len(keys)
        except (PagesUnavailable, ValueError) as exc:
            self.warn.warning("kvsvc batch_set refused: %s", exc)
        except Exception as exc:  # noqa: BLE001 - SGLang's backup thread must not see it
            self._failed("put", exc)
        return False

    # --- the rest ---
    def clear(self) -> None:
        """SGLang's "flush cache": drops this deployment's namespace in kvsvc (every
        tier; engines of other models or geometries keep theirs) and this backend's
        presence index."""
        try:
            if not self._registered("clear"):
                return
            self.index = None
            self.index_client = None
            client = self.link.get()
            if client is None:
                log.warning("kvsvc: clear() while kvsvc is down: namespace %s kept", self.namespace)
                return
            r = client.drop_namespace(self.namespace, timeout=self.cfg.fence_timeout_s)
            log.info(
                "kvsvc: clear() dropped namespace %s (%d chunks)", self.namespace, r.dropped_chunks
            )
        except Exception as exc:  # noqa: BLE001 - SGLang's flush must not see it
            self._failed("clear (DropNamespace)", exc)

    def _timed(self, kind: str, pages: int, t0: float) -> None:
        if self.metrics and pages and self.pages is not None:
            gb = pages * self.pages.page_bytes / 1e9
            self.batches[kind].append((pages, gb / max(time.perf_counter() - t0, 1e-9)))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per batch since the last call)
        when it asked for storage metrics, else None; ``counters`` holds kvsvc's own."""
        if not self.metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        gets, sets = self.batches["get"], self.batches["set"]
        self.batches = {"get": [], "set": []}
        m.prefetch_pgs.extend(p for p, _ in gets)
        m.prefetch_bandwidth.extend(bw for _, bw in gets)
        m.backup_pgs.extend(p for p, _ in sets)
        m.backup_bandwidth.extend(bw for _, bw in sets)
        return m

    def close(self) -> None:
        self.closed = True
        self.link.close()
        lanes, self.lanes = self.lanes, {}
        for lane in lanes.values():
            with lane.lock:
                lane.staging.close()


def _setup_logging(level: str) -> None:
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvsvc] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
