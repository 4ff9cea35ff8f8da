"""A kvsvc server's life: build the gRPC server around the servicer (health,
reflection, request parsing that never raises), start, run until a signal (or a
fatal failure with --exit-on-fatal), drain and stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from kvsvc import __version__
from kvsvc.errors import request_parser
from kvsvc.limits import server_options
from kvsvc.server.config import ConfigError, ServerConfig, grpc_socket, socket_gid
from kvsvc.server.config.host import metrics_address
from kvsvc.server.data import fdsocket
from kvsvc.server.data.copies import copy_loop
from kvsvc.server.ops.health import Health
from kvsvc.server.ops.watchdog import Watchdog
from kvsvc.server.rpc.servicer import KVCacheServicer
from kvsvc.server.security.auth import Authenticator, AuthInterceptor, TenantFileError
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger("kvsvc.server.rpc.servicer")
STOP_GRACE_S = 0.5
#: How long a stop waits at least for Session and Watch streams to end by themselves.
STREAMS_END_S = 5.0
#: How long serve waits, after the stop, for grpc's last handler tasks.
TASKS_END_S = 2.0
#: Bound on waiting for the reaper task at stop (it ends at its next wake-up).
REAPER_STOP_S = 5.0
#: Bound on waiting for the health listener's threads at stop.
HEALTH_STOP_S = 5.0


class Server:
    """A running kvsvc server: the gRPC server, its servicer and health."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.auth: Authenticator | None = None
        if config.security.authenticated:
            try:
                self.auth = Authenticator(
                    config.security.auth_token_file,
                    client_certs=bool(config.security.tls_client_ca),
                )
            except TenantFileError as exc:
                raise ConfigError(f"--auth-token-file: {exc}") from None
        credentials = _server_credentials(config)
        self.health = Health()
        if config.network.socket_dir:
            try:
                fdsocket.prepare_socket_dir(config.network.socket_dir, socket_gid(config))
            except OSError as exc:
                raise ConfigError(f"--socket-dir {config.network.socket_dir}: {exc}") from None
        self.servicer = KVCacheServicer(config, self.health)
        if self.auth is not None:
            self.auth.on_failure = self.servicer.metrics.observe_auth_failure
            if self.auth.token_file:
                self.servicer.metrics.watch_tenant_file(self.auth)
        self.grpc = grpc.aio.server(
            options=server_options(),
            interceptors=[AuthInterceptor(self.auth)] if self.auth is not None else None,
        )
        # Not the generated add_*_to_server: their deserializers raise on bytes that
        # do not parse, which grpc answers UNKNOWN with an ERROR traceback each time.
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"]
        self._add_service(pb.DESCRIPTOR.services_by_name["KVCacheService"], self.servicer)
        self._add_service(health_service, self.health.servicer)
        # Probes that cannot present credentials: health only, plaintext, its own port,
        # answered by threads (health.probe), so a hung event loop is told NOT_SERVING
        # there by the watchdog thread, where the main port's Check times out.
        self.health_grpc: grpc.Server | None = None
        self.health_address = ""
        if config.network.health_listen:
            workers = ThreadPoolExecutor(self.health.probe.WORKERS, "kvsvc-health")
            self.health_grpc = grpc.server(workers, options=server_options())
            self._add_service(health_service, self.health.probe, self.health_grpc)
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
            if credentials is None:
                self.port = self.grpc.add_insecure_port(config.network.listen)
            else:
                self.port = self.grpc.add_secure_port(config.network.listen, credentials)
            if self.port == 0 and not config.network.listen.startswith("unix:"):
                raise RuntimeError("no address bound")
            if self.health_grpc is not None:
                health_port = self.health_grpc.add_insecure_port(config.network.health_listen)
                if health_port == 0 and not config.network.health_listen.startswith("unix:"):
                    raise RuntimeError("no health address bound")
                self.health_address = _bound(config.network.health_listen, health_port)
            if self.unix is not None:
                self.grpc.add_insecure_port(self.unix)
                fdsocket.restrict_socket(self.unix.removeprefix("unix:"), socket_gid(config))
        except (RuntimeError, OSError):  # grpc's bare 'Failed to bind' (its C core logs why)
            # The servicer made the fd socket and worker threads: leave nothing behind.
            if self.servicer.fds is not None:
                self.servicer.fds.close()
            self.servicer.engine.shutdown()
            self.servicer.tiers.close(1.0)
            if self.health_grpc is not None:
                self.health_grpc.stop(None)
            health = config.network.health_listen
            raise ConfigError(
                f"cannot listen on {config.network.listen}"
                f"{' and ' + self.unix if self.unix else ''}"
                f"{' and ' + health if health else ''}: "
                "grpc could not bind it "
                "(a port in use, a host that does not resolve, a missing directory?)"
            ) from None
        self.address = _bound(config.network.listen, self.port)

    def describe_security(self) -> str:
        """What the main port requires and what it trusts, for the start-up log."""
        c = self.config
        parts = [
            ("mTLS" if c.security.tls_client_ca else "TLS") if c.security.tls_cert else "plaintext"
        ]
        if self.auth is not None and c.security.auth_token_file:
            parts.append(f"bearer tokens of {len(self.auth.tables.tenants)} tenants")
        elif self.auth is not None:
            parts.append("client certificates: one default tenant")
        else:
            parts.append("no authentication: one default tenant")
        owners = self.servicer.shm_owners
        parts.append("shm names off" if owners is None else f"shm names of uids {sorted(owners)}")
        return ", ".join(parts)

    def _add_service(
        self,
        service: ServiceDescriptor,
        servicer: object,
        server: grpc.aio.Server | grpc.Server | None = None,
    ) -> None:
        """Register ``servicer``'s methods with requests parsed by
        :func:`request_parser`, so a message that does not parse gets a typed reply,
        behind the budget of large requests (kvsvc.server.data.budget)."""
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        budget = self.servicer.budget
        for method in service.methods:
            assert not method.client_streaming or method.server_streaming, method.full_name
            behavior = getattr(servicer, method.name)
            make = (
                grpc.stream_stream_rpc_method_handler
                if method.client_streaming
                else grpc.unary_stream_rpc_method_handler
                if method.server_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            if method.full_name == "kvsvc.v1.KVCacheService.Store" and budget.limit:
                # read only once its declared size is admitted (budget.declared)
                behavior, make = budget.declared(behavior), grpc.stream_unary_rpc_method_handler
            handlers[method.name] = make(
                behavior,
                request_deserializer=budget.parser(
                    request_parser(GetMessageClass(method.input_type)),
                    GetMessageClass(method.input_type),
                ),
                response_serializer=_serializer(GetMessageClass(method.output_type), method),
            )
        generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
        server = self.grpc if server is None else server
        server.add_generic_rpc_handlers((generic,))
        server.add_registered_method_handlers(service.full_name, handlers)

    async def start(self) -> None:
        if self.servicer.fds is not None:
            self.servicer.fds.start()
        await self.health.start()
        self._reaper = asyncio.ensure_future(self.servicer.reap())
        await self.grpc.start()
        if self.health_grpc is not None:
            self.health_grpc.start()
        self.watchdog = Watchdog(
            asyncio.get_running_loop(),
            self.servicer.engine,
            self.config.limits.stall_timeout,
            self.servicer.fatal_threadsafe,
            self.health,
        )
        self.watchdog.start()
        self.servicer.metrics.watch_loop(self.watchdog)
        metrics_at = metrics_address(self.config)
        if metrics_at is not None:
            self.servicer.metrics.serve_http(*metrics_at)
            log.info("Prometheus metrics on http://%s:%d/metrics", *metrics_at)
        log.info(
            "kvsvc %s serving on %s (store %d bytes, device %s, copy loop %s: %s, start id %s; %s)",
            __version__,
            self.address + (f" and {self.unix}" if self.unix else ""),
            self.servicer.store.capacity,
            self.servicer.device,
            *copy_loop(),
            self.servicer.start_id,
            self.describe_security(),
        )
        if self.health_grpc is not None:
            log.info("health-only plaintext listener on %s", self.health_address)

    def streams_open(self) -> int:
        """Session and health Watch streams still open."""
        return (
            self.servicer.sessions_open + self.health.servicer.watching + self.health.probe.watching
        )

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first; refuse new transfers while in-flight copies finish (health
        still answers, so probes see the truth); then stop the gRPC server."""
        await self.health.shutdown()
        grace = self.config.limits.shutdown_grace if grace is None else grace
        deadline = time.monotonic() + grace
        engine = self.servicer.engine
        while engine.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        # Copies are drained; other calls are short, and health Watch streams never
        # end on their own, so they must not hold the exit for the whole grace.
        self.servicer.end_sessions()
        # They end by themselves once they have sent what they hold; on a loaded
        # host that can take longer than grpc's stop grace, which would cancel them.
        streams_end = time.monotonic() + max(STREAMS_END_S, deadline - time.monotonic())
        while self.streams_open() and time.monotonic() < streams_end:
            await asyncio.sleep(0.01)
        await self.grpc.stop(min(STOP_GRACE_S, max(0.0, deadline - time.monotonic())))
        if self.health_grpc is not None:
            stopped = self.health_grpc.stop(0)
            await asyncio.get_running_loop().run_in_executor(None, stopped.wait, HEALTH_STOP_S)
        if engine.inflight:
            log.warning(
                "shutdown: copies still running after the %.1f s grace period: %s",
                grace,
                sorted(engine.inflight),
            )
        self.servicer.stop_reaping()
        self._reaper.cancel()  # a release in progress ends at once too
        await asyncio.wait({self._reaper}, timeout=REAPER_STOP_S)
        # The watchdog goes first: workers that end on purpose are not a death.
        self.watchdog.stop()
        engine.shutdown()
        if self.servicer.fds is not None:
            self.servicer.fds.close()
        # Each tier finishes (disk) or drops and counts (Redis) what it queued.
        await self.servicer.tiers.aclose(max(1.0, deadline - time.monotonic()))


def _serializer(cls: type[Message], method: MethodDescriptor) -> Callable[[Any], bytes]:
    """The method's response serializer; a server stream's also passes bytes through
    (WatchEvents serializes a batch once for every watcher that sees the same)."""
    if not method.server_streaming or method.client_streaming:
        return cls.SerializeToString

    def serialize(message: Message | bytes) -> bytes:
        return message if isinstance(message, bytes) else message.SerializeToString()

    return serialize


def _bound(listen: str, port: int) -> str:
    """The address a listener got (its port, where port 0 asked for any)."""
    return listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{port}"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS for the main port (mTLS with --tls-client-ca), or None for plaintext."""
    if not config.security.tls_cert:
        return None
    try:
        return grpc.ssl_server_credentials(
            [(_read(config.security.tls_key), _read(config.security.tls_cert))],
            root_certificates=_read(config.security.tls_client_ca)
            if config.security.tls_client_ca
            else None,
            require_client_auth=bool(config.security.tls_client_ca),
        )
    except OSError as exc:
        raise ConfigError(f"TLS files: {exc.filename}: {exc.strerror}") from None


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
    if server.auth is not None:  # a new tenant file, without dropping a call
        loop.add_signal_handler(signal.SIGHUP, server.auth.reload)
    await server.start()
    waits = [asyncio.ensure_future(stop.wait())]
    if config.limits.exit_on_fatal:
        waits.append(asyncio.ensure_future(server.health.fatal_event.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    fatal = server.health.failure_reason if not stop.is_set() else ""
    if fatal:
        log.error("exiting after fatal failure %s (--exit-on-fatal)", fatal)
    else:
        log.info(
            "signal received: NOT_SERVING, draining for up to %.1f s", config.limits.shutdown_grace
        )
    await server.stop()
    # grpc's handler tasks can outlive its stop by a moment (the call is over in the
    # core, the coroutine not yet): asyncio.run would cancel them, and grpc logs
    # each cancelled handler as an ERROR with a traceback.
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=TASKS_END_S)
    log.info("stopped")
    return 3 if fatal else 0
