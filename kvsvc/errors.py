"""The error contract: one exception hierarchy for server and client, and the
only code that converts between exceptions, ``RemoteError`` envelopes and gRPC
status codes.

The server raises these classes; the handler wrapper turns any exception into a
``RemoteError`` with :func:`to_remote_error`. The client turns a ``RemoteError``
back into the same class with :func:`from_remote_error`, and a transport failure
with :func:`from_grpc_error`. Classes are shaped by how a caller reacts; each
declares only its code and reason (google-api-core's model).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

import grpc
from google.protobuf.message import Message

from kvsvc.v1 import error_pb2

ENVELOPE_VERSION = 1
MAX_MESSAGE_BYTES = 4096
MAX_REASON_CHARS = 63

TransferState: TypeAlias = int  # a kvsvc.v1.TransferState value
NO_TRANSFER: TransferState = error_pb2.TRANSFER_STATE_UNSPECIFIED
NOT_STARTED: TransferState = error_pb2.TRANSFER_STATE_NOT_STARTED
FINISHED: TransferState = error_pb2.TRANSFER_STATE_FINISHED
UNKNOWN: TransferState = error_pb2.TRANSFER_STATE_UNKNOWN


def truncate_utf8(text: str, limit: int = MAX_MESSAGE_BYTES) -> tuple[str, bool]:
    """Cut ``text`` to at most ``limit`` UTF-8 bytes without splitting a character."""
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= limit:
        return text, False
    # errors="ignore" drops the partial character left at the cut.
    return raw[:limit].decode("utf-8", errors="ignore"), True


# Filled by KVServiceError.__init_subclass__, in declaration order.
_BY_NAME: dict[str, type[KVServiceError]] = {}
_BY_REASON: dict[str, type[KVServiceError]] = {}
_BY_CODE: dict[grpc.StatusCode, type[KVServiceError]] = {}


class KVServiceError(Exception):
    """Base of every kvsvc error, raised on the server and re-raised on the client.

    Subclasses register themselves (:meth:`__init_subclass__`): by name, by the
    reason they declare and as the default class of their code, the lookups that
    :func:`from_remote_error` and :func:`from_grpc_error` use.
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    reason: str = "UNKNOWN"
    retryable: bool = False
    #: Server side: a fatal error flips health to NOT_SERVING until restart.
    fatal: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, object] | None = None,
        transfer_state: TransferState = NO_TRANSFER,
        retryable: bool | None = None,
        request_id: str = "",
        type_name: str | None = None,
        code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
            if retryable is None and reason in REASONS:
                retryable = REASONS[reason].retryable  # the catalogue's default
        if retryable is not None:
            self.retryable = retryable
        if code is not None:
            self.code = code  # type: ignore[misc]  # instance override for unknown codes
        self.metadata: dict[str, str] = {k: str(v) for k, v in (metadata or {}).items()}
        self.transfer_state = transfer_state
        self.request_id = request_id
        self.type = type_name or type(self).__name__

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        own_reason = cls.__dict__.get("reason")
        if cls.__name__ in _BY_NAME:
            raise TypeError(f"a KVServiceError subclass named {cls.__name__} exists already")
        if own_reason in _BY_REASON:
            taken = _BY_REASON[own_reason].__name__
            raise TypeError(f"{cls.__name__}: reason {own_reason} is {taken}'s already")
        _BY_NAME[cls.__name__] = cls
        if own_reason is not None:
            _BY_REASON[own_reason] = cls
        # The first class declared for a code is its default (the most general one).
        _BY_CODE.setdefault(cls.code, cls)

    def __str__(self) -> str:
        extra = f" [{self.reason}"
        if self.request_id:
            extra += f" request_id={self.request_id}"
        return f"{self.message}{extra}]"


