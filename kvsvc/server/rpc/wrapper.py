"""The one wrapper every RPC goes through, for unary calls and Session requests
alike: it checks the header, admits transfers (health, tenant quota), runs the
handler within its deadline and turns any exception into a RemoteError reply
with the request id, the traceback logged under that id. No request is dropped
and every one is counted (DESIGN §4). The handlers: kvsvc.server.rpc.servicer."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from time import monotonic
from typing import Any, Protocol

import grpc

from kvsvc.errors import (
    ENVELOPE_VERSION,
    FINISHED,
    NO_TRANSFER,
    NOT_STARTED,
    BoundedLog,
    DeadlineExceeded,
    FatalServerError,
    KVServiceError,
    Unparsed,
    UnsupportedRequest,
    to_remote_error,
)
from kvsvc.ids import new_request_id
from kvsvc.logs import REQUEST_ID
from kvsvc.server.config import ServerConfig
from kvsvc.server.data.engine import TransferEngine
from kvsvc.server.ops import failpoints
from kvsvc.server.ops.health import Health
from kvsvc.server.ops.metrics import Metrics
from kvsvc.server.rpc.eager import Within
from kvsvc.server.security.auth import DEFAULT_TENANT, Tenant, current_tenant

#: The request log: every handler's lines under one name, whichever module handles
#: the request (the name operators filter on; lifecycle and errors log under it too).
LOGGER = "kvsvc.server.rpc.servicer"
log = logging.getLogger(LOGGER)
#: How long after a Session request's deadline the server stops waiting for it.
SESSION_GRACE_S = 1.0


class Call:
    """Per-request state the wrapper reads when it builds an error."""

    __slots__ = ("deadline", "key", "request_id", "started", "tenant", "transfer")

    def __init__(
        self, request_id: str, deadline: float, transfer: bool, tenant: Tenant = DEFAULT_TENANT
    ) -> None:
        self.request_id = request_id
        #: monotonic; the client's, or the default for calls without one
        self.deadline = deadline
        self.transfer = transfer
        self.started = False
        #: who calls (kvsvc.server.security.auth): every mapping, namespace and transfer id it
        #: names is its own
        self.tenant = tenant
        #: the transfer engine's id of this call: tenants never share one
        self.key = tenant.scoped(request_id)


class Refusals(Protocol):
    """Where quota refusals are counted by tenant (kvsvc.server.ops.stats.Counts)."""

    def refused(self, tenant: str, quota: str) -> None: ...


class Served(Protocol):
    """What the wrapper reads of the servicer whose handlers it wraps."""

    config: ServerConfig
    health: Health
    metrics: Metrics
    counts: Refusals
    engine: TransferEngine

    def admit(self, call: Call) -> None:
        """Refuse a transfer over its tenant's quota, before anything is reserved."""

    def fatal(self, exc: KVServiceError) -> None:
        """Stop serving (on the loop)."""


def check_envelope_version(header: Any) -> None:
    """UNSUPPORTED_ENVELOPE_VERSION unless the client reads the envelope we write
    (every RPC: the wrapper's, and the events stream's, which has none)."""
    if header.envelope_version not in (0, ENVELOPE_VERSION):
        raise UnsupportedRequest(
            f"envelope version {header.envelope_version} is not spoken here "
            f"(this server speaks {ENVELOPE_VERSION})",
            reason="UNSUPPORTED_ENVELOPE_VERSION",
            metadata={"envelopeVersion": header.envelope_version, "supported": ENVELOPE_VERSION},
        )


