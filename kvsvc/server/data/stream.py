"""The transfer engine's copy of parts (``TransferEngine.stream``): it starts before
its last part is known, admits each part, behind the work queued ahead of it, when
the part is added, and checks its deadline again when the part's first piece starts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvsvc.errors import FINISHED, NOT_STARTED, KVServiceError
from kvsvc.server.data.ledger import Transfer, TransferLedger
from kvsvc.server.data.workers import even_shares
from kvsvc.server.ops import failpoints

log = logging.getLogger("kvsvc.server.data.engine")  # the engine's log
T = TypeVar("T")


class Stream:
    """One copy whose pieces come in parts while it runs (a Retrieve whose chunks
    arrive from Redis group by group; ``TransferEngine.stream``): one transfer id
    and one ``Transfer`` in flight, which Fence waits for, from the first part
    until the last piece of the last part has ended. Parts run on the copy
    threads (queued in order) and each is admitted on the loop when added: once
    one is refused (closed, the deadline cannot fit it after the work queued
    ahead of it, an earlier part failed, a fatal failure) no later one starts, so
    the parts that ran are a prefix. A part's deadline is checked again when its
    first piece starts (it may have waited behind other copies): one refused then
    is finalized with the refusal and ends the prefix alike (a later part that a
    copy thread had already begun still ends, unreported); only the first part's
    refusal fails the stream, as a whole copy's would."""

    def __init__(self, engine: TransferLedger, transfer: Transfer, deadline: float | None) -> None:
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
        self._parts = 0  # parts started
        self._cut: int | None = None  # the first part refused as its first piece came
        self.error: BaseException | None = None  # the first failure: raised by end()
        self.refused: KVServiceError | None = None  # why the last part did not start

    @classmethod
    def open(
        cls,
        engine: TransferLedger,
        transfer_id: str,
        mapping_id: str,
        deadline: float | None,
        nbytes: int,
        tasks: Sequence[Callable[[], T]],
        finalize: Callable[[list[T] | None, BaseException | None], None],
    ) -> Stream:
        """The stream started with its first part, which is admitted as a whole copy
        is (refused: raised NOT_STARTED, ``finalize(None, error)`` called)."""
        try:
            engine.admit(transfer_id, deadline, nbytes)
        except BaseException as exc:
            finalize(None, exc)
            raise
        loop = asyncio.get_running_loop()
        transfer = Transfer(transfer_id, mapping_id, 0, loop.create_future(), loop.create_future())
        engine.inflight[transfer_id] = transfer
        stream = cls(engine, transfer, deadline)
        stream._start(nbytes, tasks, finalize)
        return stream

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
                self.error = engine.refusal(FINISHED)
            else:
                try:
                    queued = engine.workers.queued(besides=self.transfer.transfer_id)
                    engine.check_deadline(self._deadline, nbytes, ahead=self._ahead + queued)
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
        part = self._parts
        self._parts += 1
        pending = [len(tasks)]
        left = [nbytes]  # of this part's bytes, those of pieces that have not ended
        started = [0.0]
        refused: list[KVServiceError] = []  # this part's, when its first piece came

        def work(task: Callable[[], T]) -> T:
            with self._lock:
                if engine.failed is not None:
                    raise engine.refusal(FINISHED if transfer.started_at else NOT_STARTED)
                if refused:
                    raise refused[0]
                if not started[0]:
                    try:
                        self._check_start(part, nbytes)
                    except KVServiceError as exc:
                        refused.append(exc)
                        raise
                    started[0] = time.monotonic()
                first, self._first = self._first, False
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
                error = engine.copy_failed(exc, transfer.transfer_id)
                if error is exc:
                    raise
                raise error from exc

        def part_done() -> None:
            results, error = engine.collect(futures, transfer)
            try:
                finalize(results, error)
            finally:
                if error is not None and (part == 0 or not refused or error is not refused[0]):
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
        sizes = even_shares(nbytes, len(tasks))
        futures = [
            engine.workers.submit(functools.partial(work, t), transfer.transfer_id, sizes[i])
            for i, t in enumerate(tasks)
        ]
        self._futures += futures
        for f in futures:
            f.add_done_callback(piece_done)

    def _check_start(self, part: int, nbytes: int) -> None:
        """(Copy thread, under the lock) Part ``part``'s first piece starts: refuse it
        (NOT_STARTED) if an earlier part was refused so, or if the deadline cannot fit
        its bytes any more; no later part starts after a refusal here."""
        try:
            if self._cut is not None and part > self._cut:
                assert self.refused is not None  # set with _cut
                raise self.refused
            self._engine.check_deadline(self._deadline, nbytes)
        except KVServiceError as exc:
            if self._cut is None or part < self._cut:
                self._cut = part
                self.refused = self.refused or exc
                log.info(
                    "transfer %s: part %d (%d bytes) not started as it came up (%s); "
                    "the copy ends before it",
                    self.transfer.transfer_id,
                    part,
                    nbytes,
                    exc.message,
                )
            raise

    def _finish_if_over(self) -> None:
        transfer = self.transfer
        if self._closed and not self._running and not transfer.done.done():
            self._engine.retire(transfer.transfer_id)
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
            error = self.error
            ran = self.transfer.started_at  # the first part refused, a later one ran
            if ran and isinstance(error, KVServiceError) and error.transfer_state == NOT_STARTED:
                error.transfer_state = FINISHED
            raise self.error
