"""``KvsvcHiCacheStorage``: kvsvc as SGLang's HiCache storage tier (L3), the class
SGLang's dynamic backend factory builds from ``--hicache-storage-backend dynamic``.

SGLang calls it from its prefetch, backup and scheduler threads and survives only
the answers it expects: ``batch_exists`` an int, the v1 calls a list of bools as
long as the keys. So every kvsvc failure here becomes a miss (0, False for that
page and the pages after it) within the call's deadline, never an exception or
None; after a failure kvsvc counts as down for ``reconnect_interval_s`` (0 hits,
writes refused) and the backend then maps its staging region again. A transfer
whose end is unproven bars the staging region until a Fence (or a new server
start) proves no late copy can land in it."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import sglang
import torch

TESTED_VERSIONS = ("0.5",)
SGLANG_VERSION = ".".join(str(sglang.__version__).split(".")[:2])
if SGLANG_VERSION not in TESTED_VERSIONS:
    raise ImportError(
        f"kvsvc.integrations.sglang supports SGLang {', '.join(v + '.x' for v in TESTED_VERSIONS)};"
        f" this is SGLang {sglang.__version__}, whose HiCache storage API it was not tested with"
    )

# After the version check, so another SGLang fails with the line above.
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvsvc.client import KVCacheClient, MappingHandle  # noqa: E402
from kvsvc.errors import BoundedLog, DeadlineExceeded, KVServiceError, Miss  # noqa: E402
from kvsvc.integrations.common import Link  # noqa: E402
from kvsvc.integrations.identity import fingerprint_weights  # noqa: E402
from kvsvc.integrations.sglang.config import SglangStorageConfig, model_source  # noqa: E402
from kvsvc.integrations.sglang.pages import (  # noqa: E402
    LayoutRefused,
    Staging,
    check_against_sglang,
    make_staging,
    page_view,
)
from kvsvc.v1 import kv_cache_service_pb2 as pb  # noqa: E402

log = logging.getLogger("kvsvc.sglang")
# Pages per Store/Retrieve of a batch: small enough that gathering one piece overlaps
# kvsvc's copy of the last, large enough that the calls' overhead stays small.
PIECE_PAGES = 16


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
        self.writer = bool(storage_config.is_storage_writer)
        self.rank, self.tp = int(storage_config.tp_rank), int(storage_config.tp_size)
        self.link = _SglangLink(cfg, cfg.fence_timeout_s)
        self.warn = BoundedLog(log, 10.0)
        self.lock = threading.Lock()  # the staging region: one batch at a time
        self.staging: Staging | None = None
        self.view: torch.Tensor | None = None
        self.namespace = ""
        self.prefix = b""
        self.mapping: MappingHandle | None = None
        # A server start whose late copies may still land in the staging region,
        # and the ids of those transfers (a Fence of them lifts the bar).
        self.barred_start = ""
        self.barred_ids: list[str] = []
        self.index: Any = None
        self.index_client: KVCacheClient | None = None
        self.counters: dict[str, int] = {}
        # (pages, GB/s) of each batch since get_stats, when SGLang asks for metrics.
        self.metrics = bool(storage_config.enable_storage_metrics)
        self.batches: dict[str, list[tuple[int, float]]] = {"get": [], "set": []}

    # --- setup ---
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check the host pool's layout against SGLang's own page pointers and make
        the staging region; a layout that cannot be copied is refused here, at start."""
        super().register_mem_pool_host(mem_pool_host)
        view, dim = page_view(mem_pool_host, self.is_mla)
        check_against_sglang(mem_pool_host, view, dim)
        self.view, self.dim, self.page_size = view, dim, int(mem_pool_host.page_size)
        # MLA pages are the same on every rank: one region identity for all of them.
        rank, tp = (0, 1) if self.is_mla else (self.rank, self.tp)
        self.staging = make_staging(view, dim, STORAGE_BATCH_SIZE, rank, tp)
        self.namespace = self._namespace(mem_pool_host)
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
            "%d-page staging region (%.1f MiB)",
            self.rank,
            self.tp,
            ", MLA" if self.is_mla else "",
            self.cfg.target,
            self.namespace,
            mem_pool_host.layout,
            self.staging.capacity,
            self.staging.capacity * self.staging.page_bytes / (1 << 20),
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

    def _failed(self, what: str, exc: BaseException) -> None:
        self._count("errors")
        self.link.failed()
        self.mapping = None
        self.warn.warning(
            "kvsvc %s failed (%s: %s): misses for %.1f s",
            what,
            type(exc).__name__,
            getattr(exc, "message", exc),
            self.cfg.reconnect_interval_s,
        )

    def _mapped(self) -> tuple[KVCacheClient, MappingHandle] | None:
        """The client and the staging region's mapping (made again after a restart
        or an outage), or None: kvsvc counts as down. Called under ``self.lock``."""
        client = self.link.get()
        if client is None or self.staging is None:
            return None
        if self.mapping is not None:
            return client, self.mapping
        timeout = self.cfg.fence_timeout_s
        try:
            info = client.server_info(timeout=timeout)
            if self.barred_start and info.server_start_id == self.barred_start:
                # Same server start: a copy of ours may still run; only a Fence of
                # those transfer ids proves it ended.
                client.fence(None, self.barred_ids, timeout=timeout)
            self.barred_start, self.barred_ids = "", []
            token = client.register_memfd(self.staging.fd, timeout=timeout)
            region = pb.RankRegion()
            region.CopyFrom(self.staging.region)
            for t in region.tensors:
                t.handle.sealed_memfd.token = token
            self.mapping = client.map(self.namespace, [region], timeout=timeout)
        except (KVServiceError, OSError) as exc:
            self._failed("map", exc)
            return None
        log.info("kvsvc: staging region mapped as %s", self.mapping.mapping_id)
        return client, self.mapping

    def _unproven(self, ids: list[str], mapping: MappingHandle, exc: BaseException) -> None:
        """A transfer failed without proof that its copy ended: bar the staging
        region for this server start until a Fence proves it."""
        self.barred_start = mapping.server_start_id
        self.barred_ids = sorted(set(self.barred_ids) | set(ids))
        self._failed("transfer", exc)

    # --- zero-copy (v1) ---
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        n = len(keys)
        if not self.writer:  # MLA: the writer rank stores the one shared copy
            return [True] * n
        try:
            return self._batch_v1(keys, host_indices, store=True)
        except Exception as exc:  # noqa: BLE001 - SGLang's backup thread must not see it
            self._failed("batch_set_v1", exc)
            return [False] * n

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        try:
            return self._batch_v1(keys, host_indices, store=False)
        except Exception as exc:  # noqa: BLE001 - SGLang's prefetch thread must not see it
            self._failed("batch_get_v1", exc)
            return [False] * len(keys)

    def _batch_v1(self, keys: list[str], host_indices: torch.Tensor, *, store: bool) -> list[bool]:
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
        assert self.view is not None and self.staging is not None
        pages = host_indices[:: self.page_size].to(torch.int64) // self.page_size
        n = len(keys)
        t0 = time.perf_counter()
        chunks = [(self.key(k), [i]) for i, k in enumerate(keys)]
        pieces = [(a, min(a + PIECE_PAGES, n)) for a in range(0, n, PIECE_PAGES)]
        timeout = self.cfg.store_timeout_s if store else self.cfg.load_timeout_s
        with self.lock:
            got = self._mapped()
            if got is None:
                return 0
            client, mapping = got
            futures: list[Future[Any]] = []
            for a, b in pieces:
                if store:
                    stage = self.staging.tensor.narrow(self.dim, a, b - a)
                    torch.index_select(self.view, self.dim, pages[a:b], out=stage)
                    futures.append(client.store_async(mapping, chunks[a:b], timeout=timeout))
                else:
                    futures.append(client.retrieve_async(mapping, chunks[a:b], timeout=timeout))
            done, errors = 0, []
            for (a, b), f in zip(pieces, futures, strict=True):
                try:
                    # Every kvsvc future ends by its deadline; this bound is a backstop.
                    r = f.result(timeout + 10)
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
                        stage = self.staging.tensor.narrow(self.dim, a, loaded)
                        self.view.index_copy_(self.dim, pages[a : a + loaded], stage)
                    self._count("pages_loaded", loaded)
                    done = a + loaded
            if errors:
                self._settle(client, mapping, errors[0], "store" if store else "retrieve")
            self._timed("set" if store else "get", done, t0)
            return done

    def _settle(
        self, client: KVCacheClient, mapping: MappingHandle, exc: BaseException, what: str
    ) -> None:
        """After a failed transfer: bar the staging region while a copy may still run,
        else count kvsvc as down (a plain miss counts as nothing)."""
        ids = client.unproven_transfers(mapping)
        if ids or isinstance(exc, FutureTimeout):
            self._unproven(ids, mapping, exc)
        elif not isinstance(exc, Miss):
            self._failed(what, exc)

    # --- hit queries ---
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        try:
            return self._leading(keys)
        except Exception as exc:  # noqa: BLE001 - SGLang's hit query must get an int
            self._failed("batch_exists", exc)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _leading(self, keys: Sequence[str]) -> int:
        if not keys or not self.namespace:
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
        return n

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

    # --- tensor calls (the path without interface_v1: pages inline over gRPC) ---
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if isinstance(got, list) else None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(keys)
        client = self.link.get()
        if client is None or not keys:
            return out
        try:
            data = client.get_many(
                self.namespace, [self.key(k) for k in keys], timeout=self.cfg.load_timeout_s
            )
        except KVServiceError as exc:
            self._failed("get", exc)
            return out
        dtype = self.view.dtype if self.view is not None else torch.uint8
        for i, blob in enumerate(data):
            t = torch.frombuffer(bytearray(blob), dtype=dtype)
            dst = target_locations[i] if target_locations is not None else None
            if dst is not None:
                if dst.numel() != t.numel():
                    break  # another page geometry: a miss, never a wrong-sized copy
                dst.view(-1).copy_(t)
                t = dst
            out[i] = t
        return out

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if not self.writer or not keys:
            return True
        client = self.link.get()
        if client is None or values is None:
            return False
        try:
            chunks = [
                (self.key(k), v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                for k, v in zip(keys, values, strict=True)
            ]
            r = client.put(self.namespace, chunks, timeout=self.cfg.store_timeout_s)
        except KVServiceError as exc:
            self._failed("put", exc)
            return False
        return int(r.stored_chunks + r.present_chunks) == len(keys)

    # --- the rest ---
    def clear(self) -> None:
        """SGLang's "flush cache": kvsvc's store is shared and other engines read it,
        so nothing is deleted; this engine's presence index is dropped."""
        self.index = None
        self.index_client = None

    def _timed(self, kind: str, pages: int, t0: float) -> None:
        if self.metrics and pages and self.staging is not None:
            gb = pages * self.staging.page_bytes / 1e9
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
        self.link.close()
        if self.staging is not None:
            self.staging.close()
            self.staging = None


def _setup_logging(level: str) -> None:
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvsvc] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
