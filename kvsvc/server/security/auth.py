"""Who is calling: tenants, the credentials that name them, and the server
interceptor that checks those credentials on every call.

A tenant is what every id and chunk belongs to. Without ``--auth-token-file``
every caller is the one default tenant (today's single-user behaviour); with it,
a call names its tenant by a bearer token (``authorization: Bearer <token>``
metadata) or, under mTLS, by its client certificate's name. The tenant file is
JSON, re-read on SIGHUP (a bad file keeps the tables in force)::

    {"tenants": {"team-a": {
        "tokens": ["<token>", {"sha256": "<hex of the token>", "expires": "2027-01-01T00:00:00Z"}],
        "cert_names": ["engine-a.example"],
        "namespaces": ["llama3/*", "shared"],
        "shm_uids": [1000],
        "quota": {"store_share": 0.5, "namespace_share": 0.25,
                  "max_mappings": 16, "max_inflight": 64, "max_fds": 64}}}}

Tokens are kept only as SHA-256 digests and compared with
``hmac.compare_digest``; a token is never logged. A missing, unknown or expired
token gets the same UNAUTHENTICATED answer, which says nothing of what exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import hashlib
import hmac
import inspect
import json
import logging
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from kvsvc.errors import BoundedLog, PermissionDenied
from kvsvc.server.security.credentials import GRANT, Credentials, OpenStreams, Sends

log = logging.getLogger("kvsvc.server.security.auth")

#: Tenant names go into internal keys as ``<tenant>/<id>``: no '/' in them.
_TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
#: A token must carry at least 128 bits: 22 base64 or 32 hex characters.
MIN_TOKEN_CHARS = 22
AUTH_LOG_INTERVAL_S = 10.0
UNAUTHENTICATED_MESSAGE = "missing, unknown or expired credentials"
#: How long a revoked Session may take to answer the requests it is running.
REVOKE_DRAIN_S = 0.5
#: Bound on waiting for a stream's handler to end once cancelled.
CANCEL_WAIT_S = 1.0


@dataclass(frozen=True)
class Quota:
    """A tenant's limits; 0 = no per-tenant limit. ``store_share``: the fraction of
    --store-bytes it may hold before eviction takes from it first;
    ``namespace_share``: the fraction of that share any one of its namespaces may
    hold before eviction takes from that namespace first (None: --namespace-share)."""

    store_share: float = 1.0
    namespace_share: float | None = None
    max_mappings: int = 0
    max_inflight: int = 0
    max_fds: int = 0


@dataclass(frozen=True)
class Tenant:
    name: str
    #: exact names, or prefixes ending in '*' ('*' alone: every namespace)
    namespaces: tuple[str, ...] = ("*",)
    #: whose shm files Map opens by name for this tenant (None: the server's --shm-uids)
    shm_uids: frozenset[int] | None = None
    quota: Quota = field(default_factory=Quota)
    #: the default tenant keeps ids and namespaces unscoped (single-user use)
    default: bool = False

    def scoped(self, ident: str) -> str:
        """The server-internal key of a tenant's id or namespace: two tenants that
        pick the same name never meet."""
        return ident if self.default else f"{self.name}/{ident}"

    def check_namespace(self, namespace: str) -> None:
        for grant in self.namespaces:
            if grant == namespace or (grant.endswith("*") and namespace.startswith(grant[:-1])):
                return
        raise PermissionDenied(
            "this tenant is not granted the namespace",
            metadata={"namespace": namespace[:256]},
        )


DEFAULT_TENANT = Tenant("default", default=True)
#: The caller's tenant, set by the interceptor around each call (the default tenant
#: when the server has no authentication).
TENANT: contextvars.ContextVar[Tenant] = contextvars.ContextVar("kvsvc_tenant")
#: the one stream whose messages are calls of their own (kvsvc.server.rpc.servicer.Session)
SESSION_METHOD = "/kvsvc.v1.KVCacheService/Session"
#: the events stream (kvsvc.server.events): its handler reads current_tenant()
WATCH_EVENTS_METHOD = "/kvsvc.v1.KVCacheService/WatchEvents"


def current_tenant() -> Tenant:
    return TENANT.get(DEFAULT_TENANT)


class TenantFileError(ValueError):
    """The tenant file cannot be used; the message names the entry."""


@dataclass(frozen=True)
class _Token:
    tenant: Tenant
    digest: bytes
    expires: float  # unix time; inf: never


@dataclass(frozen=True)
class Tables:
    tokens: Mapping[bytes, _Token]
    certs: Mapping[str, Tenant]
    tenants: Mapping[str, Tenant]
    #: how many tokens the file holds in plaintext ("token", not "sha256")
    plaintext: int = 0


def _expiry(value: object, where: str) -> float:
    if value is None:
        return float("inf")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise TenantFileError(f"{where}: expires {value!r} is not an ISO 8601 time") from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=datetime.UTC)
        return parsed.timestamp()
    raise TenantFileError(f"{where}: expires must be an ISO 8601 time or unix seconds")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tables(data: object) -> Tables:
    """The tables of a tenant file's JSON; TenantFileError names what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict):
        raise TenantFileError('the file must be a JSON object {"tenants": {NAME: {...}}}')
    tokens: dict[bytes, _Token] = {}
    certs: dict[str, Tenant] = {}
    tenants: dict[str, Tenant] = {}
    plaintext = 0
    for name, spec in data["tenants"].items():
        where = f"tenant {name!r}"
        if not _TENANT_NAME.match(name):
            raise TenantFileError(f"{where}: a name is 1-64 of A-Z a-z 0-9 . _ -")
        if not isinstance(spec, dict):
            raise TenantFileError(f"{where}: must be an object")
        unknown = set(spec) - {"tokens", "cert_names", "namespaces", "shm_uids", "quota"}
        if unknown:
            raise TenantFileError(f"{where}: unknown keys {sorted(unknown)}")
        namespaces = spec.get("namespaces", [])
        if not isinstance(namespaces, list) or not all(isinstance(n, str) for n in namespaces):
            raise TenantFileError(f"{where}: namespaces must be a list of strings")
        uids = spec.get("shm_uids")
        if uids is not None and (
            not isinstance(uids, list) or not all(isinstance(u, int) and u >= 0 for u in uids)
        ):
            raise TenantFileError(f"{where}: shm_uids must be a list of uids")
        quota_spec = spec.get("quota", {})
        try:
            quota = Quota(**quota_spec)
        except TypeError:
            keys = list(Quota.__annotations__)
            raise TenantFileError(f"{where}: quota keys are {keys}") from None
        share = quota.namespace_share
        if (
            not 0 < quota.store_share <= 1
            or (
                share is not None
                and (
                    not isinstance(share, (int, float))
                    or isinstance(share, bool)
                    or not 0 < share <= 1
                )
            )
            or min(quota.max_mappings, quota.max_inflight, quota.max_fds) < 0
        ):
            raise TenantFileError(
                f"{where}: store_share and namespace_share are in (0, 1], limits are >= 0"
            )
        tenant = Tenant(
            name,
            tuple(namespaces),
            None if uids is None else frozenset(uids),
            quota,
        )
        tenants[name] = tenant
        for i, entry in enumerate(spec.get("tokens", [])):
            at = f"{where} token {i}"
            if isinstance(entry, str):
                entry = {"token": entry}
            if not isinstance(entry, dict):
                raise TenantFileError(f"{at}: a token is a string or an object")
            if "token" in entry:
                token = entry["token"]
                if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
                    raise TenantFileError(
                        f"{at}: a token needs at least {MIN_TOKEN_CHARS} characters "
                        "(128 random bits: e.g. secrets.token_hex(16) in Python)"
                    )
                digest = _digest(token)
                plaintext += 1
            elif isinstance(entry.get("sha256"), str):
                try:
                    digest = bytes.fromhex(entry["sha256"])
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise TenantFileError(f"{at}: sha256 must be 64 hex characters")
            else:
                raise TenantFileError(f"{at}: needs 'token' or 'sha256'")
            if digest in tokens:
                raise TenantFileError(f"{at}: the same token is listed twice")
            tokens[digest] = _Token(tenant, digest, _expiry(entry.get("expires"), at))
        for cert in spec.get("cert_names", []):
            if not isinstance(cert, str) or cert in certs:
                raise TenantFileError(f"{where}: cert name {cert!r} is not a new string")
            certs[cert] = tenant
    return Tables(tokens, certs, tenants, plaintext)


