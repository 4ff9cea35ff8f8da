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
stores failed at once); then stores and loads reconnect and map their regions
again, while lookups stay absent until a probe proves kvsvc back (reconnect.py).

Data path, chosen at construction and said why: direct.py where LMCache's L1
arena is a shared file kvsvc can take (arena.py; ``--shm-name``): kvsvc's server
copies straight between its store and LMCache's objects, and a task whose copies
are not proven ended is held incomplete until they are (held.py); else
staging.py (one copy per batch into a staging region kvsvc maps once, lanes.py).
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmcache
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from kvsvc.client import KVCacheClient
from kvsvc.errors import BoundedLog, DeadlineExceeded, KVServiceError
from kvsvc.integrations.common import Link
from kvsvc.integrations.lmcache.arena import Arena, find_l1_file
from kvsvc.integrations.lmcache.config import MAX_SKIPS, LmcacheAdapterConfig
from kvsvc.integrations.lmcache.direct import DirectPath
from kvsvc.integrations.lmcache.held import Held, Prover, Unproven
from kvsvc.integrations.lmcache.keys import Namespaces, chunk_key
from kvsvc.integrations.lmcache.lanes import close_lanes
from kvsvc.integrations.lmcache.reconnect import Reconnect
from kvsvc.integrations.lmcache.staging import StagingPath

log = logging.getLogger("kvsvc.lmcache")

