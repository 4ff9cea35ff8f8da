"""The offloading tier's transfers (tier.py), off vLLM's scheduler: two threads
(loads, stores) that run each job as Store or Retrieve by chunk ids against a
staging region of the tier's own: a sealed memfd (``make_sealed_memfd``) passed to
kvsvc by fd (``register_memfd``; the server never opens anything by name) and
mapped here, half its slots for loads and half for stores. A store copies its rows
from vLLM's primary view into store slots, then Stores them; a load Retrieves into
load slots, then copies the rows kvsvc proved loaded into vLLM's primary view.

Why a copy of our own rather than kvsvc mapping vLLM's memory: all vLLM hands a
tier is a memoryview (a shared file's mapping in a real engine, a private tensor in
vLLM's own tests, several files mapped back to back in vLLM 0.33); no public vLLM
API names memory behind it that another process can map. A row costs one memcpy
on the job's thread (the GIL released), never a dropped store.

kvsvc only ever writes the staging region, so a transfer whose outcome is unknown
(deadline passed mid-copy, connection lost) is answered failed at once: vLLM's
slots were never handed to the server. Its staging slots are held until a Fence by
the same server start proves the copy ended; mapping again (a reconnect, a
restart) passes the same staging region, or, while a held copy may still use it,
a new one (the old one is left to the server that still maps it)."""

from __future__ import annotations

import collections
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.client.fdpass import make_sealed_memfd
from kvsvc.client.kvcache import rank_context
from kvsvc.errors import UNKNOWN, BoundedLog, KVServiceError
from kvsvc.integrations.vllm.common import log
from kvsvc.integrations.vllm.config import VllmConnectorConfig
from kvsvc.integrations.vllm.link import LINK_ERRORS, Link
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: Jobs waiting per direction; past this kvsvc is too slow and jobs fail at once.
MAX_QUEUED = 256
#: Staging per direction: a job of more rows moves in batches of this many bytes
#: (at least one row, at most the primary tier's rows).
STAGING_BYTES = 64 << 20
#: Errors after which the mapping may be gone: map again (a restart forgets tokens).
_REMAP_REASONS = ("FD_TOKEN_UNKNOWN", "MAPPING_CLOSING")


@dataclass
class Job:
    """One vLLM TransferJob: kvsvc keys and the primary tier's chunk ids."""

    job_id: int
    keys: list[bytes]
    chunk_ids: list[int]
    load: bool
    req_id: str = ""
    queued: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    """What the tier reports for a job: how many keys, from the first, succeeded."""

    job: Job
    ok: int
    seconds: float
    nbytes: int


