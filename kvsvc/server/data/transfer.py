"""The transfer engine: runs copies on worker threads, hands completions back
to the event loop, and tracks every copy that started until it ends, so that
Fence can prove it finished even after the client went away.

A transfer id is the client's request id. Fence bars ids it has not seen, so a
request that arrives after its fence can never write into reused blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
from kvsvc.server import failpoints

log = logging.getLogger(__name__)
T = TypeVar("T")
_REMEMBERED = 100_000  # completed and barred ids kept for Fence's answers
#: The most of a larger loop-safe copy the event loop's thread copies itself beside
#: the copy threads (one task's share): ~2 ms of the native loop, so other calls
#: wait no longer than one such call's own work; copies with bigger shares leave
#: the loop free.
LOOP_SHARE_MAX_BYTES = 16 << 20


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


_Item = tuple[concurrent.futures.Future[Any], Callable[[], Any], str]


def _name_os_thread(name: str) -> None:
    """Give the calling thread its Python name in the OS too (15 bytes: what
    ``top -H``, ``ps -L`` and /proc/PID/task/TID/comm show), so a copy thread's
    CPU can be told apart from outside the process; a no-op where prctl is missing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


class WorkerDied(BaseException):
    """Set on a copy's future when its worker thread died under it."""


class _Workers:
    """Copy threads. Unlike a ThreadPoolExecutor, a thread here can really die (an
    exception that is not an Exception escapes the copy); ``on_death`` is told."""

    def __init__(self, n: int, on_death: Callable[[str, BaseException], None]) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        #: thread name -> (transfer id, monotonic start) of the piece it is running
        self.running: dict[str, tuple[str, float]] = {}
        self._on_death = on_death
        self.threads = [
            threading.Thread(target=self._run, name=f"kvsvc-copy-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def submit(self, fn: Callable[[], T], transfer_id: str) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fut, fn, transfer_id))
        return fut

    def _run(self) -> None:
        me = threading.current_thread().name
        _name_os_thread(me)
        while (item := self._queue.get()) is not None:
            fut, fn, tid = item
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
                out.append(item[0])

    def shutdown(self) -> None:
        for _ in self.threads:
            self._queue.put(None)


class TransferEngine:
    def __init__(self, threads: int, inline_max_bytes: int = 0) -> None:
        #: loop-safe copies up to this size run on the event loop's thread (``run``)
        self.inline_max_bytes = inline_max_bytes
        self.inflight: dict[str, Transfer] = {}
        self._completed: OrderedDict[str, None] = OrderedDict()
        self._barred: OrderedDict[str, None] = OrderedDict()
        self.rate = _Rate()
        self.failed: KVServiceError | None = None
        self._fail_lock = threading.Lock()
        #: Called (from any thread) with a fatal error: the server stops serving.
        self.on_fatal: Callable[[KVServiceError], None] = lambda exc: None
        self._workers = _Workers(threads, self._worker_died)

    def _remember(self, table: OrderedDict[str, None], tid: str) -> None:
        table[tid] = None
        if len(table) > _REMEMBERED:
            table.popitem(last=False)

    def check_deadline(self, deadline: float | None, nbytes: int, ahead: int = 0) -> None:
        """Refuse (NOT_STARTED) a copy that cannot finish before ``deadline``, after
        the ``ahead`` bytes queued before it (a stream's earlier parts) are copied."""
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

    def loop_copies(self) -> bool:
        """Whether the event loop's thread may run copy pieces itself. Failpoints
        simulate faults of copy threads: one that sleeps, hangs or kills its
        thread would stop the whole loop, so with such a one loaded every piece
        goes to the copy threads (``raise`` ones fire on the loop alike)."""
        return self.inline_max_bytes > 0 and (
            not failpoints.ENABLED or failpoints.only_raises("transfer.")
        )

    async def run(
        self,
        transfer_id: str,
        mapping_id: str,
        nbytes: int,
        deadline: float | None,
        tasks: Sequence[Callable[[], T]],
        finalize: Callable[[list[T] | None, BaseException | None], None],
        *,
        loop_safe: bool = False,
    ) -> list[T]:
        """Run ``tasks`` (the pieces of one copy) in parallel on the workers.

        The deadline is checked when the first piece starts (queue time counts);
        once one has started, all run. Errors carry the right transfer_state.
        ``finalize(results, error)`` runs exactly once on the event loop when every
        piece has ended (or the copy was refused), even if the caller's call was
        cancelled meanwhile: it is where the store commits or frees its memory.

        ``loop_safe``: the tasks only copy memory that cannot shrink or block (a
        sealed memfd, the message's bytes). Such a copy of at most
        ``inline_max_bytes`` runs here, on the event loop's thread (the native loop
        drops the GIL): two thread hand-offs cost more than the copy of a few MiB.
        A larger one cut in tasks of at most ``LOOP_SHARE_MAX_BYTES`` is shared:
        this thread runs the first task while the copy threads run the others, then
        waits a little for them (GIL released) rather than idle until a copy thread
        hands the end back through the loop. ``inline_max_bytes`` 0: neither.
        """
        try:
            self._admit(transfer_id, deadline, nbytes)
        except BaseException as exc:
            finalize(None, exc)
            raise
        share = loop_safe and self.loop_copies()
        if share and nbytes <= self.inline_max_bytes:
            return self._run_inline(transfer_id, nbytes, tasks, finalize)
        share = share and len(tasks) > 1 and nbytes <= LOOP_SHARE_MAX_BYTES * len(tasks)
        loop = asyncio.get_running_loop()
        transfer = Transfer(
            transfer_id, mapping_id, nbytes, loop.create_future(), loop.create_future()
        )
        self.inflight[transfer_id] = transfer
        lock = threading.Lock()
        refused: list[KVServiceError] = []
        pending = [len(tasks)]
        #: the loop's thread waits for the last pieces itself (``ended`` wakes it: a
        #: bare lock, held until then, costs less to make and to wake than an Event)
        joining = [False]
        ended = threading.Lock()
        ended.acquire()

        def wrap(index: int, task: Callable[[], T]) -> Callable[[], T]:
            def work() -> T:
                with lock:
                    if refused:
                        raise refused[0]
                    if self.failed is not None:
                        # Checked here, on the copy thread, before every piece: a
                        # fatal failure decided a moment ago on another thread must
                        # stop a copy queued behind it before it writes anything.
                        raise self._refusal(FINISHED if transfer.started_at else NOT_STARTED)
                    first = not transfer.started_at
                    if first:
                        try:
                            self.check_deadline(deadline, nbytes)
                        except KVServiceError as exc:
                            refused.append(exc)
                            raise
                        transfer.started_at = time.monotonic()
                        transfer.thread = threading.current_thread().name
                try:
                    if first:
                        failpoints.hit("transfer.before_copy")
                    result = task()
                    if index == 0:
                        failpoints.hit("transfer.after_copy")
                    return result
                except Exception as exc:
                    error = self._copy_failed(exc, transfer_id)
                    if error is exc:
                        raise
                    raise error from exc

            return work

        def finished() -> None:
            del self.inflight[transfer_id]
            self._remember(self._completed, transfer_id)
            results, error = self._collect(futures, transfer)
            try:
                finalize(results, error)
            finally:
                transfer.done.set_result(None)
                if not transfer.reply.done():
                    transfer.reply.set_result(None)

        def tell_fatal(fut: concurrent.futures.Future[T]) -> None:
            exc = None if fut.cancelled() else fut.exception()
            if isinstance(exc, KVServiceError) and exc.fatal:
                self.on_fatal(exc)

        def piece_done(fut: concurrent.futures.Future[T]) -> None:
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
                waited = last and joining[0]
            if waited:
                ended.release()  # the loop's thread waits for this piece: it finishes
            elif last:
                loop.call_soon_threadsafe(finished)
            # Told after `finished` is queued, so a copy whose last piece failed is
            # answered with its own error, not as one that cannot be proven to end;
            # told even if the call was abandoned, since nobody else would tell.
            tell_fatal(fut)

        own: concurrent.futures.Future[T] | None = None
        if share:
            own = concurrent.futures.Future()
            own.set_running_or_notify_cancel()
        futures = [own] if own is not None else []
        futures += [
            self._workers.submit(wrap(i, t), transfer_id)
            for i, t in enumerate(tasks)
            if own is None or i > 0
        ]
        for f in futures[1:] if own is not None else futures:
            f.add_done_callback(piece_done)
        if own is not None:
            if self._run_share(own, wrap(0, tasks[0]), futures[1:], lock, pending, joining, ended):
                finished()
            tell_fatal(own)
        try:
            # Awaited directly (a shield costs two more loop turns per copy): only this
            # call waits on ``reply``, and a cancel of it is read as "answered".
            await transfer.reply
        except asyncio.CancelledError:
            # Pieces that have not started never will; started ones run to their
            # end, stay in `inflight` until then, and are finalized by `finished`.
            queued = [f for f in futures if f is not own]
            if not all([f.cancel() for f in queued]):  # a list: cancel every one
                transfer.abandoned = True
                log.warning("transfer %s outlived its call; tracked until it ends", transfer_id)
            raise
        if transfer.failure is not None:
            raise transfer.failure
        results, error = self._collect(futures, transfer)
        if error is not None:
            raise error
        self.rate.observe(nbytes, time.monotonic() - transfer.started_at)
        assert results is not None
        return results

    @staticmethod
    def _run_share(
        own: concurrent.futures.Future[T],
        work: Callable[[], T],
        others: list[concurrent.futures.Future[T]],
        lock: threading.Lock,
        pending: list[int],
        joining: list[bool],
        ended: threading.Lock,
    ) -> bool:
        """The loop's thread runs its share of a copy (``work``), then, if it succeeded
        and the copy threads' shares all run, waits for them (GIL released) about as
        long as its own share took: theirs are as big and started a hand-off later
        (one that is still queued may wait long: the loop does not). True: every
        piece has ended and the caller finishes the copy here, with no trip
        through ``call_soon_threadsafe``; False: the last copy thread hands the
        end back through the loop, as for any copy."""
        t0 = time.monotonic()
        try:
            own.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - read by _collect, raised by run
            own.set_exception(exc)
        took = time.monotonic() - t0
        with lock:
            pending[0] -= 1
            if pending[0] == 0:
                return True
            # A failed share is told at once (the loop answers it), as on a copy thread.
            joining[0] = own.exception() is None and all(f.running() or f.done() for f in others)
        if joining[0]:
            ended.acquire(timeout=took)
        with lock:
            joining[0] = False
            return pending[0] == 0

    def _copy_failed(self, exc: Exception, transfer_id: str) -> KVServiceError:
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

    def _run_inline(
        self,
        transfer_id: str,
        nbytes: int,
        tasks: Sequence[Callable[[], T]],
        finalize: Callable[[list[T] | None, BaseException | None], None],
    ) -> list[T]:
        """``run`` of a small loop-safe copy, on this thread: no queue, no future, no
        callback. Nothing on the loop runs while it copies, so nothing can see it
        half done: it is remembered as completed (Fence answers FINISHED) and its
        errors are those of a copy thread (a fatal one stops the server)."""
        self._remember(self._completed, transfer_id)
        started = time.monotonic()
        try:
            if failpoints.ENABLED:  # only ``raise`` ones (loop_copies)
                failpoints.hit("transfer.before_copy")
            results = [task() for task in tasks]
            if failpoints.ENABLED:
                failpoints.hit("transfer.after_copy")
        except Exception as exc:
            error = self._copy_failed(exc, transfer_id)
            try:
                finalize(None, error)
            finally:
                if error.fatal:
                    self.on_fatal(error)
            if error is exc:
                raise
            raise error from exc
        finalize(results, None)
        self.rate.observe(nbytes, time.monotonic() - started)
        return results

    def _collect(
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

    def _refusal(self, state: int) -> ServiceNotServing:
        assert self.failed is not None
        return ServiceNotServing(
            f"transfers are refused after a fatal failure ({self.failed.reason})",
            metadata={"failureReason": self.failed.reason},
            transfer_state=state,
        )

    def state_of(self, transfer_id: str) -> int:
        """What is known of a copy whose call stopped waiting for it: UNKNOWN while a
        piece may still write, FINISHED once none runs, NOT_STARTED if none began."""
        t = self.inflight.get(transfer_id)
        if t is None:
            return FINISHED if transfer_id in self._completed else NOT_STARTED
        return UNKNOWN if t.started_at or t.abandoned else NOT_STARTED

    def _admit(self, transfer_id: str, deadline: float | None, nbytes: int) -> None:
        if self.failed is not None:
            raise self._refusal(NOT_STARTED)
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

    def fail(self, exc: KVServiceError) -> None:
        """After a fatal failure (on the loop): refuse new copies, fail queued ones at
        once (NOT_STARTED), and answer the callers of stalled copies (UNKNOWN) now
        rather than at their deadlines. Running copies stay tracked for Fence."""
        self.mark_failed(exc)
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

    def stream(
        self,
        transfer_id: str,
        mapping_id: str,
        deadline: float | None,
        nbytes: int,
        tasks: Sequence[Callable[[], T]],
        finalize: Callable[[list[T] | None, BaseException | None], None],
    ) -> Stream:
        """A copy whose later parts are added while it runs (``Stream``), started with
        its first part, which is admitted as ``run`` admits a copy (refused:
        raised NOT_STARTED, ``finalize(None, error)`` called)."""
        try:
            self._admit(transfer_id, deadline, nbytes)
        except BaseException as exc:
            finalize(None, exc)
            raise
        loop = asyncio.get_running_loop()
        transfer = Transfer(transfer_id, mapping_id, 0, loop.create_future(), loop.create_future())
        self.inflight[transfer_id] = transfer
        stream = Stream(self, transfer, deadline)
        stream._start(nbytes, tasks, finalize)
        return stream

    def stalled(self, stall_timeout: float) -> list[tuple[str, str, float]]:
        """(thread, transfer id, seconds) of copy pieces running past ``stall_timeout``."""
        now = time.monotonic()
        return [
            (thread, tid, now - t0)
            for thread, (tid, t0) in list(self._workers.running.items())
            if now - t0 > stall_timeout
        ]

    def workers_alive(self) -> int:
        return self._workers.alive()

    def shutdown(self) -> None:
        self._workers.shutdown()


class Stream:
    """One copy whose pieces come in parts while it runs (a Retrieve whose chunks
    arrive from Redis group by group; ``TransferEngine.stream``): one transfer id
    and one ``Transfer`` in flight, which Fence waits for, from the first part
    until the last piece of the last part has ended. Parts run on the copy
    threads (queued in order) and each is admitted on the loop when added: once
    one is refused (closed, the deadline cannot fit it after the parts queued
    ahead of it, an earlier part failed, a fatal failure) no later one starts, so
    the parts that ran are a prefix."""

    def __init__(self, engine: TransferEngine, transfer: Transfer, deadline: float | None) -> None:
        self._engine = engine
        self.transfer = transfer
        self._deadline = deadline
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future[Any]] = []
        self._running = 0  # parts with pieces that have not ended
        #: bytes of the parts added that are not copied yet (each piece counts an even
        #: share of its part until it ends): what a part added now waits behind
        self._ahead = 0
        self._closed = False
        self._first = True  # the next piece to run is the transfer's first
        self.error: BaseException | None = None  # the first failure: raised by end()
        self.refused: KVServiceError | None = None  # why the last part did not start

    def add(
        self,
        nbytes: int,
        tasks: Sequence[Callable[[], T]],
        finalize: Callable[[list[T] | None, BaseException | None], None],
    ) -> bool:
        """On the loop: queue the next part; ``finalize(results, error)`` runs on the
        loop once when its pieces have all ended, or now when it is refused (False;
        ``refused`` says why when the deadline cannot fit it, ``error`` after a
        fatal failure)."""
        engine = self._engine
        if not self._closed and self.error is None and self.refused is None:
            if engine.failed is not None:
                self.error = engine._refusal(FINISHED)
            else:
                try:
                    engine.check_deadline(self._deadline, nbytes, ahead=self._ahead)
                except KVServiceError as exc:
                    self.refused = exc
                    log.info(
                        "transfer %s: a part of %d bytes not started (%s); the copy ends before it",
                        self.transfer.transfer_id,
                        nbytes,
                        exc.message,
                    )
        if self._closed or self.error is not None or self.refused is not None:
            finalize(None, self.error or self.refused)
            return False
        self._start(nbytes, tasks, finalize)
        return True

    def _start(
        self,
        nbytes: int,
        tasks: Sequence[Callable[[], T]],
        finalize: Callable[[list[T] | None, BaseException | None], None],
    ) -> None:
        engine, transfer = self._engine, self.transfer
        transfer.nbytes += nbytes
        pending = [len(tasks)]
        left = [nbytes]  # of this part's bytes, those of pieces that have not ended
        started = [0.0]

        def work(task: Callable[[], T]) -> T:
            with self._lock:
                if engine.failed is not None:
                    raise engine._refusal(FINISHED if transfer.started_at else NOT_STARTED)
                first, self._first = self._first, False
                if not started[0]:
                    started[0] = time.monotonic()
                if first:
                    transfer.started_at = started[0]
                    transfer.thread = threading.current_thread().name
            try:
                if first:
                    failpoints.hit("transfer.before_copy")
                result = task()
                if first:
                    failpoints.hit("transfer.after_copy")
                return result
            except Exception as exc:
                error = engine._copy_failed(exc, transfer.transfer_id)
                if error is exc:
                    raise
                raise error from exc

        def part_done() -> None:
            results, error = engine._collect(futures, transfer)
            try:
                finalize(results, error)
            finally:
                if error is not None:
                    self.error = self.error or error
                elif started[0]:
                    engine.rate.observe(nbytes, time.monotonic() - started[0])
                self._running -= 1
                self._finish_if_over()

        def piece_done(fut: concurrent.futures.Future[T]) -> None:
            with self._lock:
                pending[0] -= 1
                last = pending[0] == 0
                share = left[0] - nbytes * pending[0] // len(tasks)
                left[0] -= share
                self._ahead -= share
            if last:
                self._loop.call_soon_threadsafe(part_done)
            exc = None if fut.cancelled() else fut.exception()
            if isinstance(exc, KVServiceError) and exc.fatal:
                engine.on_fatal(exc)

        self._running += 1
        with self._lock:
            self._ahead += nbytes
        futures = [
            engine._workers.submit(functools.partial(work, t), transfer.transfer_id) for t in tasks
        ]
        self._futures += futures
        for f in futures:
            f.add_done_callback(piece_done)

    def _finish_if_over(self) -> None:
        transfer = self.transfer
        if self._closed and not self._running and not transfer.done.done():
            del self._engine.inflight[transfer.transfer_id]
            self._engine._remember(self._engine._completed, transfer.transfer_id)
            transfer.done.set_result(None)
            if not transfer.reply.done():
                transfer.reply.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """No part starts after this; end() raises ``exc`` (unless a part failed first)."""
        self.error = self.error or exc

    def close(self) -> None:
        """No part is added after this; the transfer ends with its last piece."""
        self._closed = True
        self._finish_if_over()

    def abandon(self) -> None:
        """The call ended (cancelled): queued pieces never start; running ones are
        tracked until they end, for Fence."""
        self.close()
        if not all([f.cancel() for f in self._futures if not f.done()]):
            self.transfer.abandoned = True
            log.warning(
                "transfer %s outlived its call; tracked until it ends", self.transfer.transfer_id
            )

    async def end(self) -> None:
        """Close, and wait until every part has ended; raises the first failure."""
        self.close()
        try:
            await self.transfer.reply
        except asyncio.CancelledError:
            self.abandon()
            raise
        if self.transfer.failure is not None:
            raise self.transfer.failure
        if self.error is not None:
            raise self.error
