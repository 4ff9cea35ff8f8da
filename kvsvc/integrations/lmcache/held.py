"""Tasks held incomplete until kvsvc proves their copies ended (the direct path).

On the direct path kvsvc's server reads and writes LMCache's own L1 objects. A
task's L1 objects stay LMCache's task's (read-locked for a store, reserved for a
load) only until the task's result is given: then LMCache frees a failed load's
objects and releases a store's read locks, and may reuse that memory at once. So
a task with a Store or Retrieve whose end is not proven (its deadline passed, the
connection was lost mid-transfer, kvsvc stopped) is held: its result is kept and
its eventfd is not signalled until a Fence of those transfers answers (every copy
of them ended; an id the server had not seen is barred from ever starting), or
kvsvc answers with another server start, or the server process that took the L1
file is seen to have exited (the process that ran them is gone: a dead process
copies nothing, so a kvsvc killed for good proves it too, with no call). Then
the result is given: the objects whose transfers were proven, and nothing of the
held ones. ``report_status`` lists the held tasks and their transfer ids.

A ``Prover`` thread retries the proof every ``interval_s`` (each try bounded by
the fence timeout), so a held task completes as soon as kvsvc can answer."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsvc.client import MappingHandle
from kvsvc.errors import KVServiceError
from kvsvc.integrations.common import Link
from kvsvc.pidfds import ProcessWatch

log = logging.getLogger("kvsvc.lmcache")


@dataclass
class Unproven:
    """Transfers of one mapping whose end is not proven."""

    mapping: MappingHandle
    ids: list[str]
    #: The server process that may still run them (None: cannot be watched).
    server: ProcessWatch | None = None


@dataclass
class Held:
    """A task's result, given only once every ``Unproven`` of it is proven."""

    kind: str
    task_id: int
    result: Any
    unproven: list[Unproven]
    since: float = field(default_factory=time.monotonic)


class Prover:
    """Holds tasks and proves their transfers ended (Fence, a new server start, or
    the exit of the server process that ran them), then gives their results
    through ``finish(kind, task_id, result)``."""

    def __init__(
        self,
        link: Link,
        finish: Callable[[str, int, Any], None],
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.link = link
        self.finish = finish
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._held: dict[tuple[str, int], Held] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.proven = 0
        self.proven_by_exit = 0  # unproven transfer sets proven by the server's exit

    def hold(self, held: Held) -> None:
        ids = sorted({i for u in held.unproven for i in u.ids})
        log.warning(
            "kvsvc: %s task %d held incomplete (its L1 objects stay LMCache's) until "
            "kvsvc proves transfers %s ended",
            held.kind,
            held.task_id,
            ", ".join(ids) or "of its mapping",
        )
        with self._lock:
            self._held[(held.kind, held.task_id)] = held
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="kvsvc-l2-prover", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def status(self) -> dict[str, list[str]]:
        """Held tasks as ``"<kind> <id>"`` -> the transfer ids not proven ended."""
        with self._lock:
            return {
                f"{h.kind} {h.task_id}": sorted({i for u in h.unproven for i in u.ids})
                or ["<whole mapping>"]
                for h in self._held.values()
            }

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            with self._lock:
                held = list(self._held.values())
            if not held:
                if self._closed:
                    return
                continue
            for h in held:
                if self._closed:
                    return
                if self._prove(h):
                    with self._lock:
                        self._held.pop((h.kind, h.task_id), None)
                    self.proven += 1
                    log.info(
                        "kvsvc: %s task %d: its transfers proven ended after %.1f s; completed",
                        h.kind,
                        h.task_id,
                        time.monotonic() - h.since,
                    )
                    self.finish(h.kind, h.task_id, h.result)

    def _prove(self, h: Held) -> bool:
        """Whether every transfer of ``h`` is proven ended now (one try each)."""
        h.unproven = self._unproven_by_a_live_server(h)
        if not h.unproven:
            return True
        client = self.link.get()
        if client is None:
            return False
        left: list[Unproven] = []
        for u in h.unproven:
            try:
                info = client.server_info(timeout=self.timeout_s)
                if info.server_start_id != u.mapping.server_start_id:
                    continue  # another server start: the process that copied is gone
                client.fence(None if u.ids else u.mapping, u.ids, timeout=self.timeout_s)
            except KVServiceError as exc:
                log.debug("kvsvc: proof for %s task %d not yet (%s)", h.kind, h.task_id, exc)
                left.append(u)
        h.unproven = left
        return not left

    def _unproven_by_a_live_server(self, h: Held) -> list[Unproven]:
        """``h``'s unproven transfers, less those whose server process has exited:
        a dead process copies nothing, so they ended (no kvsvc call: it is down
        for good or restarted, either way not the process that copied)."""
        left = []
        for u in h.unproven:
            if u.server is not None and u.server.exited():
                log.warning(
                    "kvsvc: %s task %d: kvsvc's server process exited: its copies ended",
                    h.kind,
                    h.task_id,
                )
                self.proven_by_exit += 1
            else:
                left.append(u)
        return left

    def close(self) -> list[Held]:
        """Stops proving; the tasks still held (LMCache is shutting down: its
        controllers release their objects themselves, and a late copy can only
        land in the file kvsvc holds open)."""
        self._closed = True
        self._wake.set()
        with self._lock:
            held, self._held = list(self._held.values()), {}
        if self._thread is not None:
            with contextlib.suppress(RuntimeError):
                self._thread.join(self.timeout_s + 1)
        return held
