"""The transfer engine: runs copies on the copy threads (or, for small loop-safe
ones, on the event loop's thread), hands completions back to the event loop, and
tracks every copy that started until it ends, so that Fence can prove it finished
even after the client went away. What it knows of each copy and the rules every
copy follows are in :mod:`~kvsvc.server.data.ledger`; a copy whose parts arrive
while it runs is a :class:`~kvsvc.server.data.stream.Stream`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from kvsvc.errors import FINISHED, NOT_STARTED, UNKNOWN, FatalServerError, KVServiceError
from kvsvc.server.data.ledger import Transfer, TransferLedger
from kvsvc.server.data.stream import Stream
from kvsvc.server.data.workers import even_shares
from kvsvc.server.ops import failpoints

log = logging.getLogger(__name__)
T = TypeVar("T")
#: The most of a larger loop-safe copy the event loop's thread copies itself beside
#: the copy threads (one task's share): ~2 ms of the native loop, so other calls
#: wait no longer than one such call's own work; copies with bigger shares leave
#: the loop free.
LOOP_SHARE_MAX_BYTES = 16 << 20


def reply_budget(deadline: float) -> float:
    """Seconds a handler may wait and still get its error reply out before the
    client's deadline (a reply that lands after it is lost as DEADLINE_EXCEEDED)."""
    remaining = deadline - time.monotonic()
    return max(0.0, remaining - min(0.05, 0.1 * remaining))


class TransferEngine(TransferLedger):
    """Runs copies: ``run`` one whose pieces are all known, ``stream`` one whose parts
    come while it runs; ``fence`` waits for them; ``fail`` stops them all."""

    def __init__(self, threads: int, inline_max_bytes: int = 0) -> None:
        #: loop-safe copies up to this size run on the event loop's thread (``run``)
        self.inline_max_bytes = inline_max_bytes
        super().__init__(threads)

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

        Admitted if the deadline fits its bytes behind the pieces queued on the copy
        threads (not for a copy run here, which waits for none), and checked again
        when the first piece starts (queue time counts); once one has started, all run.
        Errors carry the right transfer_state.
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
        Every copy not run here alone is a :class:`Copy`.
        """
        share = loop_safe and self.loop_copies()
        inline = share and nbytes <= self.inline_max_bytes
        try:
            self.admit(transfer_id, deadline, nbytes, queued=not inline)
        except BaseException as exc:
            finalize(None, exc)
            raise
        if inline:
            return self._run_inline(transfer_id, nbytes, tasks, finalize)
        share = share and len(tasks) > 1 and nbytes <= LOOP_SHARE_MAX_BYTES * len(tasks)
        copy = Copy(self, transfer_id, mapping_id, nbytes, deadline, finalize)
        copy.start(tasks, share=share)
        try:
            # Awaited directly (a shield costs two more loop turns per copy): only this
            # call waits on ``reply``, and a cancel of it is read as "answered".
            await copy.transfer.reply
        except asyncio.CancelledError:
            copy.abandon()
            raise
        return copy.outcome()

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
            error = self.copy_failed(exc, transfer_id)
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

    def fail(self, exc: KVServiceError) -> None:
        """After a fatal failure (on the loop): refuse new copies, fail queued ones at
        once (NOT_STARTED), and answer the callers of stalled copies (UNKNOWN) now
        rather than at their deadlines. Running copies stay tracked for Fence."""
        self.mark_failed(exc)
        for f in self.workers.drain():
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
        return Stream.open(self, transfer_id, mapping_id, deadline, nbytes, tasks, finalize)


class Copy(Generic[T]):
    """One copy ``TransferEngine.run`` hands to the copy threads, from its start to
    its end: a ``Transfer`` in flight (what Fence waits for) and the state its
    pieces share across threads, kept under ``_lock``.

    The steps, in order: ``start`` queues the pieces (with a loop-shared copy, the
    loop's thread runs the first one itself, ``run_share``); each piece, ``piece``,
    runs on a copy thread, and the first one to start checks the deadline again;
    each piece's end, ``piece_done``, counts it down and hands the last one's end to
    the loop; ``finish``, on the loop, retires and finalizes the copy and lets the
    caller answer; ``outcome`` is that answer. ``abandon``: the call went away first.
    A fatal error of a piece is told (``tell_fatal``) whether or not anyone waits.
    """

    __slots__ = (
        "_deadline",
        "_ended",
        "_engine",
        "_finalize",
        "_futures",
        "_joining",
        "_lock",
        "_loop",
        "_nbytes",
        "_own",
        "_pending",
        "_refused",
        "transfer",
    )

    def __init__(
        self,
        engine: TransferLedger,
        transfer_id: str,
        mapping_id: str,
        nbytes: int,
        deadline: float | None,
        finalize: Callable[[list[T] | None, BaseException | None], None],
    ) -> None:
        """The copy, in flight from now (admitted already)."""
        loop = asyncio.get_running_loop()
        self._engine = engine
        self._loop = loop
        self._nbytes = nbytes
        self._deadline = deadline
        self._finalize = finalize
        self.transfer = Transfer(
            transfer_id, mapping_id, nbytes, loop.create_future(), loop.create_future()
        )
        engine.inflight[transfer_id] = self.transfer
        self._lock = threading.Lock()
        #: why the copy did not start, once its first piece found the deadline too close
        self._refused: KVServiceError | None = None
        self._pending = 0  # pieces that have not ended
        #: the loop's thread waits for the last pieces itself (``_ended`` wakes it: a
        #: bare lock, held until then, costs less to make and to wake than an Event)
        self._joining = False
        self._ended = threading.Lock()
        self._ended.acquire()
        #: the loop's thread's own piece (a shared copy's first), run outside the queue
        self._own: concurrent.futures.Future[T] | None = None
        self._futures: list[concurrent.futures.Future[T]] = []  # every piece, in order

    def start(self, tasks: Sequence[Callable[[], T]], *, share: bool) -> None:
        """Queue the pieces on the copy threads; ``share``: the loop's thread runs the
        first itself, and finishes the copy here if every piece has ended by then."""
        self._pending = len(tasks)
        own: concurrent.futures.Future[T] | None = None
        if share:
            own = concurrent.futures.Future()
            own.set_running_or_notify_cancel()
        self._own = own
        piece, submit = self.piece, self._engine.workers.submit
        transfer_id = self.transfer.transfer_id
        sizes = even_shares(self._nbytes, len(tasks))
        queued = [
            submit(functools.partial(piece, i, t), transfer_id, sizes[i])
            for i, t in enumerate(tasks)
            if own is None or i > 0
        ]
        self._futures = queued if own is None else [own, *queued]
        piece_done = self.piece_done
        for f in queued:
            f.add_done_callback(piece_done)
        if own is not None:
            if self.run_share(own, tasks[0], queued):
                self.finish()
            self.tell_fatal(own)

    def piece(self, index: int, task: Callable[[], T]) -> T:
        """(Copy thread, or the loop's for its share) Run piece ``index``: refused if
        the copy was, or after a fatal failure; the first to start checks the
        deadline again (queue time counts) and marks the copy started."""
        engine, transfer = self._engine, self.transfer
        with self._lock:
            if self._refused is not None:
                raise self._refused
            if engine.failed is not None:
                # Checked here, on the copy thread, before every piece: a fatal failure
                # decided a moment ago on another thread must stop a copy queued
                # behind it before it writes anything.
                raise engine.refusal(FINISHED if transfer.started_at else NOT_STARTED)
            first = not transfer.started_at
            if first:
                try:
                    engine.check_deadline(self._deadline, self._nbytes)
                except KVServiceError as exc:
                    self._refused = exc
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
            error = engine.copy_failed(exc, transfer.transfer_id)
            if error is exc:
                raise
            raise error from exc

    def run_share(
        self,
        own: concurrent.futures.Future[T],
        task: Callable[[], T],
        others: list[concurrent.futures.Future[T]],
    ) -> bool:
        """The loop's thread runs its share of the copy (piece 0, ``task``), then, if it
        succeeded and the copy threads' shares all run, waits for them (GIL
        released) about as long as its own share took: theirs are as big and
        started a hand-off later (one that is still queued may wait long: the loop
        does not). True: every piece has ended and the caller finishes the copy
        here, with no trip through ``call_soon_threadsafe``; False: the last copy
        thread hands the end back through the loop, as for any copy."""
        t0 = time.monotonic()
        try:
            own.set_result(self.piece(0, task))
        except BaseException as exc:  # noqa: BLE001 - read by collect, raised by run
            own.set_exception(exc)
        took = time.monotonic() - t0
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                return True
            # A failed share is told at once (the loop answers it), as on a copy thread.
            self._joining = own.exception() is None and all(f.running() or f.done() for f in others)
        if self._joining:
            self._ended.acquire(timeout=took)
        with self._lock:
            self._joining = False
            return self._pending == 0

    def piece_done(self, fut: concurrent.futures.Future[T]) -> None:
        """(Any thread) A queued piece has ended (or was cancelled): the last one wakes
        the loop's thread if it waits for it (``run_share``), else hands the end to
        the loop (``finish``)."""
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
            waited = last and self._joining
        if waited:
            self._ended.release()  # the loop's thread waits for this piece: it finishes
        elif last:
            self._loop.call_soon_threadsafe(self.finish)
        # Told after `finish` is queued, so a copy whose last piece failed is answered
        # with its own error, not as one that cannot be proven to end; told even if
        # the call was abandoned, since nobody else would tell.
        self.tell_fatal(fut)

    def tell_fatal(self, fut: concurrent.futures.Future[T]) -> None:
        """A piece that ended with a fatal error stops the server (``on_fatal``)."""
        exc = None if fut.cancelled() else fut.exception()
        if isinstance(exc, KVServiceError) and exc.fatal:
            self._engine.on_fatal(exc)

    def finish(self) -> None:
        """(Loop) Every piece has ended: the copy is no longer in flight, is finalized
        with its results or error, and Fence and the caller are let go."""
        engine, transfer = self._engine, self.transfer
        engine.retire(transfer.transfer_id)
        results, error = engine.collect(self._futures, transfer)
        try:
            self._finalize(results, error)
        finally:
            transfer.done.set_result(None)
            if not transfer.reply.done():
                transfer.reply.set_result(None)

    def abandon(self) -> None:
        """(Loop) The call was cancelled: pieces that have not started never will;
        started ones run to their end, stay in flight until then, and are finalized
        by ``finish``."""
        queued = [f for f in self._futures if f is not self._own]
        if not all([f.cancel() for f in queued]):  # a list: cancel every one
            self.transfer.abandoned = True
            log.warning(
                "transfer %s outlived its call; tracked until it ends", self.transfer.transfer_id
            )

    def outcome(self) -> list[T]:
        """(Loop, once ``reply`` is set) The results of every piece, or the error the
        caller answers with: the fatal failure it was given up on for, or the
        copy's own."""
        transfer = self.transfer
        if transfer.failure is not None:
            raise transfer.failure
        results, error = self._engine.collect(self._futures, transfer)
        if error is not None:
            raise error
        self._engine.rate.observe(self._nbytes, time.monotonic() - transfer.started_at)
        assert results is not None
        return results