class Staging:
    """The tier's sealed memfd of ``2 * slots`` rows, mapped here; slots
    ``[0, slots)`` serve loads, ``[slots, 2 * slots)`` stores. ``take`` and ``give``
    run under the Mover's lock."""

    def __init__(self, slots: int, row_bytes: int) -> None:
        size = 2 * slots * row_bytes
        self.fd = make_sealed_memfd("kvsvc-vllm-tier-staging", size)
        try:
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.rows = np.frombuffer(self.mm, dtype=np.uint8).reshape(2 * slots, row_bytes)
        self.slots = slots
        self.free: dict[bool, collections.deque[int]] = {
            True: collections.deque(range(slots)),
            False: collections.deque(range(slots, 2 * slots)),
        }

    def take(self, load: bool, n: int) -> list[int]:
        free = self.free[load]
        return [free.popleft() for _ in range(min(n, len(free)))]

    def give(self, load: bool, slots: list[int]) -> None:
        self.free[load].extend(slots)

    def close_fd(self) -> None:
        """Kept to pass again after a reconnect; closed once replaced or closed (the
        server holds its own, the mapping here keeps the memory alive)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(eq=False)
class Held:
    """Staging slots a transfer of unknown outcome may still use, until a Fence."""

    staging: Staging
    load: bool
    slots: list[int]
    transfer_id: str
    start_id: str
    since: float = field(default_factory=time.monotonic)


class Mover:
    """The client, the mapping of the staging region, and the two job threads.
    ``rows``: vLLM's primary view as bytes, one row per chunk."""

    def __init__(
        self,
        cfg: VllmConnectorConfig,
        namespace: str,
        rows: np.ndarray,
        done: Callable[[Outcome], None],
    ) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.rows = rows
        self.row_bytes = int(rows.shape[1])
        self.slots = max(1, min(int(rows.shape[0]), STAGING_BYTES // max(self.row_bytes, 1)))
        self.done = done
        self.link = Link(cfg, cfg.fence_timeout_s)
        self.warn = BoundedLog(log, 10.0)
        self.lock = threading.Lock()  # the mapping, the staging slots and the queues
        self.map_lock = threading.Lock()  # one Map at a time
        self.mapping: MappingHandle | None = None
        self.staging: Staging | None = None
        self.queues: dict[bool, collections.deque[Job]] = {
            True: collections.deque(),
            False: collections.deque(),
        }
        self.busy: dict[bool, Job | None] = {True: None, False: None}
        self.held: list[Held] = []
        self.wake = {True: threading.Event(), False: threading.Event()}
        self.stop = threading.Event()
        #: Called by the store thread every round (the tier opens its presence index).
        self.on_idle: Callable[[], Any] | None = None
        self.threads = [
            threading.Thread(target=self._run, args=(load,), name=name, daemon=True)
            for load, name in ((True, "kvsvc-tier-load"), (False, "kvsvc-tier-store"))
        ]
        for t in self.threads:
            t.start()

    # --- the scheduler's side: O(1), never waits on kvsvc ---
    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when kvsvc is down or too far behind (then the
        caller answers it as failed at once)."""
        if self.stop.is_set() or time.monotonic() < self.link.down_until:
            return False
        with self.lock:
            queue = self.queues[job.load]
            if len(queue) >= MAX_QUEUED:
                return False
            queue.append(job)
            idle = self.busy[job.load] is None and len(queue) == 1
        if idle:  # a busy thread takes it next without a wake-up (fewer GIL hand-offs)
            self.wake[job.load].set()
        return True

    def pending(self) -> int:
        """Jobs queued or running."""
        with self.lock:
            return self._pending_locked()

    def drain(self, timeout: float) -> bool:
        """Wait (bounded) until no job is queued or running: then none touches
        vLLM's memory (a held transfer only ever touched staging)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.pending():
                return True
            time.sleep(0.005)
        return False

    def _pending_locked(self) -> int:
        return sum(map(len, self.queues.values())) + sum(b is not None for b in self.busy.values())

    # --- the job threads ---
    def _run(self, load: bool) -> None:
        wake = self.wake[load]
        while not self.stop.is_set():
            if not load:  # the store thread also fences and keeps the index open
                try:
                    self._fence()
                    if self.on_idle is not None:
                        self.on_idle()
                except Exception as exc:  # noqa: BLE001 - the thread must keep going
                    self.warn.warning("kvsvc tier: %s: %s", type(exc).__name__, exc)
            wake.wait(self.cfg.reconnect_interval_s / 2)
            wake.clear()
            while not self.stop.is_set():
                with self.lock:
                    job = self.queues[load].popleft() if self.queues[load] else None
                    self.busy[load] = job
                if job is None:
                    break
                try:
                    self._do(job)
                except Exception as exc:  # noqa: BLE001 - the thread must keep going
                    self.warn.warning("kvsvc tier: %s: %s", type(exc).__name__, exc)
                    self._answer(job, 0)
                finally:
                    with self.lock:
                        self.busy[load] = None

    def _answer(self, job: Job, ok: int) -> None:
        self.done(Outcome(job, ok, time.monotonic() - job.queued, ok * self.row_bytes))

    def _do(self, job: Job) -> None:
        """The job in batches of at most ``slots`` rows; stops at the first batch
        that does not complete (a load answers the leading rows it copied)."""
        if not job.keys:
            self._answer(job, 0)
            return
        deadline = job.queued + (self.cfg.load_timeout_s if job.load else self.cfg.store_timeout_s)
        mapped = self._mapping()
        client = self.link.client
        ok = 0
        if mapped is not None and client is not None:
            mapping, staging = mapped
            for at in range(0, len(job.keys), self.slots):
                keys = job.keys[at : at + self.slots]
                chunks = job.chunk_ids[at : at + self.slots]
                moved = self._batch(client, mapping, staging, job, keys, chunks, deadline)
                ok += moved
                if moved < len(keys):
                    break
        self._answer(job, ok)

    def _batch(
        self,
        client: KVCacheClient,
        mapping: MappingHandle,
        staging: Staging,
        job: Job,
        keys: list[bytes],
        chunks: list[int],
        deadline: float,
    ) -> int:
        """One batch through staging slots; how many of its rows, from the first,
        moved. Not started (0) past the deadline or with no free slot."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return 0
        with self.lock:
            slots = staging.take(job.load, len(keys))
        if len(slots) < len(keys):  # held by transfers of unknown outcome
            with self.lock:
                staging.give(job.load, slots)
            self.warn.warning("kvsvc tier: staging slots held by unproven copies; a miss")
            return 0
        pairs = [(k, [s]) for k, s in zip(keys, slots, strict=True)]
        try:
            if job.load:
                r: Any = client.retrieve(mapping, pairs, timeout=remaining)
                got = min(int(r.loaded_chunks), len(keys))
                for s, c in zip(slots[:got], chunks[:got], strict=True):
                    self.rows[c] = staging.rows[s]
            else:
                for s, c in zip(slots, chunks, strict=True):
                    staging.rows[s] = self.rows[c]
                client.store(mapping, pairs, timeout=remaining)
                got = len(keys)
        except KVServiceError as exc:
            if not self._failed(job, mapping, staging, slots, exc):
                with self.lock:
                    staging.give(job.load, slots)
            return 0
        with self.lock:
            staging.give(job.load, slots)
        return got

    def _failed(
        self,
        job: Job,
        mapping: MappingHandle,
        staging: Staging,
        slots: list[int],
        exc: KVServiceError,
    ) -> bool:
        """Note a failed batch; True when its slots are now held (outcome unknown)."""
        if isinstance(exc, LINK_ERRORS) or exc.reason in _REMAP_REASONS:
            with self.lock:
                if self.mapping is mapping:
                    self.mapping = None
            self.link.failed()
        kind = "load" if job.load else "store"
        if getattr(exc, "transfer_state", UNKNOWN) == UNKNOWN:
            held = Held(staging, job.load, slots, exc.request_id or "", mapping.server_start_id)
            with self.lock:
                self.held.append(held)
            self.warn.warning(
                "kvsvc tier: a %s of %d chunks ended without proof (%s: %s); failed for "
                "vLLM now (kvsvc only had staging), its staging slots held until a Fence",
                kind,
                len(slots),
                type(exc).__name__,
                exc.message,
            )
            self.wake[False].set()
            return True
        self.warn.warning(
            "kvsvc tier %s failed (%s: %s); a miss for vLLM", kind, type(exc).__name__, exc.message
        )
        return False

    def _mapping(self) -> tuple[MappingHandle, Staging] | None:
        """The mapping and its staging, made now if there is none. The staging region
        is passed again as it is (the same memory: a server that maps it twice holds
        no more), unless a copy of unknown outcome may still use it: then a new one."""
        with self.lock:
            if self.mapping is not None and self.staging is not None:
                return self.mapping, self.staging
        with self.map_lock:
            with self.lock:
                if self.mapping is not None and self.staging is not None:
                    return self.mapping, self.staging
                staging = self.staging
                if staging is not None and any(h.staging is staging for h in self.held):
                    staging = None
            client = self.link.get()
            if client is None:
                return None
            if staging is None:
                try:
                    staging = Staging(self.slots, self.row_bytes)
                except OSError as exc:
                    self.warn.warning("kvsvc tier: no staging memfd (%s); tier misses", exc)
                    return None
            try:
                mapping = self._map(client, staging)
            except KVServiceError as exc:
                self.link.failed()
                self.warn.warning(
                    "kvsvc unreachable (%s: %s): tier misses; retrying every %.1f s",
                    type(exc).__name__,
                    exc.message,
                    self.cfg.reconnect_interval_s,
                )
                return None
            with self.lock:
                if self.staging is not None and self.staging is not staging:
                    self.staging.close_fd()  # the server keeps what it still maps
                self.mapping, self.staging = mapping, staging
                # Slots of an older staging region are no one's to give back.
                self.held = [h for h in self.held if h.staging is staging]
            log.info(
                "kvsvc tier: staging of 2 x %d rows mapped as %s (server start %s)",
                self.slots,
                mapping.mapping_id,
                mapping.server_start_id,
            )
            return mapping, staging

    def _map(self, client: KVCacheClient, staging: Staging) -> MappingHandle:
        timeout = self.cfg.fence_timeout_s
        token = client.register_memfd(staging.fd, timeout=timeout)
        rows = 2 * self.slots
        region = pb.RankRegion(
            context=rank_context(),
            tensors=[
                pb.KVTensor(
                    name="staging",
                    handle=pb.MemoryHandle(
                        sealed_memfd=pb.SealedMemfdHandle(
                            token=token, size_bytes=rows * self.row_bytes
                        )
                    ),
                    shape=[rows, self.row_bytes],
                    strides=[self.row_bytes, 1],
                    dtype=pb.DTYPE_UINT8,
                    block_dim=0,
                )
            ],
        )
        return client.map(self.namespace, [region], timeout=timeout)

    def _fence(self) -> None:
        """Give back held slots once a Fence by their server start proves their
        copies ended."""
        with self.lock:
            held = list(self.held)
        if not held:
            return
        client = self.link.get()
        if client is None:
            return
        try:
            result = client.fence(
                transfer_ids=[h.transfer_id for h in held if h.transfer_id],
                timeout=self.cfg.fence_timeout_s,
            )
        except KVServiceError as exc:
            self.warn.warning("kvsvc tier: fence failed (%s); slots stay held", exc.message)
            if isinstance(exc, LINK_ERRORS):
                self.link.failed()
            return
        proven = [h for h in held if h.start_id == result.server_start_id]
        with self.lock:
            self.held = [h for h in self.held if h not in proven]
            for h in proven:
                h.staging.give(h.load, h.slots)

    def close(self) -> None:
        self.stop.set()
        for w in self.wake.values():
            w.set()
        for t in self.threads:  # a call in flight ends by its deadline or with the client
            t.join(timeout=1.0)
        with self.lock:
            for q in self.queues.values():
                while q:
                    self._answer(q.popleft(), 0)
        self.link.close()
        with self.lock:
            if self.staging is not None:
                self.staging.close_fd()


__all__ = ["MAX_QUEUED", "STAGING_BYTES", "Job", "Mover", "Outcome", "Staging"]
