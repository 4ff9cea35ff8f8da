"""The transfer engine: runs copies on worker threads, hands completions back
to the event loop, and tracks every copy that started until it ends, so that
Fence can prove it finished even after the client went away.

A transfer id is the client's request id. Fence bars ids it has not seen, so a
request that arrives after its fence can never write into reused blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvsvc import failpoints
from kvsvc.errors import (
    FINISHED,
    NOT_STARTED,
    UNKNOWN,
    DeadlineExceeded,
    FatalServerError,
    InvalidRequest,
    KVServiceError,
    ServiceNotServing,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_REMEMBERED = 100_000  # completed and barred ids kept for Fence's answers


@dataclass
class Transfer:
    transfer_id: str
    mapping_id: str
    nbytes: int
    done: asyncio.Future[None]  # the copy has ended (what Fence waits for)
    reply: asyncio.Future[None]  # the handler may answer (copy ended, or given up on)
    started_at: float = 0.0  # monotonic time the copy began; 0 = queued
    thread: str = ""
    abandoned: bool = False  # the client's call ended while the copy ran
    failure: KVServiceError | None = None  # why the handler stopped waiting early


@dataclass
class _Rate:
    """Observed copy throughput, to refuse copies that cannot finish in time."""

    bytes_per_s: float = 1e9
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < 1 << 20 or seconds <= 0:
            return
        with self.lock:
            self.bytes_per_s = 0.8 * self.bytes_per_s + 0.2 * (nbytes / seconds)


def reply_budget(deadline: float) -> float:
    """Seconds a handler may wait and still get its error reply out before the
    client's deadline (a reply that lands after it is lost as DEADLINE_EXCEEDED)."""
    remaining = deadline - time.monotonic()
    return max(0.0, remaining - min(0.05, 0.1 * remaining))


class WorkerDied(BaseException):
    """Set on a copy's future when its worker thread died under it."""


class _Workers:
    """Copy threads. Unlike a ThreadPoolExecutor, a thread here can really die (an
    exception that is not an Exception escapes the copy); ``on_death`` is told."""

    def __init__(self, n: int, on_death: Callable[[str, BaseException], None]) -> None:
        self._queue: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._on_death = on_death
        self.threads = [
            threading.Thread(target=self._run, name=f"kvsvc-copy-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fut, fn))
        return fut

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - delivered to the caller via the future
                fut.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 - a dying thread reports, then dies
                fut.set_exception(WorkerDied(f"{threading.current_thread().name}: {exc!r}"))
                self._on_death(threading.current_thread().name, exc)
                return  # the thread dies, as a real crash would

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
                out.append(item[0])

    def shutdown(self) -> None:
        for _ in self.threads:
            self._queue.put(None)


class TransferEngine:
    def __init__(self, threads: int) -> None:
        self.inflight: dict[str, Transfer] = {}
        self._completed: OrderedDict[str, None] = OrderedDict()
        self._barred: OrderedDict[str, None] = OrderedDict()
        self.rate = _Rate()
        self.failed: KVServiceError | None = None
        #: Called (from any thread) with a fatal error: the server stops serving.
        self.on_fatal: Callable[[KVServiceError], None] = lambda exc: None
        self._workers = _Workers(threads, self._worker_died)

    def _remember(self, table: OrderedDict[str, None], tid: str) -> None:
        table[tid] = None
        if len(table) > _REMEMBERED:
            table.popitem(last=False)

    def check_deadline(self, deadline: float | None, nbytes: int) -> None:
        """Refuse (NOT_STARTED) a copy that cannot finish before ``deadline``."""
        if deadline is None:
            return
        remaining = deadline - time.monotonic()
        need = nbytes / self.rate.bytes_per_s
        if remaining <= need:
            raise DeadlineExceeded(
                f"{remaining * 1e3:.1f} ms left, the copy of {nbytes} bytes needs about "
                f"{need * 1e3:.1f} ms: not started",
                reason="DEADLINE_TOO_SHORT",
                metadata={"remainingMs": f"{remaining * 1e3:.1f}", "bytes": nbytes},
                transfer_state=NOT_STARTED,
            )

    async def run(
        self,
        transfer_id: str,
        mapping_id: str,
        nbytes: int,
        deadline: float | None,
        fn: Callable[[], T],
        finalize: Callable[[concurrent.futures.Future[T]], None],
    ) -> T:
        """Run ``fn`` on a worker; its exceptions carry the right transfer_state.

        ``finalize`` runs exactly once on the event loop when the copy has ended
        (or was refused), even if the caller's call was cancelled meanwhile: it is
        where the store commits or frees what the copy used.
        """
        try:
            self._admit(transfer_id, deadline, nbytes)
        except BaseException as exc:
            refused: concurrent.futures.Future[T] = concurrent.futures.Future()
            refused.set_exception(exc)
            finalize(refused)
            raise
        loop = asyncio.get_running_loop()
        transfer = Transfer(
            transfer_id, mapping_id, nbytes, loop.create_future(), loop.create_future()
        )
        self.inflight[transfer_id] = transfer

        def work() -> T:
            # Queue time counts: re-check the deadline when a worker picks it up.
            self.check_deadline(deadline, nbytes)
            transfer.started_at = time.monotonic()
            transfer.thread = threading.current_thread().name
            try:
                failpoints.hit("transfer.before_copy")
                result = fn()
            except KVServiceError as exc:
                if exc.transfer_state != NOT_STARTED:
                    exc.transfer_state = FINISHED
                raise
            except Exception as exc:
                # The worker itself failed mid-copy: the copy has stopped, but the
                # data path is broken, so this instance must stop serving.
                raise FatalServerError(
                    f"transfer worker failed: {type(exc).__name__}: {exc}",
                    reason="TRANSFER_WORKER_FAILED",
                    metadata={"transferId": transfer_id, "error": type(exc).__name__},
                    transfer_state=FINISHED,
                ) from exc
            self.rate.observe(nbytes, time.monotonic() - transfer.started_at)
            failpoints.hit("transfer.after_copy")
            return result

        def finished(f: concurrent.futures.Future[T]) -> None:
            del self.inflight[transfer_id]
            self._remember(self._completed, transfer_id)
            try:
                finalize(f)
            finally:
                transfer.done.set_result(None)
                if not transfer.reply.done():
                    transfer.reply.set_result(None)

        cf = self._workers.submit(work)
        cf.add_done_callback(lambda f: loop.call_soon_threadsafe(finished, f))
        try:
            await asyncio.shield(transfer.reply)
        except asyncio.CancelledError:
            # A copy that has not started never will; one that has runs to its end,
            # stays in `inflight` until then, and is finalized by `finished`.
            if not cf.cancel():
                transfer.abandoned = True
                log.warning("transfer %s outlived its call; tracked until it ends", transfer_id)
            raise
        if transfer.failure is not None:
            raise transfer.failure
        if cf.cancelled():
            raise self.failed or ServiceNotServing(
                "the copy was cancelled before it started", transfer_state=NOT_STARTED
            )
        try:
            return cf.result()
        except WorkerDied as exc:
            raise FatalServerError(
                f"the transfer worker died during the copy: {exc}",
                reason="TRANSFER_WORKER_DIED",
                metadata={"transferId": transfer_id},
                transfer_state=UNKNOWN,
            ) from exc

    def _admit(self, transfer_id: str, deadline: float | None, nbytes: int) -> None:
        if self.failed is not None:
            raise ServiceNotServing(
                f"transfers are refused after a fatal failure ({self.failed.reason})",
                metadata={"failureReason": self.failed.reason},
                transfer_state=NOT_STARTED,
            )
        if transfer_id in self._barred:
            raise InvalidRequest(
                f"transfer {transfer_id} was fenced before it arrived; it will never run",
                reason="TRANSFER_BARRED",
                metadata={"transferId": transfer_id},
                transfer_state=NOT_STARTED,
            )
        if transfer_id in self.inflight or transfer_id in self._completed:
            raise InvalidRequest(
                f"transfer id {transfer_id} was already used",
                reason="DUPLICATE_TRANSFER_ID",
                metadata={"transferId": transfer_id},
                transfer_state=NOT_STARTED,
            )
        self.check_deadline(deadline, nbytes)

    # --- failure ---
    def _worker_died(self, thread: str, exc: BaseException) -> None:
        log.critical("transfer worker %s died: %r", thread, exc)
        self.on_fatal(
            FatalServerError(
                f"transfer worker {thread} died: {exc!r}",
                reason="TRANSFER_WORKER_DIED",
                metadata={"thread": thread},
            )
        )

    def fail(self, exc: KVServiceError) -> None:
        """After a fatal failure (on the loop): refuse new copies, fail queued ones at
        once (NOT_STARTED), and answer the callers of stalled copies (UNKNOWN) now
        rather than at their deadlines. Running copies stay tracked for Fence."""
        if self.failed is None:
            self.failed = exc
        for f in self._workers.drain():
            f.cancel()  # its done-callback finalizes it and answers NOT_STARTED
        for t in self.inflight.values():
            if t.started_at and not t.reply.done():
                t.failure = FatalServerError(
                    f"copy {t.transfer_id} cannot be proven to finish: {exc.message}",
                    reason=exc.reason,
                    metadata={"transferId": t.transfer_id, "thread": t.thread},
                    transfer_state=UNKNOWN,
                )
                t.reply.set_result(None)

    async def fence(
        self, mapping_id: str, transfer_ids: Iterable[str], deadline: float | None
    ) -> tuple[int, int, list[str]]:
        """Wait for copies of ``mapping_id`` and of ``transfer_ids``.

        Returns (waited, barred, still_running): still_running is non-empty only
        when the deadline passed first.
        """
        waiting: dict[str, Transfer] = {}
        barred = 0
        for tid in transfer_ids:
            if tid in self.inflight:
                waiting[tid] = self.inflight[tid]
            elif tid not in self._completed and tid not in self._barred:
                self._remember(self._barred, tid)
                barred += 1
        if mapping_id:
            waiting.update(
                {t.transfer_id: t for t in self.inflight.values() if t.mapping_id == mapping_id}
            )
        if not waiting:
            return 0, barred, []
        timeout = None if deadline is None else reply_budget(deadline)
        await asyncio.wait([asyncio.shield(t.done) for t in waiting.values()], timeout=timeout)
        still = [tid for tid, t in waiting.items() if not t.done.done()]
        return len(waiting) - len(still), barred, still

    def stalled(self, stall_timeout: float) -> list[Transfer]:
        now = time.monotonic()
        return [
            t
            for t in list(self.inflight.values())
            if t.started_at and now - t.started_at > stall_timeout
        ]

    def workers_alive(self) -> int:
        return self._workers.alive()

    def shutdown(self) -> None:
        self._workers.shutdown()
