"""Health that tells the truth: grpc.health.v1 answered from the event loop on the
main port (so a stuck loop cannot look healthy: its Check times out), and from
threads on the --health-listen port (so a stuck loop is answered NOT_SERVING:
the watchdog thread, kvsvc.server.ops.watchdog, flips it without the loop);
flipped to NOT_SERVING by a fatal failure and kept there until restart."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TypeAlias

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsvc.errors import ServiceNotServing, Unparsed

SERVICE_NAME = "kvsvc.v1.KVCacheService"
NAMES = ("", SERVICE_NAME)
log = logging.getLogger(__name__)
Status: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus.ValueType
SERVING_STATUS: Status = health_pb2.HealthCheckResponse.SERVING


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 on our own state (grpcio's aio servicer offers no way to flip a
    status synchronously, and we must not reach into its private fields).

    Every method runs on the event loop, and ``set`` is synchronous: once it
    returns, no Check can answer the old status. Watch streams wake on a change.
    """

    def __init__(self) -> None:
        self._status: dict[str, Status] = {}
        #: set, then replaced, on every change: each watcher waits on the one it saw
        self._changed = asyncio.Event()
        self._shutting_down = False
        #: Watch streams open now (a stop waits for them to end on their own)
        self.watching = 0

    def set(self, service: str, status: Status) -> None:
        """Set one service's status; ignored after graceful shutdown began."""
        if self._shutting_down or self._status.get(service) == status:
            return
        self._status[service] = status
        self._changed.set()
        self._changed = asyncio.Event()

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service, for good; Watch streams send it, then end
        (left open, the server's stop would cancel them, and grpc logs each
        cancelled handler as an ERROR with a traceback)."""
        for service in list(self._status):
            self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._shutting_down = True
        self._changed.set()
        self._changed = asyncio.Event()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if type(request) is Unparsed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        status = self._status.get(request.service)
        if status is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:200]!r}"
            )
        return health_pb2.HealthCheckResponse(status=status)

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        if type(request) is Unparsed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._status.items()
            }
        )

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The current status, then each change (SERVICE_UNKNOWN while unknown). The
        stream ends when the client cancels, or with OK once the server is shutting
        down and the stream has sent its final status."""
        if type(request) is Unparsed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        self.watching += 1
        try:
            async for response in self._watch(request):
                yield response
        finally:
            self.watching -= 1

    async def _watch(
        self, request: health_pb2.HealthCheckRequest
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last: Status | None = None
        while True:
            changed = self._changed  # taken before reading: no change can slip between
            status = self._status.get(
                request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            )
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
                continue  # the status may have changed while that was sent
            if self._shutting_down:
                return
            await changed.wait()


class ThreadedHealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for a thread-pool ``grpc.server`` (the --health-listen port):
    it never needs the event loop, so a loop that hangs cannot keep it from
    answering. The loop sets every change here as it does on :class:`HealthServicer`;
    the watchdog thread may ``fail`` it on its own when the loop stops answering.

    All state is under one lock; Watch streams wait on a condition of it.
    """

    #: Watch streams hold a worker thread each: at most this many at once, so Check
    #: and List always find a thread (``WORKERS``) and a flood of Watches cannot
    #: make a probe time out; one more is refused RESOURCE_EXHAUSTED.
    MAX_WATCHES = 12
    WORKERS = MAX_WATCHES + 4
    #: A waiting Watch looks at its call this often even if nothing wakes it (its
    #: cancellation callback does, at once): a bound, not the way it is told.
    WAKE_S = 1.0

    def __init__(self) -> None:
        self._status: dict[str, Status] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        #: statuses can no longer change (a fatal failure, or shutdown began)
        self._final = False
        #: Watch streams end once they have sent their last status
        self._shutting_down = False
        self._watching = 0

    @property
    def watching(self) -> int:
        """Watch streams open now (a stop waits for them to end on their own)."""
        with self._lock:
            return self._watching

    def set(self, service: str, status: Status) -> None:
        """Set one service's status (from any thread); ignored once final."""
        with self._lock:
            if self._final or self._status.get(service) == status:
                return
            self._status[service] = status
            self._changed.notify_all()

    def fail(self, names: tuple[str, ...]) -> None:
        """NOT_SERVING for ``names`` and every service known, for good (until restart),
        from any thread; Watch streams are woken to send it and stay open."""
        with self._lock:
            for service in (*names, *self._status):
                self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
            self._final = True
            self._changed.notify_all()

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service, for good; Watch streams send it, then end."""
        with self._lock:
            for service in self._status:
                self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
            self._final = self._shutting_down = True
            self._changed.notify_all()

    def status(self, service: str) -> Status | None:
        with self._lock:
            return self._status.get(service)

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if type(request) is Unparsed:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        status = self.status(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:200]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def List(
        self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthListResponse:
        if type(request) is Unparsed:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        with self._lock:
            statuses = dict(self._status)
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in statuses.items()
            }
        )

    def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        """The current status, then each change (SERVICE_UNKNOWN while unknown). The
        stream ends when the client cancels, or with OK once the server is shutting
        down and the stream has sent its final status."""
        if type(request) is Unparsed:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        with self._lock:
            if self._watching >= self.MAX_WATCHES:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self._watching} health Watch streams are open on this port, the most "
                    "it serves at once; use Check, or close one",
                )
            self._watching += 1
        try:
            yield from self._watch(request, context)
        finally:
            with self._lock:
                self._watching -= 1

    def _watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        def wake() -> None:  # the call ended (cancelled, deadline, server stop)
            with self._lock:
                self._changed.notify_all()

        context.add_callback(wake)
        last: Status | None = None
        while context.is_active():
            with self._lock:
                status = self._status.get(
                    request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                )
                if status == last:
                    if self._shutting_down:
                        return
                    # read and wait under the same lock: no change can slip between
                    self._changed.wait(self.WAKE_S)
                    continue
            yield health_pb2.HealthCheckResponse(status=status)  # never under the lock
            last = status


class Health:
    """The server's health: one status for both names, set on the loop on every
    change into both servicers (the main port's, answered on the loop, and the
    health port's, answered by threads), and a fatal failure, kept until restart."""

    def __init__(self) -> None:
        #: the main port's grpc.health.v1 (on the loop)
        self.servicer = HealthServicer()
        #: the --health-listen port's grpc.health.v1 (threads; see fatal_from_thread)
        self.probe = ThreadedHealthServicer()
        #: the first failure wins, whether the loop or the watchdog thread reports it
        self._failure_lock = threading.Lock()
        self.failure_reason = ""
        self.failure_time = 0.0
        self.shutting_down = False
        self.fatal_event = asyncio.Event()
        #: what must be ready before SERVING (e.g. the disk tier's index); see hold
        self.holds: set[str] = set()
        self._started = False

    async def start(self) -> None:
        """SERVING, but for the service name while a part is held (``hold``)."""
        self._started = True
        self._set(health_pb2.HealthCheckResponse.SERVING, names=("",))
        ready = health_pb2.HealthCheckResponse.NOT_SERVING if self.holds else SERVING_STATUS
        self._set(ready, names=(SERVICE_NAME,))

    def _set(self, status: Status, names: tuple[str, ...] = NAMES) -> None:
        """``names`` (both by default), on both servicers (on the loop)."""
        for name in names:
            self.servicer.set(name, status)
            self.probe.set(name, status)

    def hold(self, what: str) -> None:
        """Keep the service name NOT_SERVING (from start) until ``release(what)``: a
        part the operator asked to be ready before traffic comes (on the loop). Only
        readiness waits: "" (liveness, the startup probe) answers SERVING meanwhile,
        so a large disk index is never mistaken for a dead process and restarted."""
        self.holds.add(what)

    def release(self, what: str) -> None:
        """``what`` is ready: SERVING once nothing else is held, unless failed or stopping."""
        self.holds.discard(what)
        if self._started and not self.holds and self.serving:
            self._set(health_pb2.HealthCheckResponse.SERVING)

    @property
    def serving(self) -> bool:
        return not self.failure_reason and not self.shutting_down

    @property
    def ready(self) -> bool:
        """Whether grpc.health.v1 answers SERVING for the service name now (from any
        thread: the health port's servicer, which the watchdog fails without the loop)."""
        return self.probe.status(SERVICE_NAME) == SERVING_STATUS

    def fatal_now(self, reason: str, detail: str) -> None:
        """Stop serving for good (until restart); the first failure is the one reported.

        Called on the loop. Check answers NOT_SERVING from this moment, and Watch
        streams are woken to send it. It also completes a failure the watchdog
        thread reported first (:meth:`fatal_from_thread`): the main port's status
        and ``fatal_event`` are the loop's to set.
        """
        self._record(reason, detail)
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.fatal_event.set()

    def fatal_from_thread(self, reason: str, detail: str) -> None:
        """The watchdog's verdict, from its thread, without the loop (which may be the
        thing that hangs): the failure is recorded at once (so GetServerInfo,
        ``kvsvc_serving`` and transfer refusals read it) and the health port answers
        NOT_SERVING, its Watch streams told. The main port's servicer follows when
        the loop runs :meth:`fatal_now`, if it ever runs again."""
        self._record(reason, detail)
        self.probe.fail(NAMES)

    def _record(self, reason: str, detail: str) -> None:
        """Keep the first failure (from any thread); log it once."""
        with self._failure_lock:
            if self.failure_reason:
                return
            self.failure_time = time.time()
            self.failure_reason = reason
        log.error("fatal failure %s: %s; health is NOT_SERVING until restart", reason, detail)

    async def shutdown(self) -> None:
        self.shutting_down = True
        self.servicer.enter_graceful_shutdown()
        self.probe.enter_graceful_shutdown()

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
