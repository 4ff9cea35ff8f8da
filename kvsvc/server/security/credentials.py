"""Credentials of long-lived streams, kept true as they change.

A Session or WatchEvents stream is authenticated once, when it opens, but lives
for hours: a token revoked by a tenant file reload (SIGHUP) or one that expires
must not keep working on it. Each such stream holds a :class:`Grant` (the
credentials it was opened with, as a digest, never the token) in
:class:`OpenStreams`, which re-checks every open grant when the tables change and
at the earliest expiry among them (one timer for all streams: no polling per
stream). A grant that no longer resolves to its tenant is revoked: its stream
stops taking requests and ends with UNAUTHENTICATED (kvsvc.server.security.auth's
interceptor does the ending; kvsvc.server.rpc.session checks the grant per request,
so no request is served in the moment between expiry and the timer).

A reload may run on any thread while a stream opens on the loop, so a stream is
registered before the tables it is judged against are read, and judged again if
a reload landed meanwhile (:meth:`OpenStreams.open`): whichever comes first, no
stream keeps grants a reload took away. Its end goes out after the sends gRPC has
in flight (:class:`Sends`): a status beside them is refused, and never sent.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import grpc

log = logging.getLogger("kvsvc.server.security.auth")

#: A timer armed further ahead than this re-arms then (a wall clock that jumps is
#: caught within this bound).
MAX_TIMER_S = 60.0


@dataclass(frozen=True)
class Credentials:
    """What a call presented: a bearer token's SHA-256 (None: no token; b"": a
    malformed header) and the names of its verified client certificate."""

    digest: bytes | None
    cert_names: tuple[str, ...]


class Named(Protocol):
    """What a grant needs of kvsvc.server.security.auth's Tenant (which imports this module)."""

    @property
    def name(self) -> str: ...

    @property
    def namespaces(self) -> tuple[str, ...]: ...


Tenant = TypeVar("Tenant", bound=Named)


@dataclass(eq=False)
class Grant(Generic[Tenant]):
    """One open stream's credentials and the tenant they resolved to. ``watch``:
    the stream's view was fixed at open (WatchEvents filters by the tenant's grants
    then), so a tenant whose namespaces change ends it too, to reopen with the new
    view; a Session re-reads ``tenant`` per request instead."""

    credentials: Credentials
    tenant: Tenant
    expires: float
    watch: bool
    #: done once revoked: (status code, why) -- the interceptor ends the stream with it
    ended: asyncio.Future[tuple[grpc.StatusCode, str]]
    #: what the stream does to stop reading at once (kvsvc.server.rpc.session's stop)
    stops: list[Callable[[], None]] = field(default_factory=list)

    @property
    def revoked(self) -> bool:
        return self.ended.done()

    def check(self) -> Tenant | None:
        """The tenant a request on this stream runs as now; None once revoked or
        expired (the stream then ends: do not serve the request)."""
        if self.ended.done():
            return None
        if self.expires <= time.time():
            self.revoke(grpc.StatusCode.UNAUTHENTICATED, "expired")
            return None
        return self.tenant

    def revoke(self, code: grpc.StatusCode, why: str) -> None:
        if self.ended.done():
            return
        self.ended.set_result((code, why))
        for stop in self.stops:
            stop()


#: The grant of the stream the current task serves (None: no authentication, or a
#: unary call, which is checked whole when it starts).
GRANT: contextvars.ContextVar[Grant[Any] | None] = contextvars.ContextVar(
    "kvsvc_grant", default=None
)


