"""The offloading tier's transfers (tier.py), off vLLM's scheduler: two threads
(loads, stores) that map vLLM's shared offload file into kvsvc once (passed by fd,
``register_memfd(shared_file=True)``; the server never opens it by name) and run
each job as one Store or Retrieve by chunk ids. The scheduler only queues jobs and
drains results; a job kvsvc cannot take is answered at once as failed.

A transfer whose outcome is unknown (deadline passed mid-copy, connection lost)
is not answered: vLLM would reuse its primary slots while the server may still
copy. It is held until a Fence by the same server start proves it ended."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.client.kvcache import rank_context
from kvsvc.errors import UNKNOWN, BoundedLog, KVServiceError
from kvsvc.integrations.vllm.common import log
from kvsvc.integrations.vllm.config import VllmConnectorConfig
from kvsvc.integrations.vllm.link import LINK_ERRORS, Link
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: Jobs waiting per direction; past this kvsvc is too slow and jobs fail at once.
MAX_QUEUED = 256
#: Errors after which the mapping may be gone: map again (a restart forgets tokens).
_REMAP_REASONS = ("FD_TOKEN_UNKNOWN", "MAPPING_CLOSING")


@dataclass
class Job:
    """One vLLM TransferJob: kvsvc keys and the primary tier's chunk ids."""

    job_id: int
    keys: list[bytes]
    chunk_ids: list[int]
    load: bool
    queued: float = field(default_factory=time.monotonic)
    transfer_id: str = ""
    start_id: str = ""
    unproven_since: float = 0.0


@dataclass
class Outcome:
    """What the tier reports for a job: how many keys, from the first, succeeded."""

    job: Job
    ok: int
    seconds: float
    nbytes: int


class Mover:
    """The client, the mapping of vLLM's offload file, and the two job threads."""

    def __init__(
        self,
        cfg: VllmConnectorConfig,
        namespace: str,
        fd: int,
        num_chunks: int,
        row_bytes: int,
        done: Callable[[Outcome], None],
    ) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.fd = fd  # vLLM's offload file, ours (a dup): passed again after a restart
        self.region = pb.RankRegion(
            context=rank_context(),
            tensors=[
                pb.KVTensor(
                    name="offload",
                    handle=pb.MemoryHandle(
                        sealed_memfd=pb.SealedMemfdHandle(
                            token="", size_bytes=num_chunks * row_bytes
                        )
                    ),
                    shape=[num_chunks, row_bytes],
                    strides=[row_bytes, 1],
                    dtype=pb.DTYPE_UINT8,
                    block_dim=0,
                )
            ],
        )
        self.row_bytes = row_bytes
        self.done = done
        self.link = Link(cfg, cfg.fence_timeout_s)
        self.warn = BoundedLog(log, 10.0)
        self.lock = threading.Lock()  # the mapping and the queues
        self.map_lock = threading.Lock()  # one Map at a time
        self.mapping: MappingHandle | None = None
        self.queues: dict[bool, collections.deque[Job]] = {
            True: collections.deque(),
            False: collections.deque(),
        }
        self.busy: dict[bool, Job | None] = {True: None, False: None}
        self.unproven: list[Job] = []
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
        """Jobs queued or running (not those held unproven)."""
        with self.lock:
            return self._pending_locked()

    def drain(self, timeout: float) -> bool:
        """Wait (bounded) until no job is queued, running or unproven."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if not self.unproven and not self._pending_locked():
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

    def _answer(self, job: Job, ok: int, nbytes: int = 0) -> None:
        self.done(Outcome(job, ok, time.monotonic() - job.queued, nbytes))

    def _do(self, job: Job) -> None:
        deadline = self.cfg.load_timeout_s if job.load else self.cfg.store_timeout_s
        if time.monotonic() - job.queued > deadline:  # waited too long: not started
            self._answer(job, 0)
            return
        mapping = self._mapping()
        client = self.link.client
        if mapping is None or client is None:
            self._answer(job, 0)
            return
        chunks = [(k, [c]) for k, c in zip(job.keys, job.chunk_ids, strict=True)]
        try:
            if job.load:
                r: Any = client.retrieve(mapping, chunks, timeout=deadline)
                ok = int(r.loaded_chunks)
            else:
                r = client.store(mapping, chunks, timeout=deadline)
                ok = len(job.keys)
        except KVServiceError as exc:
            self._failed(job, mapping, exc)
            return
        self._answer(job, ok, ok * self.row_bytes)

    def _failed(self, job: Job, mapping: MappingHandle, exc: KVServiceError) -> None:
        if isinstance(exc, LINK_ERRORS) or exc.reason in _REMAP_REASONS:
            with self.lock:
                if self.mapping is mapping:
                    self.mapping = None
            self.link.failed()
        if getattr(exc, "transfer_state", UNKNOWN) == UNKNOWN:
            job.transfer_id = exc.request_id or ""
            job.start_id = mapping.server_start_id
            job.unproven_since = time.monotonic()
            with self.lock:
                self.unproven.append(job)
            log.warning(
                "kvsvc tier: a %s of %d chunks ended without proof (%s: %s); its slots "
                "stay held until a Fence proves the copy ended",
                "load" if job.load else "store",
                len(job.keys),
                type(exc).__name__,
                exc.message,
            )
            self.wake[False].set()
            return
        self.warn.warning(
            "kvsvc tier %s failed (%s: %s); a miss for vLLM",
            "load" if job.load else "store",
            type(exc).__name__,
            exc.message,
        )
        self._answer(job, 0)

    def _mapping(self) -> MappingHandle | None:
        """The mapping, made now if there is none (after a restart: the file passed
        again). None while kvsvc counts as down."""
        with self.lock:
            if self.mapping is not None:
                return self.mapping
        with self.map_lock:
            with self.lock:
                if self.mapping is not None:
                    return self.mapping
            client = self.link.get()
            if client is None:
                return None
            try:
                mapping = self._map(client)
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
                self.mapping = mapping
            log.info(
                "kvsvc tier: vLLM's offload file mapped as %s (server start %s)",
                mapping.mapping_id,
                mapping.server_start_id,
            )
            return mapping

    def _map(self, client: KVCacheClient) -> MappingHandle:
        timeout = self.cfg.fence_timeout_s
        token = client.register_memfd(self.fd, shared_file=True, timeout=timeout)
        region = pb.RankRegion()
        region.CopyFrom(self.region)
        region.tensors[0].handle.sealed_memfd.token = token
        return client.map(self.namespace, [region], timeout=timeout)

    def _fence(self) -> None:
        """Answer unproven jobs once a Fence by their server start proves they ended."""
        with self.lock:
            held = list(self.unproven)
        if not held:
            return
        client = self.link.get()
        if client is None:
            return
        try:
            result = client.fence(
                transfer_ids=[j.transfer_id for j in held if j.transfer_id],
                timeout=self.cfg.fence_timeout_s,
            )
        except KVServiceError as exc:
            self.warn.warning("kvsvc tier: fence failed (%s); slots stay held", exc.message)
            if isinstance(exc, LINK_ERRORS):
                self.link.failed()
            return
        proven = [j for j in held if j.start_id == result.server_start_id]
        for j in held:
            if j not in proven:
                self.warn.log(
                    logging.ERROR,
                    "kvsvc tier: a %s ran on server start %s, which is gone; no Fence can "
                    "prove it ended, so its %d slots stay held",
                    "load" if j.load else "store",
                    j.start_id,
                    len(j.keys),
                )
        with self.lock:
            self.unproven = [j for j in self.unproven if j not in proven]
        for j in proven:
            self._answer(j, 0)

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
        if self.fd >= 0:
            os.close(self.fd)  # the server holds its own while it maps the file
            self.fd = -1


__all__ = ["MAX_QUEUED", "Job", "Mover", "Outcome"]
