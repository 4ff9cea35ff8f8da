"""The one gate every Mooncake call passes: it runs on one of the tier's own
threads (THREADS of them, never the event loop), behind the breaker, within
--mooncake-timeout and the caller's budget, and a call past them is left to end
on its thread while the caller moves on (a miss or a skipped write). A call that
finds every thread taken is not queued (a master answering in 4.5 s must not pile
up waiting calls): it is a ``busy`` miss at once. Also the tier's counters."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvsvc.server.config import ServerConfig
from kvsvc.server.tiers.breaker import CLOSED, Breaker
from kvsvc.server.tiers.mooncake.client import (
    BREAKER_FAILURES,
    BREAKER_OPEN,
    BREAKER_OPEN_S,
    BUSY,
    CLOSING,
    FAILURES,
    TIMEOUT,
    Connection,
    Failed,
    warn,
)

T = TypeVar("T")

#: a call past its caller's budget (shorter than --mooncake-timeout): a miss, not
#: yet a failure of Mooncake's
BUDGET = "budget"

#: Mooncake threads for Retrieve, Lookup and DropNamespace (the write-behind has
#: its own): at most this many calls are in Mooncake at once
THREADS = 4


class Gate:
    """Calls into Mooncake, bounded; the counters (read by metrics and stats,
    written on threads and the loop, under ``lock``)."""

    def __init__(
        self, config: ServerConfig, connection: Connection, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.connection = connection
        self.loop = loop
        self.timeout = config.tiers.mooncake_timeout
        self.breaker = Breaker(
            BREAKER_FAILURES,
            BREAKER_OPEN_S,
            tier="mooncake",
            what="Mooncake",
            meanwhile="Mooncake reads are misses, writes are skipped",
        )
        self.closed = False
        self.inflight = 0  # calls on the threads now (on the loop)
        self.calling = 0  # threads inside Mooncake now (any thread, under lock)
        self.failed_at = -math.inf  # when Mooncake last failed a call (monotonic)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            THREADS, thread_name_prefix="kvsvc-mooncake"
        )
        self.lock = threading.Lock()
        self.hits = self.misses = self.bytes_read = 0
        self.writes = self.bytes_written = 0
        self.dropped_values = 0
        self.errors: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.skipped: dict[str, int] = {}

    async def run(
        self,
        fn: Callable[[Any], T],
        budget: float,
        late: Callable[[], None] | None = None,
        *,
        capped: bool = True,
    ) -> T:
        """``fn(client)`` on a Mooncake thread within ``budget`` s (and
        --mooncake-timeout unless not ``capped``: a call the master may take long
        over, DropNamespace's scan). Raises Failed(kind), counted here. ``late``
        runs on the loop once a call given up on has ended (whatever it was given
        to fill is free only then)."""
        if self.closed:
            raise Failed(CLOSING)
        if self.inflight >= THREADS:
            self.count(self.errors, BUSY)
            raise Failed(BUSY)
        if not self.breaker.allow():
            self.count(self.errors, BREAKER_OPEN)
            raise Failed(BREAKER_OPEN)
        try:
            work = self._pool.submit(self.call, fn)
        except RuntimeError:  # shut down
            raise Failed(CLOSING) from None
        self.inflight += 1
        fut = asyncio.wrap_future(work, loop=self.loop)
        fut.add_done_callback(self._ended)
        cut = budget < self.timeout or not capped  # the caller's budget ends first
        wait = min(budget, self.timeout) if capped else budget
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, wait))
        except TimeoutError:
            if late is not None:
                fut.add_done_callback(lambda _: late())
            if cut:  # not Mooncake's fault (yet): the call's own end tells the breaker
                self.count(self.errors, BUDGET)
                raise Failed(BUDGET) from None
            self.failed_at = time.monotonic()
            self.breaker.failure()
            self.count(self.errors, TIMEOUT)
            warn.warning("mooncake tier: a call took over %g s: a miss", self.timeout)
            raise Failed(TIMEOUT) from None

    def _ended(self, fut: asyncio.Future[Any]) -> None:
        self.inflight -= 1
        if not fut.cancelled():
            fut.exception()  # retrieved: a call given up on may still fail

    def call(self, fn: Callable[[Any], T]) -> T:
        """On a Mooncake thread: ``fn(client)``; a Failed it raises is counted, and
        the breaker told whether Mooncake answered."""
        with self.lock:
            self.calling += 1
        try:
            out = fn(self.connection.get())
        except Failed as exc:
            self.failed(exc.kind)
            raise
        except Exception as exc:
            warn.warning("mooncake tier: %s: %s: a miss", type(exc).__name__, exc)
            self.failed("other")
            raise Failed("other") from exc
        finally:
            with self.lock:
                self.calling -= 1
        self.breaker.success()
        return out

    def idle(self, timeout: float) -> bool:
        """Whether no thread is inside Mooncake, waiting ``timeout`` s at most (the
        client is closed, and the store's memory freed, only after its last call)."""
        end = time.monotonic() + timeout
        while self.calling:
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)
        return True

    def call_now(self, fn: Callable[[Any], T]) -> T:
        """``call`` from a thread of the tier's own (the writers), behind the breaker."""
        if self.closed:
            raise Failed(CLOSING)
        if not self.breaker.allow():
            self.count(self.errors, BREAKER_OPEN)
            raise Failed(BREAKER_OPEN)
        return self.call(fn)

    def failed(self, kind: str) -> None:
        self.count(self.errors, kind)
        if kind in FAILURES:
            self.failed_at = time.monotonic()
            self.breaker.failure()
        else:
            self.breaker.success()

    def answering(self, quiet_s: float) -> bool:
        """Whether Mooncake answered every call of the last ``quiet_s`` s."""
        return self.breaker.state == CLOSED and time.monotonic() - self.failed_at > quiet_s

    def stop(self) -> None:
        self.closed = True
        with contextlib.suppress(Exception):
            self._pool.shutdown(wait=False, cancel_futures=True)

    def count(self, table: dict[str, int], kind: str, n: int = 1) -> None:
        with self.lock:
            table[kind] = table.get(kind, 0) + n

    def add(self, **figures: int) -> None:
        with self.lock:
            for name, n in figures.items():
                setattr(self, name, getattr(self, name) + n)