class OpenStreams(Generic[Tenant]):
    """Every open stream's grant; re-checks them on :meth:`recheck` (a reload) and
    at the earliest expiry (one ``call_later`` for all)."""

    def __init__(self, resolve: Callable[[Credentials], tuple[Tenant | None, str, float]]) -> None:
        #: (tenant or None, why refused, expiry as unix time) for a call's credentials
        self.resolve = resolve
        #: moved by every :meth:`recheck` (a reload), before it looks for open grants
        self.generation = 0
        self._generations = itertools.count(1)  # next() is atomic: reloads on threads
        self._grants: set[Grant[Tenant]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf  # the unix time the timer wakes at

    def __len__(self) -> int:
        return len(self._grants)

    def open(self, credentials: Credentials, *, watch: bool) -> tuple[Grant[Tenant] | None, str]:
        """Authenticate a stream and register its grant (on the event loop): (grant,
        '') or (None, why refused). A reload (:meth:`recheck`, on any thread) swaps
        the tables, moves :attr:`generation`, then re-checks the grants it finds. The
        grant is registered, then the generation read again: a reload that moved it
        since the tables were read makes this read them again; one that had not yet
        moved it will find the grant. No order of the two leaves a stream under a
        tenant file no longer in force."""
        loop = asyncio.get_running_loop()
        self._loop = loop  # before the tables are read: a reload that finds no loop came first
        seen = self.generation
        tenant, why, expires = self.resolve(credentials)
        if tenant is None:
            return None, why
        grant = Grant(credentials, tenant, expires, watch, loop.create_future())
        self._grants.add(grant)
        while self.generation != seen:  # a reload landed since the read: read again
            seen = self.generation
            tenant, why, expires = self.resolve(credentials)
            if tenant is None:
                self.close(grant)
                return None, why
            grant.tenant, grant.expires = tenant, expires  # its view is not fixed yet
        if expires < self._armed_at:
            self._arm()
        return grant, ""

    def close(self, grant: Grant[Tenant]) -> None:
        self._grants.discard(grant)
        if not self._grants and self._timer is not None:
            self._timer.cancel()
            self._timer, self._armed_at = None, math.inf

    def recheck(self) -> None:
        """The tables changed (on any thread, after they were swapped): every open
        grant is resolved again on the loop; a token gone, expired or now naming
        another tenant is revoked. A stream registering meanwhile sees the new
        generation and judges itself (:meth:`open`)."""
        self.generation = next(self._generations)
        loop = self._loop
        if loop is None or not self._grants:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._recheck()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._recheck)

    def _recheck(self) -> None:
        revoked = 0
        for grant in list(self._grants):
            if grant.revoked:
                continue
            tenant, why, expires = self.resolve(grant.credentials)
            if tenant is None or tenant.name != grant.tenant.name:
                grant.revoke(grpc.StatusCode.UNAUTHENTICATED, why or "another tenant")
                revoked += 1
                continue
            if grant.watch and tenant.namespaces != grant.tenant.namespaces:
                # Not a credentials failure: the view it was opened with is gone.
                grant.revoke(grpc.StatusCode.UNAVAILABLE, "the tenant's namespaces changed")
                revoked += 1
                continue
            grant.tenant, grant.expires = tenant, expires
        if revoked:
            log.info("tenant file reload ended %d open streams", revoked)
        self._arm()

    def _arm(self) -> None:
        """One timer, at the earliest expiry among open grants (O(open streams))."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        live: Sequence[float] = [g.expires for g in self._grants if not g.revoked]
        self._armed_at = min(live, default=math.inf)
        if self._armed_at == math.inf or self._loop is None:
            return
        delay = max(0.0, min(self._armed_at - time.time(), MAX_TIMER_S))
        self._timer = self._loop.call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now = time.time()
        for grant in list(self._grants):
            if not grant.revoked and grant.expires <= now:
                grant.revoke(grpc.StatusCode.UNAUTHENTICATED, "expired")
        self._arm()


class Sends:
    """A long-lived stream's context as its handler sees it, with the sends gRPC has
    in flight counted. A stream's first send also carries the initial metadata,
    which grpc.aio marks sent only once that send returns to its writer: a handler
    cancelled in it never marks them, and the abort that ends the stream sends them
    again, which the core refuses (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS). grpc.aio
    then counts the status as sent and sends none: the call stays open and its
    client waits for good (issue 40). So the interceptor cancels a stream's handler
    only after :meth:`close` (no send starts after it) and :meth:`settled` (every
    send in flight returned: gRPC completes one once its transport took it, and
    fails it when the client goes)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._sending = 0
        self._closed = False
        self._idle: asyncio.Future[None] | None = None

    def __getattr__(self, name: str) -> Any:  # the rest is the context's own
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        await self._send(self._context.write, message)

    async def send_initial_metadata(self, metadata: Any) -> None:
        await self._send(self._context.send_initial_metadata, metadata)

    async def _send(self, send: Callable[[Any], Awaitable[None]], what: Any) -> None:
        if self._closed:  # the stream is ending: its handler is cancelled next
            raise asyncio.CancelledError
        self._sending += 1
        try:
            await send(what)
        finally:
            self._sending -= 1
            if not self._sending and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)

    def close(self) -> None:
        """No send starts from now (one that tries is cancelled)."""
        self._closed = True

    async def settled(self) -> None:
        """Once no send is in flight."""
        while self._sending:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle
