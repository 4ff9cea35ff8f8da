"""The copy threads of the transfer engine. Unlike a ThreadPoolExecutor's, a thread
here can really die (an exception that is not an Exception escapes a copy): the
copy's future gets :class:`WorkerDied`, the engine is told, and the thread stays
listed as running what it ran, so the stall watchdog and Fence still see it."""

from __future__ import annotations

import concurrent.futures
import ctypes
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Item = tuple[concurrent.futures.Future[Any], Callable[[], Any], str, int]


def _name_os_thread(name: str) -> None:
    """Give the calling thread its Python name in the OS too (15 bytes: what
    ``top -H``, ``ps -L`` and /proc/PID/task/TID/comm show), so a copy thread's
    CPU can be told apart from outside the process; a no-op where prctl is missing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def even_shares(nbytes: int, n: int) -> list[int]:
    """``nbytes`` cut in ``n`` shares (a copy's bytes per task, as queued)."""
    return [nbytes // n + (i < nbytes % n) for i in range(n)]


class WorkerDied(BaseException):
    """Set on a copy's future when its worker thread died under it."""


class CopyWorkers:
    """``n`` copy threads taking pieces from one queue; ``on_death`` is told (from the
    dying thread) when one dies."""

    def __init__(self, n: int, on_death: Callable[[str, BaseException], None]) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        #: thread name -> (transfer id, monotonic start) of the piece it is running
        self.running: dict[str, tuple[str, float]] = {}
        #: bytes of the pieces queued (not started), in all and per transfer id: what a
        #: copy admitted now waits behind (TransferLedger.admit)
        self._queued_total = 0
        self._queued: dict[str, int] = {}
        self._bytes_lock = threading.Lock()
        self._on_death = on_death
        self.threads = [
            threading.Thread(target=self._run, name=f"kvsvc-copy-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def submit(
        self, fn: Callable[[], T], transfer_id: str, nbytes: int = 0
    ) -> concurrent.futures.Future[T]:
        """Queue a piece of ``transfer_id`` that copies ``nbytes``."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._bytes_lock:
            self._queued_total += nbytes
            self._queued[transfer_id] = self._queued.get(transfer_id, 0) + nbytes
        self._queue.put((fut, fn, transfer_id, nbytes))
        return fut

    def queued(self, besides: str = "") -> int:
        """Bytes of the pieces queued and not started, those of ``besides`` left out."""
        with self._bytes_lock:
            return self._queued_total - self._queued.get(besides, 0)

    def _dequeued(self, transfer_id: str, nbytes: int) -> None:
        with self._bytes_lock:
            self._queued_total -= nbytes
            left = self._queued.get(transfer_id, 0) - nbytes
            if left > 0:
                self._queued[transfer_id] = left
            else:
                self._queued.pop(transfer_id, None)

    def _run(self) -> None:
        me = threading.current_thread().name
        _name_os_thread(me)
        while (item := self._queue.get()) is not None:
            fut, fn, tid, nbytes = item
            self._dequeued(tid, nbytes)
            if not fut.set_running_or_notify_cancel():
                continue
            self.running[me] = (tid, time.monotonic())
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - delivered to the caller via the future
                fut.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 - a dying thread reports, then dies
                fut.set_exception(WorkerDied(f"{threading.current_thread().name}: {exc!r}"))
                self._on_death(me, exc)
                return  # the thread dies, as a real crash would (still listed as running)
            self.running.pop(me, None)

    def alive(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def drain(self) -> list[concurrent.futures.Future[Any]]:
        """Take every queued (not started) copy off the queue."""
        out: list[concurrent.futures.Future[Any]] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out
            if item is not None:
                self._dequeued(item[2], item[3])
                out.append(item[0])

    def shutdown(self) -> None:
        for _ in self.threads:
            self._queue.put(None)
