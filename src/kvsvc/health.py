"""Health that tells the truth: grpc.health.v1 answered from the event loop
(so a stuck loop cannot look healthy), flipped to NOT_SERVING by a fatal
failure and kept there until restart."""

from __future__ import annotations

import asyncio
import logging
import time

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kvsvc.errors import ServiceNotServing

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

    async def start(self) -> None:
        for name in NAMES:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    @property
    def serving(self) -> bool:
        return not self.failure_reason and not self.shutting_down

    async def fatal(self, reason: str, detail: str) -> None:
        """Stop serving for good (until restart); the first failure is the one reported."""
        if self.failure_reason:
            return
        self.failure_reason = reason
        self.failure_time = time.time()
        log.error("fatal failure %s: %s; health is NOT_SERVING until restart", reason, detail)
        for name in NAMES:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.fatal_event.set()

    async def shutdown(self) -> None:
        self.shutting_down = True
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
