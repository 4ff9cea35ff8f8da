"""A kvsvc server's life: build the gRPC server around the servicer (health,
reflection, request parsing that never raises), start, run until a signal (or a
fatal failure with --exit-on-fatal), drain and stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from kvsvc import __version__, fdbroker
from kvsvc.config import ConfigError, ServerConfig, grpc_socket, server_options, socket_gid
from kvsvc.errors import request_parser
from kvsvc.health import Health, Watchdog
from kvsvc.server import KVCacheServicer
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger("kvsvc.server")
STOP_GRACE_S = 0.5


class Server:
    """A running kvsvc server: the gRPC server, its servicer and health."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.health = Health()
        if config.socket_dir:
            try:
                fdbroker.prepare_socket_dir(config.socket_dir, socket_gid(config))
            except OSError as exc:
                raise ConfigError(f"--socket-dir {config.socket_dir}: {exc}") from None
        self.servicer = KVCacheServicer(config, self.health)
        self.grpc = grpc.aio.server(options=server_options())
        # Not the generated add_*_to_server: their deserializers raise on bytes that
        # do not parse, which grpc answers UNKNOWN with an ERROR traceback each time.
        self._add_service(pb.DESCRIPTOR.services_by_name["KVCacheService"], self.servicer)
        self._add_service(health_pb2.DESCRIPTOR.services_by_name["Health"], self.health.servicer)
        reflection.enable_server_reflection(
            (
                pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name,
                "grpc.health.v1.Health",
                reflection.SERVICE_NAME,
            ),
            self.grpc,
        )
        self.unix = grpc_socket(config)  # engines in other containers reach us here
        try:
            self.port = self.grpc.add_insecure_port(config.listen)
            if self.port == 0 and not config.listen.startswith("unix:"):
                raise RuntimeError("no address bound")
            if self.unix is not None:
                self.grpc.add_insecure_port(self.unix)
                fdbroker.restrict_socket(self.unix.removeprefix("unix:"), socket_gid(config))
        except (RuntimeError, OSError):  # grpc's bare 'Failed to bind' (its C core logs why)
            # The servicer made the fd socket and worker threads: leave nothing behind.
            if self.servicer.fds is not None:
                self.servicer.fds.close()
            self.servicer.engine.shutdown()
            if self.servicer.remote is not None:
                self.servicer.remote.close()
            raise ConfigError(
                f"cannot listen on {config.listen}{' and ' + self.unix if self.unix else ''}: "
                "grpc could not bind it "
                "(a port in use, a host that does not resolve, a missing directory?)"
            ) from None
        host = config.listen.rsplit(":", 1)[0]
        self.address = config.listen if config.listen.startswith("unix:") else f"{host}:{self.port}"

    def _add_service(self, service: ServiceDescriptor, servicer: object) -> None:
        """Register ``servicer``'s unary methods with requests parsed by
        :func:`request_parser`, so a message that does not parse gets a typed reply."""
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method in service.methods:
            assert not method.client_streaming, method.full_name
            make = (
                grpc.unary_stream_rpc_method_handler
                if method.server_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            handlers[method.name] = make(
                getattr(servicer, method.name),
                request_deserializer=request_parser(GetMessageClass(method.input_type)),
                response_serializer=GetMessageClass(method.output_type).SerializeToString,
            )
        generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
        self.grpc.add_generic_rpc_handlers((generic,))
        self.grpc.add_registered_method_handlers(service.full_name, handlers)

    async def start(self) -> None:
        if self.servicer.fds is not None:
            self.servicer.fds.start()
        await self.health.start()
        self._reaper = asyncio.ensure_future(self.servicer.reap())
        await self.grpc.start()
        self.watchdog = Watchdog(
            asyncio.get_running_loop(),
            self.servicer.engine,
            self.config.stall_timeout,
            self.servicer.fatal_threadsafe,
        )
        self.watchdog.start()
        if self.config.metrics_port:
            unix = self.config.listen.startswith("unix:")
            host = "127.0.0.1" if unix else self.address.rsplit(":", 1)[0].strip("[]")
            self.servicer.metrics.serve_http(self.config.metrics_port, host)
        log.info(
            "kvsvc %s serving on %s (store %d bytes, device %s, start id %s)",
            __version__,
            self.address + (f" and {self.unix}" if self.unix else ""),
            self.servicer.store.capacity,
            self.servicer.device,
            self.servicer.start_id,
        )

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first; refuse new transfers while in-flight copies finish (health
        still answers, so probes see the truth); then stop the gRPC server."""
        await self.health.shutdown()
        grace = self.config.shutdown_grace if grace is None else grace
        deadline = time.monotonic() + grace
        engine = self.servicer.engine
        while engine.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        # Copies are drained; other calls are short, and health Watch streams never
        # end on their own, so they must not hold the exit for the whole grace.
        await self.grpc.stop(min(STOP_GRACE_S, max(0.0, deadline - time.monotonic())))
        if engine.inflight:
            log.warning(
                "shutdown: copies still running after the %.1f s grace period: %s",
                grace,
                sorted(engine.inflight),
            )
        self._reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reaper
        # The watchdog goes first: workers that end on purpose are not a death.
        self.watchdog.stop()
        engine.shutdown()
        if self.servicer.fds is not None:
            self.servicer.fds.close()
        if self.servicer.remote is not None:
            self.servicer.remote.close()  # queued writes are dropped, counted


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT (exit 0 after a graceful drain), or, with
    --exit-on-fatal, until a fatal failure (exit 3 once copies are fenced)."""
    # Signals first: one that comes while the server starts stops it cleanly once
    # started, instead of leaving its fd socket behind.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = Server(config)
    await server.start()
    waits = [asyncio.ensure_future(stop.wait())]
    if config.exit_on_fatal:
        waits.append(asyncio.ensure_future(server.health.fatal_event.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    fatal = server.health.failure_reason if not stop.is_set() else ""
    if fatal:
        log.error("exiting after fatal failure %s (--exit-on-fatal)", fatal)
    else:
        log.info("signal received: NOT_SERVING, draining for up to %.1f s", config.shutdown_grace)
    await server.stop()
    log.info("stopped")
    return 3 if fatal else 0