def load_tables(path: str) -> Tables:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f, parse_constant=lambda name: _no_constant(path, name))
    except OSError as exc:
        raise TenantFileError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise TenantFileError(f"{path} is not JSON: {exc}") from None
    return parse_tables(data)


def _no_constant(path: str, name: str) -> float:
    """Python's json reads NaN and Infinity, which JSON has not: a NaN expiry or limit
    compares false with everything (never expires, never limits)."""
    raise TenantFileError(f"{path}: {name} is not a number (JSON has no NaN or Infinity)")


class Authenticator:
    """Resolves a call's credentials to a tenant. ``reload`` swaps the tables in one
    assignment, so a call in progress sees the old tables or the new, never a mix;
    the streams open under the old tables are then re-checked (``streams``)."""

    def __init__(self, token_file: str, *, client_certs: bool) -> None:
        self.token_file = token_file
        #: mTLS verified the peer's certificate: with no tenant file, that is enough
        self.client_certs = client_certs
        self.tables = load_tables(token_file) if token_file else Tables({}, {}, {})
        self.failures = BoundedLog(log, AUTH_LOG_INTERVAL_S)
        self.on_failure: Callable[[str], None] = lambda reason: None
        #: Session and WatchEvents streams, ended when their credentials stop resolving
        self.streams: OpenStreams[Tenant] = OpenStreams(self.resolve)
        #: reloads so far, and whether the last one failed (kvsvc.server.ops.metrics)
        self.reloads_ok = self.reloads_failed = 0
        self.reload_failed = False
        if self.tables.plaintext:
            warn_if_exposed(token_file, "--auth-token-file", f"{self.tables.plaintext} plaintext")

    def reload(self) -> bool:
        """Re-read the tenant file (SIGHUP); a bad file keeps the tables in force.
        Open streams whose token is gone or expired end (UNAUTHENTICATED)."""
        if not self.token_file:
            return False
        try:
            tables = load_tables(self.token_file)
        except TenantFileError as exc:
            self.reloads_failed += 1
            self.reload_failed = True
            log.error("tenant file not reloaded, the previous one stays in force: %s", exc)
            return False
        self.tables = tables
        self.reloads_ok += 1
        self.reload_failed = False
        log.info(
            "tenant file reloaded: %d tenants, %d tokens", len(tables.tenants), len(tables.tokens)
        )
        self.streams.recheck()
        return True

    @staticmethod
    def credentials(
        metadata: Iterable[tuple[str, str | bytes]] | None, cert_names: Iterable[bytes]
    ) -> Credentials:
        """What a call presents, kept as the token's digest (b"": a malformed header)."""
        for key, value in metadata or ():
            if key == "authorization":
                bearer = value.decode() if isinstance(value, bytes) else value
                scheme, _, token = bearer.partition(" ")
                if scheme.lower() != "bearer" or not token.strip():
                    return Credentials(b"", ())
                return Credentials(_digest(token.strip()), ())
        return Credentials(None, tuple(n.decode(errors="replace") for n in cert_names))

    def resolve(self, creds: Credentials) -> tuple[Tenant | None, str, float]:
        """(tenant, '', expiry) or (None, why, 0) against the tables in force now --
        why goes to the log and metrics, never the caller."""
        tables = self.tables
        if creds.digest is not None:
            if not creds.digest:
                return None, "malformed", 0.0
            entry = tables.tokens.get(creds.digest)
            # The dict finds the entry by digest; the compare is constant-time anyway.
            if entry is None or not hmac.compare_digest(entry.digest, creds.digest):
                return None, "unknown", 0.0
            if entry.expires <= time.time():
                return None, "expired", 0.0
            return entry.tenant, "", entry.expires
        if creds.cert_names:
            for name in creds.cert_names:
                tenant = tables.certs.get(name)
                if tenant is not None:
                    return tenant, "", math.inf
            if not self.token_file:
                return DEFAULT_TENANT, "", math.inf
            return None, "certificate-unlisted", 0.0
        return None, "missing", 0.0

    def identify(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, cert_names: Iterable[bytes]
    ) -> tuple[Tenant | None, str]:
        """(tenant, '') or (None, why) — why goes to the log and metrics, never the caller."""
        tenant, why, _ = self.resolve(self.credentials(metadata, cert_names))
        return tenant, why

    def refuse(self, why: str, peer: str) -> None:
        self.on_failure(why)
        self.failures.log(
            logging.WARNING,
            "unauthenticated call from %s refused (%s)",
            peer,
            why,
            extra={"reason": "UNAUTHENTICATED"},
        )


