"""What the transfer engine knows of every copy, and the rules every copy follows,
however it runs (one ``run``, or a ``Stream`` of parts): the copies in flight and
the ids completed or barred (what Fence answers from), admission (fresh id, not
barred, time left for the copy), the one fatal failure after which nothing
starts, and how a copy's failure is described to its caller.

A transfer id is the client's request id. Fence bars ids it has not seen, so a
request that arrives after its fence can never write into reused blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvsvc.errors import (
    FINISHED,
    NOT_STARTED,
    UNKNOWN,
    Cancelled,
    DeadlineExceeded,
    FatalServerError,
    InvalidRequest,
    KVServiceError,
    ServiceNotServing,
)
from kvsvc.server.data.workers import CopyWorkers, WorkerDied

#: The engine's log, whichever of its modules writes.
log = logging.getLogger("kvsvc.server.data.engine")
T = TypeVar("T")
_REMEMBERED = 100_000  # completed and barred ids kept for Fence's answers


@dataclass
class Transfer:
    """One copy in flight: what Fence waits for and the handler answers from."""

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
class Rate:
    """Observed copy throughput, to refuse copies that cannot finish in time."""

    bytes_per_s: float = 1e9
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < 1 << 20 or seconds <= 0:
            return
        with self.lock:
            self.bytes_per_s = 0.8 * self.bytes_per_s + 0.2 * (nbytes / seconds)


class TransferLedger:
    """The state the engine's ways of copying share (``TransferEngine`` is one)."""

    def __init__(self, threads: int) -> None:
        self.inflight: dict[str, Transfer] = {}
        self._completed: OrderedDict[str, None] = OrderedDict()
        self._barred: OrderedDict[str, None] = OrderedDict()
        self.rate = Rate()
        self.failed: KVServiceError | None = None
        self._fail_lock = threading.Lock()
        #: Called (from any thread) with a fatal error: the server stops serving.
        self.on_fatal: Callable[[KVServiceError], None] = lambda exc: None
        self.workers = CopyWorkers(threads, self._worker_died)

    def _remember(self, table: OrderedDict[str, None], tid: str) -> None:
        table[tid] = None
        if len(table) > _REMEMBERED:
            table.popitem(last=False)

    def retire(self, transfer_id: str) -> None:
        """The copy has ended: no longer in flight, Fence answers FINISHED for it."""
        del self.inflight[transfer_id]
        self._remember(self._completed, transfer_id)

    def check_deadline(self, deadline: float | None, nbytes: int, ahead: int = 0) -> None:
        """Refuse (NOT_STARTED) a copy that cannot finish before ``deadline``, after
        the ``ahead`` bytes queued before it (on the copy threads, a stream's earlier
        parts) are copied."""
        if deadline is None:
            return
        remaining = deadline - time.monotonic()
        need = (nbytes + ahead) / self.rate.bytes_per_s
        if remaining <= need:
            after = f" after the {ahead} bytes queued ahead of it" if ahead else ""
            metadata: dict[str, object] = {"remainingMs": f"{remaining * 1e3:.1f}", "bytes": nbytes}
            if ahead:
                metadata["queuedBytes"] = ahead
            raise DeadlineExceeded(
                f"{remaining * 1e3:.1f} ms left, the copy of {nbytes} bytes{after} needs "
                f"about {need * 1e3:.1f} ms: not started",
                reason="DEADLINE_TOO_SHORT",
                metadata=metadata,
                transfer_state=NOT_STARTED,
            )

    def admit(
        self, transfer_id: str, deadline: float | None, nbytes: int, *, queued: bool = True
    ) -> None:
        """Refuse (NOT_STARTED) a copy that may not start: after a fatal failure, with
        an id fenced before it came or used before, or without the time it needs
        behind the pieces queued on the copy threads (``queued``: it joins that
        queue; a copy run on the loop's thread does not wait for it)."""
        if self.failed is not None:
            raise self.refusal(NOT_STARTED)
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
        self.check_deadline(deadline, nbytes, ahead=self.workers.queued() if queued else 0)

    def state_of(self, transfer_id: str) -> int:
        """What is known of a copy whose call stopped waiting for it: UNKNOWN while a
        piece may still write, FINISHED once none runs, NOT_STARTED if none began."""
        t = self.inflight.get(transfer_id)
        if t is None:
            return FINISHED if transfer_id in self._completed else NOT_STARTED
        return UNKNOWN if t.started_at or t.abandoned else NOT_STARTED

    # --- failure ---
    def mark_failed(self, exc: KVServiceError) -> None:
        """From any thread, at the moment a fatal failure is decided: no piece starts
        after this (the first failure is the one kept). The loop's ``fail`` does the rest."""
        with self._fail_lock:
            if self.failed is None:
                self.failed = exc

    def _worker_died(self, thread: str, exc: BaseException) -> None:
        log.critical("transfer worker %s died: %r", thread, exc)
        fatal = FatalServerError(
            f"transfer worker {thread} died: {exc!r}",
            reason="TRANSFER_WORKER_DIED",
            metadata={"thread": thread},
        )
        self.mark_failed(fatal)
        self.on_fatal(fatal)

    def copy_failed(self, exc: Exception, transfer_id: str) -> KVServiceError:
        """What a copy that raised ``exc`` after it started is answered with; a fatal
        one is marked at once, from the thread that saw it."""
        if isinstance(exc, KVServiceError):
            if exc.transfer_state != NOT_STARTED:
                exc.transfer_state = FINISHED
            if exc.fatal:  # e.g. DataLoss: nothing queued may start after it
                self.mark_failed(exc)
            return exc
        # The copy failed midway: it has stopped, but the data path is broken, so
        # this instance must stop serving.
        fatal = FatalServerError(
            f"transfer worker failed: {type(exc).__name__}: {exc}",
            reason="TRANSFER_WORKER_FAILED",
            metadata={"transferId": transfer_id, "error": type(exc).__name__},
            transfer_state=FINISHED,
        )
        self.mark_failed(fatal)
        return fatal

    def collect(
        self, futures: list[concurrent.futures.Future[T]], transfer: Transfer
    ) -> tuple[list[T] | None, BaseException | None]:
        """Results of every piece, or the error that describes the copy best."""
        errors: list[BaseException] = []
        cancelled = 0
        for f in futures:
            if f.cancelled():
                cancelled += 1
            elif (e := f.exception()) is not None:
                errors.append(e)
        died = [e for e in errors if isinstance(e, WorkerDied)]
        if died:
            err: BaseException = FatalServerError(
                f"the transfer worker died during the copy: {died[0]}",
                reason="TRANSFER_WORKER_DIED",
                metadata={"transferId": transfer.transfer_id},
                transfer_state=UNKNOWN,
            )
            err.__cause__ = died[0]
            return None, err
        if errors:
            fatal = [e for e in errors if getattr(e, "fatal", False)]
            return None, (fatal or errors)[0]
        if cancelled:
            state = FINISHED if transfer.started_at else NOT_STARTED
            return None, (
                ServiceNotServing(
                    f"copy cancelled after a fatal failure ({self.failed.reason})",
                    metadata={"failureReason": self.failed.reason},
                    transfer_state=state,
                )
                if self.failed is not None
                else Cancelled("copy cancelled before it ran", transfer_state=state)
            )
        return [f.result() for f in futures], None

    def refusal(self, state: int) -> ServiceNotServing:
        """What a copy is refused with after the fatal failure (``failed``)."""
        assert self.failed is not None
        return ServiceNotServing(
            f"transfers are refused after a fatal failure ({self.failed.reason})",
            metadata={"failureReason": self.failed.reason},
            transfer_state=state,
        )

    def stalled(self, stall_timeout: float) -> list[tuple[str, str, float]]:
        """(thread, transfer id, seconds) of copy pieces running past ``stall_timeout``."""
        now = time.monotonic()
        return [
            (thread, tid, now - t0)
            for thread, (tid, t0) in list(self.workers.running.items())
            if now - t0 > stall_timeout
        ]

    def workers_alive(self) -> int:
        return self.workers.alive()

    def shutdown(self) -> None:
        self.workers.shutdown()