def rpc(response_cls: type[Any], *, transfer: bool = False) -> Callable[..., Any]:
    """The one wrapper every RPC goes through: no exception leaves it, no request is dropped.

    A handler that never waits may be a plain function: it is called without the
    coroutine an ``async def`` costs on every call."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        name = fn.__name__
        is_async = inspect.iscoroutinefunction(fn)

        async def dispatch(self: Served, request: Any, call: Call) -> Any:
            if failpoints.ENABLED:
                failpoints.hit("loop.stall", name)
                await failpoints.hit_async("handler.enter", name)
            check_envelope_version(request.header)
            if transfer:
                self.health.check_serving()
                self.admit(call)
            result = (await fn(self, request, call)) if is_async else fn(self, request, call)
            if not is_async and inspect.iscoroutine(result):
                result = await result  # a plain handler that has to wait this time
            # A handler may build its whole response (cheaper than copying a result in).
            return result if type(result) is response_cls else response_cls(result=result)

        async def serve(
            self: Served,
            request: Any,
            context: grpc.aio.ServicerContext,
            remaining: float | None,
            bound: bool,
        ) -> Any:
            """One request, from a unary call or a Session stream (``bound``: nothing
            else ends it at its deadline, so the wrapper does)."""
            request_id = request.header.request_id or new_request_id()
            started = monotonic()  # one clock for the deadline and the latency metric
            call = Call(
                request_id,
                started + (self.config.limits.default_deadline if remaining is None else remaining),
                transfer,
                current_tenant(),
            )
            outcome = "result"
            token = REQUEST_ID.set(request_id)
            try:
                if type(request) is Unparsed:  # not parsed (logged, or counted, by the parser)
                    outcome = request.error.reason
                    return response_cls(error=request.envelope(request_id, transfer))
                if (remaining is None or bound) and (is_async or failpoints.ENABLED):
                    # No client deadline: the default one bounds every wait here. A
                    # Session request's own: its client answers itself at the deadline
                    # (as gRPC does for unary calls), so the server ends a little later.
                    # A plain handler never waits (only a failpoint may): unbounded.
                    grace = SESSION_GRACE_S if remaining is not None else 0.0
                    return await _bounded(
                        self, dispatch(self, request, call), name, call, remaining is None, grace
                    )
                return await dispatch(self, request, call)
            except asyncio.CancelledError:
                # The client cancelled or its deadline passed: nobody reads a reply.
                outcome = "CANCELLED"
                log.info("%s %s cancelled by the client", name, call.request_id)
                raise
            except BaseException as exc:  # noqa: BLE001 - the contract: every failure gets a reply
                response = _error(self, name, call, exc, response_cls, monotonic() - started)
                outcome = response.error.reason
                if outcome == "TENANT_QUOTA_EXCEEDED":  # per tenant: the stats' refusals
                    self.counts.refused(call.tenant.name, response.error.metadata.get("quota", ""))
                return response
            finally:
                REQUEST_ID.reset(token)
                self.metrics.observe_request(name, outcome, monotonic() - started)

        @functools.wraps(fn)
        async def handler(self: Served, request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await serve(self, request, context, context.time_remaining(), False)

        handler.serve = serve  # type: ignore[attr-defined]  # for Session's requests
        return handler

    return decorate


async def _bounded(
    served: Served,
    work: Coroutine[Any, Any, Any],
    name: str,
    call: Call,
    default: bool,
    grace: float = 0.0,
) -> Any:
    """Run a call within its deadline (``default``: the server's, the call carried
    none): a handler that hangs or a copy that runs long is answered at the
    deadline all the same (a copy that goes on is tracked, answered UNKNOWN, and
    Fence proves its end). Unary calls with a deadline have gRPC for this."""
    # At the deadline itself: handlers give up a little earlier with a better
    # error (they keep a reply budget); this only catches what does not.
    try:
        return await Within(work, call.deadline + grace)
    except TimeoutError:
        if monotonic() < call.deadline - 0.1:
            raise  # the handler's own TimeoutError, not the deadline's
        state = NO_TRANSFER
        if call.transfer:
            state = served.engine.state_of(call.key) if call.started else NOT_STARTED
        if not default:
            raise DeadlineExceeded(
                f"{name} did not finish within its deadline", transfer_state=state
            ) from None
        raise DeadlineExceeded(
            f"{name} did not finish within the server's default deadline of "
            f"{served.config.limits.default_deadline:g} s (the call carried no deadline)",
            reason="DEFAULT_DEADLINE_EXCEEDED",
            metadata={"defaultDeadlineS": f"{served.config.limits.default_deadline:g}"},
            transfer_state=state,
        ) from None


#: A traceback already logged in full is logged in full again after this long.
TRACEBACK_INTERVAL_S = 60.0
#: How many distinct tracebacks are remembered (beyond, the oldest is forgotten).
TRACEBACK_KINDS = 1024
#: Lines a second for request errors (a bad key, a full store: the caller's typed
#: error says it all; kvsvc_requests_total counts every one by reason), and as many
#: for handler failures whose traceback is already logged. A line costs tens of
#: microseconds, more than the rest of an error's answer: one per failure let a
#: flood of failing calls cost twice as many successful ones.
ERROR_LINES_PER_S = 20


class Tracebacks:
    """Logs a handler failure's traceback under its request id once per kind: in
    full the first time a traceback is seen (and again every ``interval_s``), and
    a failure with the same traceback (same exception type, frames and cause) as
    one line naming the request whose log holds it, at most ERROR_LINES_PER_S a
    second. Formatting a traceback costs about 1 ms (Python 3.11 parses each
    frame's source line for its carets): paid on every failure, a failing handler
    made each of its errors cost twice a result and slowed everyone else's calls."""

    def __init__(self, logger: logging.Logger, interval_s: float = TRACEBACK_INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.repeats = BoundedLog(logger, 1.0, ERROR_LINES_PER_S)
        #: signature -> (request id whose log line holds the traceback, when logged)
        self._seen: dict[tuple[Any, ...], tuple[str, float]] = {}

    def error(
        self,
        name: str,
        request_id: str,
        exc: BaseException,
        fields: dict[str, object] | None = None,
    ) -> None:
        sig = _signature(exc)
        now = monotonic()
        seen = self._seen.get(sig)
        if seen is not None and now - seen[1] < self.interval_s:
            self.repeats.log(
                logging.ERROR,
                "%s %s failed: %s: %s (traceback as logged for request %s)",
                name, request_id, type(exc).__name__, exc, seen[0],
                extra=fields,
            )  # fmt: skip
            return
        if seen is None and len(self._seen) >= TRACEBACK_KINDS:
            del self._seen[next(iter(self._seen))]  # the first logged of those kept
        self._seen.pop(sig, None)
        self._seen[sig] = (request_id, now)
        self.logger.error("%s %s failed", name, request_id, exc_info=exc, extra=fields)


def _signature(exc: BaseException, depth: int = 0) -> tuple[Any, ...]:
    """What makes two tracebacks the same: the exception's type, each frame's code
    and line, and the same of its cause or context (walked, never formatted)."""
    frames: list[Any] = [type(exc)]
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if inner is not None and depth < 4:
        frames.append(_signature(inner, depth + 1))
    return tuple(frames)


_tracebacks = Tracebacks(log)
_request_errors = BoundedLog(log, 1.0, ERROR_LINES_PER_S)


def _error(
    served: Served,
    name: str,
    call: Call,
    exc: BaseException,
    response_cls: type[Any],
    elapsed: float,
) -> Any:
    # In a transfer RPC the engine has returned or raised by now, so no copy of
    # this call still runs: the state is FINISHED, or NOT_STARTED if none began.
    state = (FINISHED if call.started else NOT_STARTED) if call.transfer else NO_TRANSFER
    response = response_cls()
    envelope = to_remote_error(exc, call.request_id, state, into=response.error)
    fields = _log_fields(name, call, envelope, elapsed)
    if isinstance(exc, KVServiceError) and not exc.fatal:
        _request_errors.log(
            logging.INFO, "%s %s failed: %s", name, call.request_id, exc, extra=fields
        )
    else:  # the traceback stays here, found by the request id
        _tracebacks.error(name, call.request_id, exc, fields)
    if getattr(exc, "fatal", False) or not isinstance(exc, Exception):
        served.fatal(
            exc
            if isinstance(exc, KVServiceError)
            else FatalServerError(envelope.message, reason=envelope.reason)
        )
    return response


def _log_fields(name: str, call: Call, envelope: Any, elapsed: float) -> dict[str, object]:
    """The failed call's structured log fields (kvsvc.logs.FIELDS): a denial names
    the tenant and the namespace it was refused (never the token)."""
    return {
        "rpc": name,
        "reason": envelope.reason,
        "tenant": call.tenant.name,
        "namespace": envelope.metadata.get("namespace", ""),
        "duration_ms": round(elapsed * 1000, 3),
    }