def warn_if_exposed(path: str, flag: str, what: str = "a plaintext") -> bool:
    """One warning line when ``path`` holds plaintext tokens and its mode lets group
    or others read it (True then): anyone on the host could take the credential."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if not mode & (stat.S_IRGRP | stat.S_IROTH):
        return False
    log.warning(
        "%s %s holds %s token(s) and is readable by %s (mode %03o): chmod 600 it%s",
        flag,
        path,
        what,
        "group and others"
        if mode & stat.S_IRGRP and mode & stat.S_IROTH
        else "group"
        if mode & stat.S_IRGRP
        else "others",
        mode & 0o777,
        ", or list sha256 digests instead of tokens" if flag == "--auth-token-file" else "",
    )
    return True


def _cert_names(context: grpc.aio.ServicerContext) -> list[bytes]:
    auth = context.auth_context()
    return list(auth.get("x509_common_name", [])) + list(
        auth.get("x509_subject_alternative_name", [])
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call on the main port: credentials, or UNAUTHENTICATED before any handler
    runs. Unary calls run with their tenant in :data:`TENANT`; Session and
    WatchEvents streams too, and end when their credentials stop resolving
    (:meth:`_hold`)."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is not None and handler_call_details.method == SESSION_METHOD:
            return self._session(handler)
        if handler is not None and handler_call_details.method == WATCH_EVENTS_METHOD:
            return self._watch(handler)
        # Store is served request-streaming (kvsvc.server.data.budget.declared): a
        # unary call on the wire, identified as one.
        kind = "unary_unary" if handler is not None and handler.unary_unary else "stream_unary"
        if handler is None or getattr(handler, kind) is None:
            return self._streaming(handler, handler_call_details)
        inner = getattr(handler, kind)
        auth = self.auth

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            tenant, why = auth.identify(context.invocation_metadata(), _cert_names(context))
            if tenant is None:
                auth.refuse(why, context.peer())
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
            token = TENANT.set(tenant)  # type: ignore[arg-type]  # abort raised if None
            try:
                return await inner(request, context)
            finally:
                TENANT.reset(token)

        return handler._replace(**{kind: behavior})  # type: ignore[attr-defined,no-any-return]

    def _session(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The Session stream carries Lookup/Store/Retrieve/Fence: it is identified as
        a unary call is, every request it carries runs as the tenant its token names
        in the tables in force when the request is read (kvsvc.server.rpc.session checks
        :data:`GRANT`), and it ends when the token is revoked or expires."""
        inner = handler.stream_stream

        async def behavior(requests: Any, context: grpc.aio.ServicerContext) -> None:
            await self._hold(context, False, lambda ctx: inner(requests, ctx))

        return handler._replace(stream_stream=behavior)  # type: ignore[attr-defined,no-any-return]

    def _watch(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """WatchEvents, a unary-stream call: its handler runs as its tenant
        (``current_tenant()``) and the stream ends when the token is revoked or
        expires, or (UNAVAILABLE, to reopen) when the tenant's namespaces change."""
        inner = handler.unary_stream

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> None:
            await self._hold(context, True, lambda ctx: _written(inner(request, ctx), ctx))

        return handler._replace(unary_stream=behavior)  # type: ignore[attr-defined,no-any-return]

    async def _hold(
        self,
        context: grpc.aio.ServicerContext,
        watch: bool,
        run: Callable[[grpc.aio.ServicerContext], Awaitable[None]],
    ) -> None:
        """Authenticate a stream, run it as its tenant, and end it with its grant:
        revoked, the stream stops reading (a Session answers the requests it is
        running, for up to REVOKE_DRAIN_S) and ends UNAUTHENTICATED. A Session with
        a request still running after that ends UNAVAILABLE instead, so the client
        reports that request's outcome as unknown, never as "nothing ran". The end
        goes out after the sends gRPC has in flight (:class:`Sends`)."""
        auth = self.auth
        creds = auth.credentials(context.invocation_metadata(), _cert_names(context))
        # Registered as it reads the tables: a reload on any thread re-checks it.
        grant, why = auth.streams.open(creds, watch=watch)
        if grant is None:
            auth.refuse(why, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        assert grant is not None  # abort raised
        # Not reset: the stream's task ends with it, and the tasks it makes (the
        # Session's reader and requests) copy this context when they are made.
        TENANT.set(grant.tenant)
        GRANT.set(grant)
        sends = Sends(context)
        if watch:  # a watch's view goes with its grant: not one batch more
            grant.stops.append(sends.close)
        handed = cast(grpc.aio.ServicerContext, sends)
        task = asyncio.get_running_loop().create_task(_awaited(lambda: run(handed)))
        try:
            await asyncio.wait((task, grant.ended), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # revoked: its stops ran; a Session answers what runs
                await asyncio.wait((task,), timeout=0 if watch else REVOKE_DRAIN_S)
            if not task.done():  # cancelled below: its sends in flight complete first
                sends.close()
                await sends.settled()
        finally:
            auth.streams.close(grant)
            if not task.done():
                task.cancel()
                await asyncio.wait((task,), timeout=CANCEL_WAIT_S)
        if not grant.revoked:
            return task.result()  # its own end, or its own error (an abort raises)
        code, why = grant.ended.result()
        if code is grpc.StatusCode.UNAUTHENTICATED:
            auth.refuse(why, context.peer())
        if task.done() and not task.cancelled() and task.exception() is not None:
            task.result()  # the stream's own failure came first: it stands
        if not watch and not (task.done() and not task.cancelled()):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{UNAUTHENTICATED_MESSAGE}: the stream ended with a request still running",
            )
        if code is grpc.StatusCode.UNAUTHENTICATED:
            await context.abort(code, UNAUTHENTICATED_MESSAGE)
        await context.abort(code, f"{why}: watch again")

    def _streaming(
        self, handler: grpc.RpcMethodHandler | None, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """Health Watch and reflection: a token in the metadata, or a client
        certificate mTLS already verified (the names are not needed here)."""
        if handler is None:
            return handler  # type: ignore[return-value]  # grpc answers UNIMPLEMENTED
        tenant, why = self.auth.identify(details.invocation_metadata, ())  # type: ignore[attr-defined]
        if tenant is not None or (why == "missing" and self.auth.client_certs):
            return handler
        auth = self.auth

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            auth.refuse(why, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        if handler.request_streaming:

            async def refuse_stream(requests: Any, context: grpc.aio.ServicerContext) -> None:
                await refuse(None, context)

            return grpc.stream_stream_rpc_method_handler(refuse_stream)
        return grpc.unary_stream_rpc_method_handler(
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def _awaited(run: Callable[[], Awaitable[None]]) -> None:
    await run()


async def _written(answer: Any, context: grpc.aio.ServicerContext) -> None:
    """A unary-stream handler's answers, whether it writes them itself (a coroutine)
    or yields them (an async generator): the wrapper must be one coroutine to race
    it with its grant."""
    if inspect.isasyncgen(answer):
        async for message in answer:
            await context.write(message)
    elif inspect.isawaitable(answer):
        await answer


#: `kvsvc init-auth` writes the token beside the tenant file under this name.
TOKEN_FILE_NAME = "token"


def init_tenant_file(path: str) -> bool:
    """Make a first tenant file at ``path`` (one tenant, every namespace) and its
    random token in ``token`` beside it, both 0600; False if ``path`` exists (a
    restart keeps the token its clients hold). The tenant file holds only the
    token's SHA-256, so the server's copy of it is no credential."""
    if os.path.exists(path):
        return False
    token = secrets.token_urlsafe(32)  # 256 random bits
    tenant = {
        "tokens": [{"sha256": hashlib.sha256(token.encode()).hexdigest()}],
        "namespaces": ["*"],
    }
    directory = os.path.dirname(path) or "."
    _write_private(os.path.join(directory, TOKEN_FILE_NAME), token + "\n")
    # The tenant file last: its presence says both files are complete.
    _write_private(path, json.dumps({"tenants": {"engines": tenant}}, indent=2) + "\n")
    return True


def _write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, mode 0600 from the first byte."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
