"""Health that tells the truth: grpc.health.v1 answered from the event loop
(so a stuck loop cannot look healthy), flipped to NOT_SERVING by a fatal
failure and kept there until restart."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kvsvc.errors import FatalServerError, KVServiceError, ServiceNotServing

if TYPE_CHECKING:
    from kvsvc.transfer import TransferEngine

SERVICE_NAME = "kvsvc.v1.KVCacheService"
NAMES = ("", SERVICE_NAME)
log = logging.getLogger(__name__)


class Health:
    def __init__(self) -> None:
        self.servicer = health_aio.HealthServicer()
        self.failure_reason = ""
        self.failure_time = 0.0
        self.shutting_down = False
        self.fatal_event = asyncio.Event()
        self._notify: list[asyncio.Future[None]] = []

    async def start(self) -> None:
        for name in NAMES:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    @property
    def serving(self) -> bool:
        return not self.failure_reason and not self.shutting_down

    def fatal_now(self, reason: str, detail: str) -> None:
        """Stop serving for good (until restart); the first failure is the one reported.

        Called on the loop. Check answers NOT_SERVING from this moment; Watch
        streams are notified by a task scheduled at once.
        """
        if self.failure_reason:
            return
        self.failure_reason = reason
        self.failure_time = time.time()
        log.error("fatal failure %s: %s; health is NOT_SERVING until restart", reason, detail)
        for name in NAMES:
            # Status first (synchronously, so no later Check can see SERVING), then
            # wake the watchers.
            self.servicer._server_status[name] = health_pb2.HealthCheckResponse.NOT_SERVING
            self._notify.append(
                asyncio.ensure_future(
                    self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
                )
            )
        self.fatal_event.set()

    async def shutdown(self) -> None:
        self.shutting_down = True
        await asyncio.gather(*self._notify, return_exceptions=True)
        await self.servicer.enter_graceful_shutdown()

    def check_serving(self) -> None:
        """Transfer RPCs refuse work on an instance that is not serving."""
        if self.failure_reason:
            raise ServiceNotServing(
                f"this instance stopped serving after a fatal failure ({self.failure_reason}); "
                "restart it or use another",
                metadata={"failureReason": self.failure_reason},
            )
        if self.shutting_down:
            raise ServiceNotServing(
                "this instance is shutting down", metadata={"failureReason": "SHUTTING_DOWN"}
            )


class Watchdog:
    """A thread (not the event loop, which it watches) that declares the server
    stalled when a copy runs past ``stall_timeout``, a copy worker is dead, or the
    loop misses its heartbeat. A polling deadline on the client cannot see a
    worker that is stuck rather than failed; this can."""

    PERIOD_S = 0.02

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        engine: TransferEngine,
        stall_timeout: float,
        on_fatal: Callable[[KVServiceError], None],
    ) -> None:
        self.loop = loop
        self.engine = engine
        self.stall_timeout = stall_timeout
        self.on_fatal = on_fatal
        self.beat = time.monotonic()
        self._stop = threading.Event()
        self._workers = engine.workers_alive()
        self._thread = threading.Thread(target=self._run, name="kvsvc-watchdog", daemon=True)
        self._beat_task: asyncio.Task[None] | None = None

    async def _heartbeat(self) -> None:
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(self.PERIOD_S)

    def start(self) -> None:
        self._beat_task = self.loop.create_task(self._heartbeat())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._beat_task is not None:
            self._beat_task.cancel()

    def _run(self) -> None:
        fired = False
        while not self._stop.wait(self.PERIOD_S) and not fired:
            exc = self.check()
            if exc is not None:
                fired = True
                log.critical("watchdog: %s", exc.message)
                self.on_fatal(exc)

    def check(self) -> KVServiceError | None:
        now = time.monotonic()
        stalled = self.engine.stalled(self.stall_timeout)
        if stalled:
            thread, tid, seconds = stalled[0]
            return FatalServerError(
                f"copy {tid} on {thread} has run {seconds:.1f} s, "
                f"past the {self.stall_timeout:g} s stall timeout",
                reason="TRANSFER_STALLED",
                metadata={"transferId": tid, "thread": thread, "stallTimeoutS": self.stall_timeout},
            )
        if self.engine.workers_alive() < self._workers:
            return FatalServerError("a transfer worker thread died", reason="TRANSFER_WORKER_DIED")
        if now - self.beat > self.stall_timeout:
            return FatalServerError(
                f"the event loop missed its heartbeat for {now - self.beat:.1f} s",
                reason="EVENT_LOOP_STALLED",
                metadata={"stalledS": f"{now - self.beat:.1f}"},
            )
        return None
