"""``KvsvcL2Adapter``: kvsvc as an L2 adapter of LMCache's multiprocess server,
built by LMCache's ``plugin`` adapter type from the server's command line.

LMCache calls the adapter from its store and prefetch controller threads, which
poll the three eventfds; it survives only the answers the interface promises: a
task id at once, then a store result, a lookup bitmap, a load bitmap. So each
submit only queues the task on the adapter's own thread for that kind (store,
lookup, load: a slow load never holds a lookup back) and returns; the thread runs
it within the task's deadline and always records a result and signals the eventfd,
whatever kvsvc did. Every kvsvc failure becomes what LMCache survives: a lookup
reports absent, a load's bitmap has exactly the objects that were loaded and
verified (kvsvc checks each chunk's CRC-32C as it copies it), a store is reported
failed. After a failure kvsvc counts as down for ``reconnect_interval_s`` (absent,
stores failed at once), then the adapter reconnects and maps its staging again.

Data path: lanes.py (one copy per batch into a staging region kvsvc maps once).
Keys and namespaces: keys.py. ``submit_unlock`` holds nothing in kvsvc: kvsvc has no
per-key pin, so an object evicted between lookup and load is a load miss (its bit
is 0), which LMCache handles as for any adapter."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import lmcache
import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.errors import BoundedLog, DeadlineExceeded, KVServiceError, Miss
from kvsvc.integrations.common import Link
from kvsvc.integrations.lmcache.config import LmcacheAdapterConfig
from kvsvc.integrations.lmcache.keys import Namespaces, chunk_key
from kvsvc.integrations.lmcache.lanes import Lane, close_lanes, make_lane, mapped

log = logging.getLogger("kvsvc.lmcache")

#: The LMCache releases this adapter was tested with, oldest and newest.
TESTED_RANGE = ("0.5.6", "0.5.6")
# How long past a task's own deadline a kvsvc future may take before it counts as
# unproven: every kvsvc future ends by its deadline, so this is only a backstop.
BACKSTOP_S = 1.0
# Objects a load skips (a miss or a chunk that failed its checksum) before it
# gives up on the rest of the task: each skip costs one more Retrieve.
MAX_SKIPS = 8
# Keys this adapter stored count as held for this long even where the presence
# index has not seen their events yet (read your own writes: LMCache may look up
# what it just stored); at most RECENT_KEYS of them are remembered.
RECENT_S = 5.0
RECENT_KEYS = 1 << 16
# Lookups in a row slower than lookup_timeout_s after which kvsvc counts as down
# (a stopped server answers nothing; one slow lookup is only a miss).
SLOW_LOOKUPS = 3


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def _warn_untested() -> None:
    version = str(getattr(lmcache, "__version__", "0"))
    if not _release(TESTED_RANGE[0]) <= _release(version) <= _release(TESTED_RANGE[1]):
        log.warning(
            "kvsvc: LMCache %s is outside the tested range %s to %s; its L2 adapter "
            "interface is present, so the adapter runs",
            version,
            *TESTED_RANGE,
        )


class _LmcacheLink(Link):
    log = log


def object_bytes(obj: Any) -> torch.Tensor | None:
    """The object's logical bytes as a flat uint8 view of LMCache's own memory, or
    None when it has none in host memory (an invalidated object, a device one)."""
    try:
        raw = obj.raw_tensor
        size = int(obj.get_size())
    except Exception:  # noqa: BLE001 - an object LMCache cannot describe: skipped
        return None
    if not isinstance(raw, torch.Tensor) or raw.device.type != "cpu" or not raw.is_contiguous():
        return None
    flat = raw.reshape(-1).view(torch.uint8)
    return flat[:size] if 0 < size <= flat.numel() else None


class KvsvcL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """kvsvc as an LMCache L2 adapter (see the module docstring)."""

    def __init__(self, adapter_params: Any = None, l1_memory_desc: Any = None) -> None:
        # Capacity 0: kvsvc evicts by itself (its LRU, its tiers), so LMCache runs
        # no global eviction against it.
        super().__init__(max_capacity_bytes=0)
        params = adapter_params if isinstance(adapter_params, dict) else {}
        self.cfg = cfg = LmcacheAdapterConfig.parse(params)
        _setup_logging(cfg.log_level)
        _warn_untested()
        self.link = _LmcacheLink(cfg, cfg.fence_timeout_s)
        self.namespaces = Namespaces(cfg.namespace, cfg.model_identity, log)
        self.warn = BoundedLog(log, 10.0)
        self._efds = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        self._threads = {
            k: ThreadPoolExecutor(1, thread_name_prefix=f"kvsvc-l2-{k}")
            for k in ("store", "lookup", "load")
        }
        self._lock = threading.Lock()
        self._next_id = 0
        self._store_done: dict[int, Any] = {}
        self._lookup_done: dict[int, Any] = {}
        self._load_done: dict[int, Any] = {}
        self._lanes: dict[tuple[str, int], Lane] = {}
        self._locked: dict[Any, int] = {}
        self._indexes: dict[str, Any] = {}
        self._index_client: KVCacheClient | None = None
        self._slow_lookups = 0
        self._recent: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._closed = False
        self.counters: dict[str, int] = {}
        log.info(
            "kvsvc L2 adapter: target %s, namespace prefix %s, staging %d MiB per lane",
            cfg.target,
            cfg.namespace,
            cfg.staging_mib,
        )

    # --- eventfds ---
    def get_store_event_fd(self) -> int:
        return int(self._efds["store"].fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._efds["lookup"].fileno())

    def get_load_event_fd(self) -> int:
        return int(self._efds["load"].fileno())

    # --- tasks: queued on the kind's thread; a result and a signal always follow ---
    def _submit(
        self,
        kind: str,
        run: Callable[[list[Any], list[Any]], Any],
        failed: Callable[[int], Any],
        keys: list[Any],
        objects: list[Any],
    ) -> int:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
        try:
            self._threads[kind].submit(self._run, kind, task_id, run, failed, keys, objects)
        except RuntimeError:  # closed: answered at once
            self._finish(kind, task_id, failed(len(keys)))
        return task_id

    def _run(
        self,
        kind: str,
        task_id: int,
        run: Callable[[list[Any], list[Any]], Any],
        failed: Callable[[int], Any],
        keys: list[Any],
        objects: list[Any],
    ) -> None:
        result = None
        try:
            result = run(keys, objects)
        except Exception as exc:  # noqa: BLE001 - LMCache's controllers must not see it
            self._count(f"{kind}_errors")
            self.warn.warning("kvsvc %s task failed (%s: %s)", kind, type(exc).__name__, exc)
        finally:
            self._finish(kind, task_id, failed(len(keys)) if result is None else result)

    def _finish(self, kind: str, task_id: int, result: Any) -> None:
        done = {"store": self._store_done, "lookup": self._lookup_done, "load": self._load_done}
        with self._lock:
            done[kind][task_id] = result
        with contextlib.suppress(OSError, ValueError):  # closed: nobody polls it any more
            self._efds[kind].notify()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    # --- store ---
    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit("store", self._store, _failed_store, keys, objects)

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._lock:
            done, self._store_done = self._store_done, {}
        return done

    def _store(self, keys: list[Any], objects: list[Any]) -> Any:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        if not keys:
            return L2StoreResult(True, 0)
        if self.link.get() is None:
            self._count("stores_skipped_down")
            return L2StoreResult(False, 0)
        stored = [False] * len(keys)
        for (ns, size), idx in self._groups(keys, objects).items():
            lane = self._lane("store", size)
            if lane is None:
                continue
            got = self._store_group(lane, ns, [keys[i] for i in idx], [objects[i] for i in idx])
            for i, ok in zip(idx, got, strict=True):
                stored[i] = ok
        done = [i for i, ok in enumerate(stored) if ok]
        self._remember([keys[i] for i in done])
        if done:
            sizes = [int(objects[i].get_size()) for i in done]
            self._notify_keys_stored([keys[i] for i in done], sizes)
            self._count("objects_stored", len(done))
        nbytes = sum(int(objects[i].get_size()) for i in done)
        return L2StoreResult(len(done) == len(keys), nbytes)

    def _store_group(self, lane: Lane, ns: str, keys: list[Any], objects: list[Any]) -> list[bool]:
        """Per object, whether kvsvc holds it now: copied into the lane a piece at a
        time, each piece Stored while the next is copied."""
        out = [False] * len(keys)
        cfg = self.cfg
        deadline = time.monotonic() + cfg.store_timeout_s
        with lane.lock:
            got = mapped(lane, self.link, self.namespaces.staging(), cfg.fence_timeout_s)
            if got is None:
                return out
            client, mapping = got
            staged = lane.staging.tensor
            for r0 in range(0, len(keys), lane.slots):
                r1 = min(r0 + lane.slots, len(keys))
                pending: list[tuple[int, int, Future[Any], bool]] = []
                for a in range(r0, r1, lane.piece(cfg.piece_mib)):
                    b = min(a + lane.piece(cfg.piece_mib), r1)
                    chunks = []
                    for j in range(a, b):
                        src = object_bytes(objects[j])
                        if src is None or src.numel() != lane.object_bytes:
                            continue
                        staged[j - r0].copy_(src)
                        chunks.append((chunk_key(keys[j]), [j - r0]))
                    if not chunks:
                        continue
                    left = max(deadline - time.monotonic(), 0.001)
                    f = client.store_async(mapping, chunks, namespace=ns, timeout=left)
                    # A piece with an object that could not be staged is awaited
                    # (its copy reads the slots) but counts as failed.
                    pending.append((a, b, f, len(chunks) == b - a))
                errors = self._settle_stores(pending, out, deadline)
                if errors:
                    self._after_failure(lane, client, mapping, errors[0], "store")
                    break
        return out

    def _settle_stores(
        self,
        pending: list[tuple[int, int, Future[Any], bool]],
        out: list[bool],
        deadline: float,
    ) -> list[BaseException]:
        errors: list[BaseException] = []
        for a, b, f, whole in pending:
            try:
                r = f.result(max(deadline - time.monotonic(), 0) + BACKSTOP_S)
            except (KVServiceError, FutureTimeout) as exc:
                errors.append(exc)
                continue
            if whole and int(r.stored_chunks) + int(r.present_chunks) == b - a:
                out[a:b] = [True] * (b - a)
        return errors

    # --- lookup and lock ---
    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any) -> int:
        return self._submit("lookup", self._lookup, _empty_bitmap, keys, [])

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._lookup_done.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        with self._lock:
            for k in keys:
                n = self._locked.get(k, 0)
                if n <= 1:
                    self._locked.pop(k, None)
                else:
                    self._locked[k] = n - 1

    def _lookup(self, keys: list[Any], _objects: list[Any]) -> Any:
        bitmap = Bitmap(len(keys))
        client = self.link.get()
        if client is None:
            self._count("lookups_skipped_down")
            return bitmap
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self.namespaces.of(k), []).append(i)
        found: list[int] = []
        for ns, idx in groups.items():
            hits = self._hits(client, ns, [chunk_key(keys[i]) for i in idx])
            if hits is None:
                break
            found.extend(i for i, hit in zip(idx, hits, strict=True) if hit)
        with self._lock:
            for i in found:
                bitmap.set(i)
                self._locked[keys[i]] = self._locked.get(keys[i], 0) + 1
        return bitmap

    def _hits(self, client: KVCacheClient, ns: str, ks: list[bytes]) -> list[bool] | None:
        """Per key, whether kvsvc holds it: from the presence index while it proves
        itself current, else one Lookup (how many leading keys are held); None when
        kvsvc failed (every key absent)."""
        local = self._index_hits(client, ns, ks)
        if local is not None:
            self._count("lookups_local")
            return self._with_recent(ns, ks, local)
        # A Lookup counts the leading keys held: after the first absent one, the
        # keys behind it are asked again (at most MAX_SKIPS times, all within
        # lookup_timeout_s), so the bitmap is per key, as LMCache's is.
        hits = [False] * len(ks)
        deadline = time.monotonic() + self.cfg.lookup_timeout_s
        start, skips = 0, 0
        while start < len(ks) and skips <= MAX_SKIPS:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                n = client.lookup(ks[start:], namespace=ns, timeout=left)
            except DeadlineExceeded as exc:
                self._count("lookup_timeouts")
                self._slow_lookups += 1
                if self._slow_lookups >= SLOW_LOOKUPS:
                    self._failed("lookup", exc)
                return None if start == 0 else hits
            except KVServiceError as exc:
                self._failed("lookup", exc)
                return None
            self._slow_lookups = 0
            self._count("lookups_rpc")
            hits[start : start + n] = [True] * n
            start, skips = start + n + 1, skips + 1
        return hits

    def _remember(self, keys: list[Any]) -> None:
        until = time.monotonic() + RECENT_S
        with self._lock:
            for k in keys:
                rk = (self.namespaces.of(k), chunk_key(k))
                self._recent.pop(rk, None)
                self._recent[rk] = until
            while len(self._recent) > RECENT_KEYS:
                self._recent.popitem(last=False)

    def _with_recent(self, ns: str, ks: list[bytes], hits: list[bool]) -> list[bool]:
        """``hits`` with the keys this adapter stored in the last RECENT_S seconds."""
        if not self._recent:
            return hits
        now = time.monotonic()
        with self._lock:
            while self._recent and next(iter(self._recent.values())) < now:
                self._recent.popitem(last=False)
            return [h or (ns, k) in self._recent for h, k in zip(hits, ks, strict=True)]

    def _index_hits(self, client: KVCacheClient, ns: str, ks: list[bytes]) -> list[bool] | None:
        if not self.cfg.presence:
            return None
        if self._index_client is not client:
            self._indexes, self._index_client = {}, client
        index = self._indexes.get(ns)
        if index is None:
            try:
                index = self._indexes[ns] = client.presence(ns)
            except (KVServiceError, OSError, RuntimeError) as exc:
                self.warn.warning("kvsvc presence index not opened (%s): Lookup RPCs", exc)
                self._indexes[ns] = False
                return None
        if index is False:
            return None
        hits: list[bool] | None = index.hits(ks)
        return hits

    # --- load ---
    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit("load", self._load, _empty_bitmap, keys, objects)

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._load_done.pop(task_id, None)

    def _load(self, keys: list[Any], objects: list[Any]) -> Any:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        bitmap = Bitmap(len(keys))
        if not keys:
            return bitmap
        if self.link.get() is None:
            self._count("loads_skipped_down")
            return bitmap
        loaded: list[int] = []
        for (ns, size), idx in self._groups(keys, objects).items():
            lane = self._lane("load", size)
            if lane is None:
                continue
            got = self._load_group(lane, ns, [keys[i] for i in idx], [objects[i] for i in idx])
            loaded.extend(i for i, ok in zip(idx, got, strict=True) if ok)
        for i in loaded:
            bitmap.set(i)
        if loaded:
            self._notify_keys_accessed([keys[i] for i in loaded])
            self._count("objects_loaded", len(loaded))
        return bitmap

    def _load_group(self, lane: Lane, ns: str, keys: list[Any], objects: list[Any]) -> list[bool]:
        """Per object, whether it was loaded and verified: Retrieved into the lane's
        slots a piece at a time, the verified ones copied out into LMCache's object.
        A miss (or a chunk that failed its checksum) ends its piece; the objects
        after it are tried again, up to MAX_SKIPS times per task."""
        out = [False] * len(keys)
        cfg = self.cfg
        deadline = time.monotonic() + cfg.load_timeout_s
        targets = [object_bytes(o) for o in objects]
        todo = [
            j for j, t in enumerate(targets) if t is not None and t.numel() == lane.object_bytes
        ]
        skips = 0
        with lane.lock:
            got = mapped(lane, self.link, self.namespaces.staging(), cfg.fence_timeout_s)
            if got is None:
                return out
            client, mapping = got
            staged = lane.staging.tensor
            while todo and time.monotonic() < deadline:
                batch, todo = todo[: lane.slots], todo[lane.slots :]
                pending = []
                for a in range(0, len(batch), lane.piece(cfg.piece_mib)):
                    b = min(a + lane.piece(cfg.piece_mib), len(batch))
                    chunks = [(chunk_key(keys[batch[s]]), [s]) for s in range(a, b)]
                    left = max(deadline - time.monotonic(), 0.001)
                    f = client.retrieve_async(mapping, chunks, namespace=ns, timeout=left)
                    pending.append((a, b, f))
                errors: list[BaseException] = []
                retry: list[int] = []
                for a, b, f in pending:
                    try:
                        r = f.result(max(deadline - time.monotonic(), 0) + BACKSTOP_S)
                    except (KVServiceError, FutureTimeout) as exc:
                        errors.append(exc)
                        continue
                    n = min(int(r.loaded_chunks), b - a)
                    for s in range(a, a + n):
                        target = targets[batch[s]]
                        assert target is not None
                        target.copy_(staged[s])
                        out[batch[s]] = True
                    if a + n < b:
                        skips += 1
                        retry.extend(batch[a + n + 1 : b])
                if errors:
                    self._after_failure(lane, client, mapping, errors[0], "retrieve")
                    break
                if skips > MAX_SKIPS:
                    self._count("loads_cut_short")
                    break
                todo = retry + todo
        return out

    # --- shared steps ---
    def _groups(self, keys: list[Any], objects: list[Any]) -> dict[tuple[str, int], list[int]]:
        """Positions of the objects per (namespace, byte size), in order: one
        Store/Retrieve names one namespace, one lane holds one size."""
        out: dict[tuple[str, int], list[int]] = {}
        for i, (k, o) in enumerate(zip(keys, objects, strict=True)):
            out.setdefault((self.namespaces.of(k), int(o.get_size())), []).append(i)
        return out

    def _lane(self, direction: str, size: int) -> Lane | None:
        lane = self._lanes.get((direction, size))
        if lane is not None:
            return lane
        sizes = {s for d, s in self._lanes if d == direction}
        if len(sizes) >= self.cfg.max_object_sizes or size <= 0:
            self._count("objects_of_unstaged_size")
            self.warn.warning(
                "kvsvc: objects of %d bytes: %s lanes exist for %d sizes already "
                "(max_object_sizes): failed stores, misses",
                size,
                direction,
                len(sizes),
            )
            return None
        lane = make_lane(direction, size, self.cfg.staging_mib << 20)
        with self._lock:
            self._lanes[(direction, size)] = lane
        return lane

    def _after_failure(
        self,
        lane: Lane,
        client: KVCacheClient,
        mapping: MappingHandle,
        exc: BaseException,
        what: str,
    ) -> None:
        """After a failed transfer: bar the lane while a copy of it may still run (a
        Fence lifts the bar), else count kvsvc as down; a plain miss counts as nothing."""
        ids = client.unproven_transfers(mapping)
        if ids or isinstance(exc, FutureTimeout):
            lane.bar(mapping, ids)
            self._count("lanes_barred")
            self._failed(f"{what} (unproven: lane {lane.name} barred until a Fence)", exc)
        elif not isinstance(exc, Miss):
            lane.mapping = None
            self._failed(what, exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        self._count("kvsvc_failures")
        self._slow_lookups = 0
        with self._lock:
            self._recent.clear()  # kvsvc may come back empty
        self.link.failed()
        for lane in list(self._lanes.values()):
            lane.mapping = None
        self.warn.warning(
            "kvsvc %s failed (%s: %s): misses for %.1f s",
            what,
            type(exc).__name__,
            getattr(exc, "message", exc),
            self.cfg.reconnect_interval_s,
        )

    # --- status ---
    def report_status(self) -> dict[str, Any]:
        """LMCache's status view: unhealthy while kvsvc counts as down or while a
        staging lane is barred (a copy into it is not proven ended)."""
        down_s = max(self.link.down_until - time.monotonic(), 0.0)
        barred = {
            lane.name: list(lane.barred_ids) for lane in self._lanes.values() if lane.barred_ids
        }
        with self._lock:
            counters = dict(self.counters)
            locked = len(self._locked)
        return {
            "is_healthy": not self._closed and down_s == 0 and not barred,
            "type": "KvsvcL2Adapter",
            "target": self.cfg.target,
            "namespace_prefix": self.cfg.namespace,
            "kvsvc_down_for_s": round(down_s, 3),
            "barred_lanes": barred,
            "unproven_transfers": sum(len(ids) for ids in barred.values()),
            "lanes": sorted(lane.name for lane in self._lanes.values()),
            "locked_key_count": locked,
            **counters,
        }

    def close(self) -> None:
        self._closed = True
        for pool in self._threads.values():
            # Queued tasks are dropped; running ones end by their deadlines.
            pool.shutdown(wait=True, cancel_futures=True)
        self.link.close()
        close_lanes(list(self._lanes.values()))
        self._lanes.clear()
        for efd in self._efds.values():
            with contextlib.suppress(OSError):
                efd.close()


def _failed_store(_n: int) -> Any:
    return L2StoreResult(False, 0)


def _empty_bitmap(n: int) -> Any:
    return Bitmap(n)


def _setup_logging(level: str) -> None:
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvsvc] %(message)s"))
        log.addHandler(handler)
        log.propagate = False


__all__ = ["KvsvcL2Adapter"]