#: The LMCache releases this adapter was tested with, oldest and newest.
TESTED_RANGE = ("0.5.6", "0.5.6")
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
    """Any failure it is told of (a task's, a mapping's, a probe's) also makes
    lookups wait for the reconnect probe (``on_failed``)."""

    log = log
    on_failed: Callable[[], None] | None = None

    def failed(self) -> None:
        super().failed()
        if self.on_failed is not None:
            self.on_failed()


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
        self._locked: dict[Any, int] = {}
        self._indexes: dict[str, Any] = {}
        self._index_client: KVCacheClient | None = None
        self._slow_lookups = 0
        self._recent: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._closed = False
        self.counters: dict[str, int] = {}
        self.prover = Prover(self.link, self._finish, cfg.reconnect_interval_s, cfg.fence_timeout_s)
        self.reconnect = Reconnect(
            self.link, lambda exc: self._failed("reconnect", exc), cfg.fence_timeout_s
        )
        self.link.on_failed = self.reconnect.failed
        self.staging = StagingPath(self)
        self.arena: Arena | None = None
        self.direct: DirectPath | None = None
        found = find_l1_file(l1_memory_desc) if cfg.l1_direct else "l1_direct is false"
        if isinstance(found, str):
            self.staging_why = found
            log.info(
                "kvsvc L2 adapter: target %s, namespace prefix %s; data path: staging "
                "(%d MiB per lane), not direct: %s",
                cfg.target,
                cfg.namespace,
                cfg.staging_mib,
                found,
            )
        else:
            self.arena, self.staging_why = Arena(found), ""
            self.direct = DirectPath(self, self.arena)
            log.info(
                "kvsvc L2 adapter: target %s, namespace prefix %s; data path: direct "
                "(kvsvc copies LMCache's L1 objects in place, file %s)",
                cfg.target,
                cfg.namespace,
                found.path,
            )

    # --- eventfds ---
    def get_store_event_fd(self) -> int:
        return int(self._efds["store"].fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._efds["lookup"].fileno())

    def get_load_event_fd(self) -> int:
        return int(self._efds["load"].fileno())

    # --- tasks: queued on the kind's thread; a result and a signal always follow ---
    def _direct(
        self,
        direction: str,
        ns: str,
        size: int,
        idx: list[int],
        keys: list[Any],
        objects: list[Any],
        out: list[bool],
        unproven: list[Unproven],
    ) -> list[int]:
        """The positions of ``idx`` the direct path did not take (all of them
        without it): they go through the staging lanes."""
        if self.direct is None:
            return idx
        return self.direct.run(direction, ns, size, idx, keys, objects, out, unproven)

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
            if isinstance(result, Held):
                # Its L1 objects may still be copied: LMCache keeps them (the task
                # is not complete) until the prover gives the result.
                result.kind, result.task_id = kind, task_id
                self._count(f"{kind}_tasks_held")
                self.prover.hold(result)
            else:
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
        unproven: list[Unproven] = []
        for (ns, size), idx in self._groups(keys, objects).items():
            staged = self._direct("store", ns, size, idx, keys, objects, stored, unproven)
            if not staged:
                continue
            lane = self.staging.lane("store", size)
            if lane is None:
                continue
            got = self.staging.store(
                lane, ns, [keys[i] for i in staged], [objects[i] for i in staged]
            )
            for i, ok in zip(staged, got, strict=True):
                stored[i] = ok
        done = [i for i, ok in enumerate(stored) if ok]
        self._remember([keys[i] for i in done])
        if done:
            sizes = [int(objects[i].get_size()) for i in done]
            self._notify_keys_stored([keys[i] for i in done], sizes)
            self._count("objects_stored", len(done))
        nbytes = sum(int(objects[i].get_size()) for i in done)
        result = L2StoreResult(len(done) == len(keys), nbytes)
        return Held("store", 0, result, unproven) if unproven else result

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
        client = self.reconnect.client()
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
            self._count("lookup_calls")  # attempts, answered or not
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
        done = [False] * len(keys)
        unproven: list[Unproven] = []
        for (ns, size), idx in self._groups(keys, objects).items():
            staged = self._direct("load", ns, size, idx, keys, objects, done, unproven)
            if not staged:
                continue
            lane = self.staging.lane("load", size)
            if lane is None:
                continue
            got = self.staging.load(
                lane, ns, [keys[i] for i in staged], [objects[i] for i in staged]
            )
            for i, ok in zip(staged, got, strict=True):
                done[i] = ok
        loaded = [i for i, ok in enumerate(done) if ok]
        for i in loaded:
            bitmap.set(i)
        if loaded:
            self._notify_keys_accessed([keys[i] for i in loaded])
            self._count("objects_loaded", len(loaded))
        return Held("load", 0, bitmap, unproven) if unproven else bitmap

    # --- shared steps ---
    def _groups(self, keys: list[Any], objects: list[Any]) -> dict[tuple[str, int], list[int]]:
        """Positions of the objects per (namespace, byte size), in order: one
        Store/Retrieve names one namespace, one lane holds one size."""
        out: dict[tuple[str, int], list[int]] = {}
        for i, (k, o) in enumerate(zip(keys, objects, strict=True)):
            out.setdefault((self.namespaces.of(k), int(o.get_size())), []).append(i)
        return out

    def _failed(self, what: str, exc: BaseException | None) -> None:
        self._count("kvsvc_failures")
        self._slow_lookups = 0
        with self._lock:
            self._recent.clear()  # kvsvc may come back empty
        self.link.failed()
        for lane in list(self.staging.lanes.values()):
            lane.mapping = None
        if self.arena is not None:
            self.arena.forget()
        self.warn.warning(
            "kvsvc %s failed (%s: %s): misses for %.1f s",
            what,
            type(exc).__name__ if exc is not None else "no reply",
            getattr(exc, "message", exc),
            self.cfg.reconnect_interval_s,
        )

    # --- status ---
    def report_status(self) -> dict[str, Any]:
        """LMCache's status view: unhealthy while kvsvc counts as down, while a
        staging lane is barred (a copy into it is not proven ended) or while a task
        is held (direct path: its L1 objects may still be copied; held.py)."""
        down_s = max(self.link.down_until - time.monotonic(), 0.0)
        barred = {
            lane.name: list(lane.barred_ids)
            for lane in self.staging.lanes.values()
            if lane.barred_ids
        }
        held = self.prover.status()
        with self._lock:
            counters = dict(self.counters)
            locked = len(self._locked)
        arena = self.arena
        path = "direct" if arena is not None and not arena.refused else "staging"
        return {
            "is_healthy": not self._closed
            and down_s == 0
            and not self.reconnect.unproven
            and not barred
            and not held,
            "type": "KvsvcL2Adapter",
            "target": self.cfg.target,
            "namespace_prefix": self.cfg.namespace,
            "data_path": path,
            "staging_why": self.staging_why or (arena.refused if arena is not None else ""),
            "kvsvc_down_for_s": round(down_s, 3),
            "kvsvc_unproven": self.reconnect.unproven,
            "reconnect_probes": self.reconnect.probes,
            "barred_lanes": barred,
            "held_tasks": held,
            "proven_by_exit": self.prover.proven_by_exit,
            "unproven_transfers": sum(len(ids) for ids in barred.values())
            + sum(len(ids) for ids in held.values()),
            "lanes": sorted(lane.name for lane in self.staging.lanes.values()),
            "arena_mappings": sorted(arena.names()) if arena is not None else [],
            "locked_key_count": locked,
            **counters,
        }

    def close(self) -> None:
        self._closed = True
        for pool in self._threads.values():
            # Queued tasks are dropped; running ones end by their deadlines.
            pool.shutdown(wait=True, cancel_futures=True)
        held = self.prover.close()
        if held:
            # Never given: LMCache keeps their objects (its own shutdown releases
            # them); a late copy lands in the file kvsvc holds open.
            log.warning("kvsvc: closed with %d tasks held (copies not proven ended)", len(held))
        self.reconnect.close()
        self.link.close()
        close_lanes(list(self.staging.lanes.values()))
        self.staging.lanes.clear()
        if self.arena is not None:
            self.arena.close()
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