# --- request errors: the caller fixes its input or falls back (recompute) ---
class InvalidRequest(KVServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class UnsupportedRequest(InvalidRequest):
    """A request this server does not understand (unset oneof, unknown enum, newer envelope)."""

    reason = "UNSUPPORTED_REQUEST"


class MalformedRequest(InvalidRequest):
    """Request bytes that do not parse as the method's message (see :class:`Unparsed`)."""

    reason = "MALFORMED_REQUEST"


class InvalidDeadline(InvalidRequest, ValueError):
    """A deadline that is not a finite number of seconds > 0. Raised by the client
    before anything is sent; still a ValueError, which it was documented as."""

    reason = "INVALID_DEADLINE"


class LayoutMismatch(KVServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "LAYOUT_MISMATCH"


class NotFound(KVServiceError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class Miss(NotFound):
    """A chunk the caller required is not in the store."""

    reason = "CHUNK_NOT_FOUND"


class MappingLost(NotFound):
    """The mapping is unknown here: the server restarted or it was unmapped. Map again."""

    reason = "MAPPING_NOT_FOUND"


class CudaUnavailable(KVServiceError):
    """A CUDA IPC handle reached a server that has no CUDA: no retry can help here."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "CUDA_UNAVAILABLE"


class CapacityExhausted(KVServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "CAPACITY_EXHAUSTED"


class PermissionDenied(KVServiceError):
    """The caller is known but may not do this (another tenant's namespace, a file the
    server will not open for it). The message never says what exists."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class Unauthenticated(KVServiceError):
    """No valid credentials: a missing, unknown or expired token (gRPC status only)."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class Unimplemented(KVServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED
    reason = "UNIMPLEMENTED"


# --- deadlines and transport ---
class DeadlineExceeded(KVServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


class Cancelled(KVServiceError):
    code = grpc.StatusCode.CANCELLED
    reason = "CANCELLED"


class ServiceUnavailable(KVServiceError):
    """The transport failed (connection refused or lost); another try may succeed."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "TRANSPORT_UNAVAILABLE"
    retryable = True


class ServiceNotServing(KVServiceError):
    """This instance had a fatal failure or is shutting down; go elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "SERVICE_NOT_SERVING"


# --- transfers whose outcome matters for buffer reuse ---
class TransferUnprovable(KVServiceError):
    """A copy may still be writing the client's blocks: keep them leased, fence first."""

    code = grpc.StatusCode.UNKNOWN
    reason = "TRANSFER_UNPROVABLE"

    def __init__(self, message: str, **kwargs: object) -> None:
        kwargs.setdefault("transfer_state", UNKNOWN)
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class RegionUnavailable(KVServiceError):
    """A mapped region cannot be used (missing, too small, or truncated by its owner)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "REGION_UNAVAILABLE"


# --- server faults ---
class RemoteHandlerError(KVServiceError):
    """A server handler failed unexpectedly; the traceback is in the server log."""

    code = grpc.StatusCode.INTERNAL
    reason = "HANDLER_FAILED"


class DataLoss(RemoteHandlerError):
    """A stored chunk failed its checksum: memory corruption on the server."""

    code = grpc.StatusCode.DATA_LOSS
    reason = "CHECKSUM_MISMATCH"
    fatal = True


class FatalServerError(RemoteHandlerError):
    """Device error, dead or stalled transfer worker: the instance stops serving."""

    reason = "FATAL_SERVER_ERROR"
    fatal = True


# TransferUnprovable is declared first with UNKNOWN, but an unknown failure is a handler's.
_BY_CODE[grpc.StatusCode.UNKNOWN] = RemoteHandlerError
_STATUS_BY_VALUE = {s.value[0]: s for s in grpc.StatusCode}


# --- the reason catalogue: every reason kvsvc raises, declared once ---
@dataclass(frozen=True)
class Reason:
    """One ``reason`` of the wire contract. README's reason table and the Node and Go
    clients' tests are checked against these (scripts/gen_reasons.py,
    proto/kvsvc/v1/reasons.json); tests/server/test_reasons.py fails on a reason raised
    anywhere in kvsvc that is not declared here."""

    name: str
    #: The class that carries it, hence its gRPC code.
    cls: type[KVServiceError]
    code: grpc.StatusCode
    #: The default when raised without ``retryable=`` (the class's, unless declared).
    retryable: bool
    #: Made by a client (transport failure, local check), never in a server's envelope.
    client: bool
    meaning: str


def _reason(
    name: str,
    cls: type[KVServiceError],
    meaning: str,
    *,
    retryable: bool | None = None,
    client: bool = False,
    code: grpc.StatusCode | None = None,
) -> Reason:
    return Reason(
        name=name,
        cls=cls,
        code=cls.code if code is None else code,
        retryable=cls.retryable if retryable is None else retryable,
        client=client,
        meaning=meaning,
    )


_TRANSPORT_MEANINGS = {
    grpc.StatusCode.UNAVAILABLE: "connection refused or lost; another try may succeed",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the call's deadline passed before a reply came",
    grpc.StatusCode.CANCELLED: "the call was cancelled by the caller",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "a message exceeded gRPC's size limit",
    grpc.StatusCode.UNIMPLEMENTED: "the server does not have this method (an older server)",
}


def _transport(code: grpc.StatusCode) -> Reason:
    """What :func:`from_grpc_error` makes of a gRPC status: nothing ran on the server
    that a RemoteHandlerError could describe, so INTERNAL/UNKNOWN give the base class."""
    cls = _BY_CODE.get(code, KVServiceError)
    return _reason(
        f"TRANSPORT_{code.name}",
        KVServiceError if cls is RemoteHandlerError else cls,
        _TRANSPORT_MEANINGS.get(code, f"the transport failed with gRPC status {code.name}"),
        retryable=code is grpc.StatusCode.UNAVAILABLE,
        client=True,
        code=code,
    )


#: A transport failure's reason, by gRPC status (OK is no failure: it has none).
TRANSPORT_REASONS: dict[grpc.StatusCode, Reason] = {
    c: _transport(c) for c in grpc.StatusCode if c is not grpc.StatusCode.OK
}

# Grouped by class, in declaration order; a class's own reason comes first.
_CATALOGUE: tuple[Reason, ...] = (
    _reason("UNKNOWN", KVServiceError, "the base class's reason: an error raised without one"),
    _reason(
        "EMPTY_RESPONSE",
        KVServiceError,
        "the response has neither result nor error (a newer server?)",
        client=True,
    ),
    _reason(
        "INVALID_ARGUMENT", InvalidRequest, "a request field is invalid; the message says which"
    ),
    _reason("BLOCK_OUT_OF_RANGE", InvalidRequest, "a block id is outside the mapping's blocks"),
    _reason("KEY_TOO_LONG", InvalidRequest, "a key is longer than the server allows"),
    _reason("NAMESPACE_TOO_LONG", InvalidRequest, "the namespace is longer than the server allows"),
    _reason(
        "RANK_BLOCKS_DISAGREE", InvalidRequest, "a mapping's ranks declare different block counts"
    ),
    _reason(
        "MIXED_REGION_KINDS",
        InvalidRequest,
        "a mapping mixes shared-memory and CUDA ranks; all must be of one kind",
    ),
    _reason(
        "TENSOR_OUT_OF_BOUNDS",
        InvalidRequest,
        "a tensor's shape, strides and dtype reach past the end of its handle",
    ),
    _reason(
        "INVALID_REGION_NAME",
        InvalidRequest,
        "a shared-memory name is not a regular file directly inside the shm dir",
    ),
    _reason("MAPPING_CLOSING", InvalidRequest, "the mapping is being unmapped"),
    _reason(
        "DUPLICATE_TRANSFER_ID", InvalidRequest, "the transfer id was used before; pick a fresh one"
    ),
    _reason(
        "TRANSFER_BARRED",
        InvalidRequest,
        "the transfer id was fenced before the transfer arrived; it will never run",
    ),
    _reason(
        "FD_PASSING_DISABLED",
        InvalidRequest,
        "the server runs with --fd-socket off and refuses memfd handles "
        "(the Python and Go clients raise it as Unimplemented before sending one)",
    ),
    _reason(
        "FD_NOT_SEALED",
        InvalidRequest,
        "a passed fd is not a non-empty memfd sealed against shrinking",
    ),
    _reason(
        "FD_TOKEN_UNKNOWN",
        InvalidRequest,
        "a memfd token is unknown or expired (or the server restarted): pass the fd again",
    ),
    _reason(
        "FD_PASS_MALFORMED",
        InvalidRequest,
        "the fd socket got something other than one fd with the expected message",
    ),
    _reason(
        "UNSUPPORTED_REQUEST",
        UnsupportedRequest,
        "the server does not understand the request (unset oneof, unknown enum value)",
    ),
    _reason(
        "UNSUPPORTED_ENVELOPE_VERSION",
        UnsupportedRequest,
        "the request header names an envelope version this server does not speak",
    ),
    _reason(
        "MALFORMED_REQUEST",
        MalformedRequest,
        "the request bytes do not parse as the method's message",
    ),
    _reason(
        "INVALID_DEADLINE",
        InvalidDeadline,
        "a deadline is not a finite number of seconds > 0; nothing was sent",
        client=True,
    ),
    _reason(
        "LAYOUT_MISMATCH", LayoutMismatch, "chunks only load into the layout they were stored with"
    ),
    _reason(
        "BLOCK_COUNT_MISMATCH",
        LayoutMismatch,
        "a chunk holds a different number of blocks than the request lists for it",
    ),
    _reason("NOT_FOUND", NotFound, "something the request names does not exist"),
    _reason("CHUNK_NOT_FOUND", Miss, "a chunk the caller required is not in the store"),
    _reason(
        "MAPPING_NOT_FOUND",
        MappingLost,
        "the mapping is unknown here (the server restarted, or it was unmapped): map again",
    ),
    _reason(
        "CUDA_UNAVAILABLE",
        CudaUnavailable,
        "a CUDA IPC handle reached a server without CUDA; no retry can help",
    ),
    _reason("CAPACITY_EXHAUSTED", CapacityExhausted, "the chunk store cannot hold the data now"),
    _reason(
        "REQUEST_EXCEEDS_CAPACITY",
        CapacityExhausted,
        "the request is larger than the whole store: it can never fit",
    ),
    _reason(
        "FD_TOKENS_EXHAUSTED",
        CapacityExhausted,
        "too many passed fds are waiting for their Map (per process or in all)",
    ),
    _reason(
        "TENANT_QUOTA_EXCEEDED",
        CapacityExhausted,
        "the caller's tenant is at one of its quotas (metadata: quota, used, limit): "
        "mappings, in-flight transfers or passed fds",
    ),
    _reason(
        "FD_SOCKET_BUSY",
        CapacityExhausted,
        "the fd socket serves as many unfinished connections as it takes; retry",
        retryable=True,
    ),
    _reason(
        "PERMISSION_DENIED",
        PermissionDenied,
        "the caller's tenant may not do this (e.g. a namespace it is not granted)",
    ),
    _reason(
        "REGION_NOT_TRUSTED",
        PermissionDenied,
        "a shared-memory file is not one the server opens by name: more than one link, "
        "an owner outside --shm-uids, group/world writable, or names are off",
    ),
    _reason(
        "UNAUTHENTICATED",
        Unauthenticated,
        "the class's own reason; a server refuses credentials with the gRPC status "
        "UNAUTHENTICATED (TRANSPORT_UNAUTHENTICATED): nothing ran",
        client=True,
    ),
    _reason("UNIMPLEMENTED", Unimplemented, "the server does not implement this call"),
    _reason("DEADLINE_EXCEEDED", DeadlineExceeded, "the call's deadline passed"),
    _reason(
        "DEADLINE_TOO_SHORT",
        DeadlineExceeded,
        "too little time was left for the copy, so it was not started",
    ),
    _reason(
        "DEFAULT_DEADLINE_EXCEEDED",
        DeadlineExceeded,
        "a call without a deadline ran past the server's --default-deadline",
    ),
    _reason(
        "REGION_NOT_READY",
        DeadlineExceeded,
        "Map kept failing to open a region until the deadline; the last error is in metadata",
    ),
    _reason("FENCE_TIMEOUT", DeadlineExceeded, "copies were still running at the Fence deadline"),
    _reason(
        "UNMAP_FENCE_TIMEOUT",
        DeadlineExceeded,
        "copies were still running at the Unmap deadline; the mapping stays",
    ),
    _reason(
        "FD_SOCKET_TIMEOUT",
        DeadlineExceeded,
        "an fd exchange on the fd socket did not finish in time",
    ),
    _reason("CANCELLED", Cancelled, "the call was cancelled"),
    _reason(
        "TRANSPORT_UNAVAILABLE",
        ServiceUnavailable,
        _TRANSPORT_MEANINGS[grpc.StatusCode.UNAVAILABLE],
        client=True,
    ),
    _reason(
        "CLIENT_CLOSED",
        ServiceUnavailable,
        "the client was closed; the request was not sent",
        retryable=False,
        client=True,
    ),
    _reason(
        "FD_SOCKET_UNAVAILABLE",
        ServiceUnavailable,
        "the fd socket cannot be reached or closed without an answer",
        client=True,
    ),
    _reason(
        "SERVICE_NOT_SERVING",
        ServiceNotServing,
        "the instance had a fatal failure or is shutting down; go elsewhere",
    ),
    _reason(
        "TRANSFER_UNPROVABLE",
        TransferUnprovable,
        "a transfer's reply was lost after it may have reached the server: "
        "keep the blocks leased, fence first",
        client=True,
    ),
    _reason("REGION_UNAVAILABLE", RegionUnavailable, "a mapped region cannot be used"),
    _reason(
        "REGION_TOO_SMALL",
        RegionUnavailable,
        "a region is smaller than its tensors need (a memfd's: InvalidRequest, it cannot grow)",
    ),
    _reason(
        "REGION_TRUNCATED",
        RegionUnavailable,
        "the owner truncated a shared-memory region after Map",
    ),
    _reason("DEVICE_NOT_FOUND", RegionUnavailable, "no visible CUDA device has the handle's uuid"),
    _reason(
        "MAP_FAILED", RegionUnavailable, "opening a rank's region failed; the message says why"
    ),
    _reason(
        "HANDLER_FAILED",
        RemoteHandlerError,
        "a server handler failed unexpectedly; the traceback is in the server log",
    ),
    _reason(
        "CHECKSUM_MISMATCH",
        DataLoss,
        "a stored chunk failed its checksum: memory corruption on the server",
    ),
    _reason(
        "FATAL_SERVER_ERROR", FatalServerError, "the instance failed fatally and stops serving"
    ),
    _reason("TRANSFER_WORKER_FAILED", FatalServerError, "a copy failed with a device error"),
    _reason("TRANSFER_WORKER_DIED", FatalServerError, "a transfer worker thread died"),
    _reason(
        "TRANSFER_STALLED",
        FatalServerError,
        "a copy ran longer than --stall-timeout",
    ),
    _reason("EVENT_LOOP_STALLED", FatalServerError, "the server's event loop missed its heartbeat"),
    *(r for r in TRANSPORT_REASONS.values() if r.name != "TRANSPORT_UNAVAILABLE"),
)
#: Every reason kvsvc raises, by name (the wire value).
REASONS: dict[str, Reason] = {r.name: r for r in _CATALOGUE}


def catalogue() -> dict[str, object]:
    """The catalogue as JSON-able data, for the other clients' tests and the README:
    the classes (with the default class of each code) and the reasons."""
    classes: list[type[KVServiceError]] = [KVServiceError, *_BY_NAME.values()]

    def parent(c: type[KVServiceError]) -> str:
        bases = [b.__name__ for b in c.__mro__[1:] if issubclass(b, KVServiceError)]
        return bases[0] if bases else ""

    # Every client has these: a server sends them, they are the default of a code,
    # or (TransferUnprovable) the class of any envelope whose transfer state is UNKNOWN.
    every_client = (
        {r.cls for r in _CATALOGUE if not r.client} | set(_BY_CODE.values()) | {TransferUnprovable}
    )
    return {
        "classes": [
            {
                "name": c.__name__,
                "parent": parent(c),
                "code": c.code.name,
                "reason": c.reason,
                "retryable": c.retryable,
                "everyClient": c in every_client,
            }
            for c in classes
        ],
        "defaultClassByCode": {code.name: c.__name__ for code, c in _BY_CODE.items()},
        "reasons": [
            {
                "name": r.name,
                "class": r.cls.__name__,
                "code": r.code.name,
                "codeNumber": r.code.value[0],
                "retryable": r.retryable,
                "by": "client" if r.client else "server",
                "meaning": r.meaning,
            }
            for r in _CATALOGUE
        ],
    }


def _status_to_proto(code: grpc.StatusCode) -> error_pb2.Code.ValueType:
    return error_pb2.Code.ValueType(code.value[0])


def to_remote_error(
    exc: BaseException, request_id: str, default_state: TransferState = NO_TRANSFER
) -> error_pb2.RemoteError:
    """Build the bounded envelope for ``exc``; the traceback never goes on the wire.

    ``default_state`` is what the caller knows of the transfer when ``exc`` says nothing.
    """
    if isinstance(exc, KVServiceError):
        cls_code, reason, retryable = exc.code, exc.reason, exc.retryable
        metadata, state, type_name = exc.metadata, exc.transfer_state, exc.type
        message = exc.message
    else:
        cls_code, reason, retryable = grpc.StatusCode.INTERNAL, RemoteHandlerError.reason, False
        metadata, state, type_name = {}, NO_TRANSFER, type(exc).__name__
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    text, cut = truncate_utf8(message)
    return error_pb2.RemoteError(
        envelope_version=ENVELOPE_VERSION,
        type=type_name[:256],
        message=text,
        message_truncated=cut,
        code=_status_to_proto(cls_code),
        reason=reason[:MAX_REASON_CHARS],
        metadata={k: truncate_utf8(v, 1024)[0] for k, v in metadata.items()},
        request_id=request_id,
        retryable=retryable,
        transfer_state=error_pb2.TransferState.ValueType(state or default_state),
    )


def from_remote_error(err: error_pb2.RemoteError) -> KVServiceError:
    """The exception a client raises for an envelope; unknown codes/reasons still map."""
    code = _STATUS_BY_VALUE.get(int(err.code), grpc.StatusCode.UNKNOWN)
    cls: type[KVServiceError]
    if err.transfer_state == UNKNOWN:
        cls = TransferUnprovable
    else:
        # The server raises these same classes: its class name is the best key,
        # then the stable reason, then the code (a newer server's new reason).
        cls = (
            _BY_NAME.get(err.type)
            or _BY_REASON.get(err.reason)
            or _BY_CODE.get(code, KVServiceError)
        )
    exc = cls(
        err.message,
        reason=err.reason,
        metadata=dict(err.metadata),
        transfer_state=err.transfer_state,
        retryable=err.retryable,
        request_id=err.request_id,
        type_name=err.type,
        code=code,
    )
    exc.message_truncated = err.message_truncated  # type: ignore[attr-defined]
    return exc


def from_grpc_error(
    exc: grpc.RpcError, *, request_id: str = "", transfer_started: bool = False
) -> KVServiceError:
    """Map a transport failure; a transfer whose reply was lost becomes unprovable.

    ``transfer_started``: the request may have reached the server, so a copy may
    be running there; only a fence can prove otherwise.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(code)
    metadata = {"grpcCode": code.name}
    # UNIMPLEMENTED and UNAUTHENTICATED are answered before any handler runs.
    if transfer_started and code not in (
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAUTHENTICATED,
    ):
        return TransferUnprovable(
            f"transfer outcome unknown after {code.name}: {details}",
            metadata=metadata,
            request_id=request_id,
            code=code,
        )
    # A status OK is no failure; should grpc ever raise one, it is as good as UNKNOWN.
    declared = TRANSPORT_REASONS.get(code) or TRANSPORT_REASONS[grpc.StatusCode.UNKNOWN]
    return declared.cls(
        details,
        reason=declared.name,
        metadata=metadata,
        request_id=request_id,
        code=code,
        retryable=declared.retryable,
    )


# --- requests that do not parse ---
class _NoHeader:
    """The header of a request that could not be read: the wrapper assigns an id."""

    request_id = ""
    envelope_version = 0


class Unparsed:
    """What the server's request deserializer hands the handler for bytes that do not
    parse. grpc would answer a deserializer exception with UNKNOWN and an ERROR
    traceback per request (a log flood); this way the handler answers the method's
    own response with a MALFORMED_REQUEST envelope (INVALID_ARGUMENT)."""

    __slots__ = ("error",)
    header = _NoHeader()

    def __init__(self, error: MalformedRequest) -> None:
        self.error = error

    def envelope(self, request_id: str, transfer: bool) -> error_pb2.RemoteError:
        """The reply's error; a transfer that did not parse never started."""
        return to_remote_error(self.error, request_id, NOT_STARTED if transfer else NO_TRANSFER)


class _BoundedLog:
    """At most one WARNING per ``interval_s``, counting what it held back: a peer
    sending garbage must not be able to fill the log."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = -math.inf
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        if held:
            msg += f" ({held} more since the last such message)"
        self.logger.warning(msg, *args)


BoundedLog = _BoundedLog  # the public name (kvsvc.integrations use it)

MALFORMED_LOG_INTERVAL_S = 10.0
_malformed_log = _BoundedLog(logging.getLogger("kvsvc.server.servicer"), MALFORMED_LOG_INTERVAL_S)


def request_parser(message_cls: type[Message]) -> Callable[[bytes], Message | Unparsed]:
    """A request deserializer for ``message_cls`` that never raises: bytes that do not
    parse become :class:`Unparsed`, logged at a bounded rate."""
    name = message_cls.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Message | Unparsed:
        try:
            return message_cls.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or worse: still a reply
            _malformed_log.warning(
                "a request of %d bytes does not parse as %s: %s", len(raw), name, exc
            )
            return Unparsed(
                MalformedRequest(
                    f"the request bytes do not parse as {name}",
                    metadata={
                        "messageType": name,
                        "sizeBytes": len(raw),
                        "error": type(exc).__name__,
                    },
                )
            )

    return parse
