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


class KVServiceError(Exception):
    """Base of every kvsvc error, raised on the server and re-raised on the client."""

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
        if retryable is not None:
            self.retryable = retryable
        if code is not None:
            self.code = code  # type: ignore[misc]  # instance override for unknown codes
        self.metadata: dict[str, str] = {k: str(v) for k, v in (metadata or {}).items()}
        self.transfer_state = transfer_state
        self.request_id = request_id
        self.type = type_name or type(self).__name__

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


_CLASSES: list[type[KVServiceError]] = [
    InvalidRequest,
    UnsupportedRequest,
    MalformedRequest,
    InvalidDeadline,
    LayoutMismatch,
    CudaUnavailable,
    NotFound,
    Miss,
    MappingLost,
    CapacityExhausted,
    Unimplemented,
    DeadlineExceeded,
    Cancelled,
    ServiceUnavailable,
    ServiceNotServing,
    TransferUnprovable,
    RegionUnavailable,
    RemoteHandlerError,
    DataLoss,
    FatalServerError,
]
_BY_NAME: dict[str, type[KVServiceError]] = {c.__name__: c for c in _CLASSES}
_BY_REASON: dict[str, type[KVServiceError]] = {c.reason: c for c in _CLASSES}
# First class declared for a code is its default (the most general one).
_BY_CODE: dict[grpc.StatusCode, type[KVServiceError]] = {}
for _cls in _CLASSES:
    _BY_CODE.setdefault(_cls.code, _cls)
_BY_CODE[grpc.StatusCode.UNAVAILABLE] = ServiceUnavailable
_BY_CODE[grpc.StatusCode.INTERNAL] = RemoteHandlerError
_BY_CODE[grpc.StatusCode.UNKNOWN] = RemoteHandlerError
_STATUS_BY_VALUE = {s.value[0]: s for s in grpc.StatusCode}


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
    if transfer_started and code is not grpc.StatusCode.UNIMPLEMENTED:
        return TransferUnprovable(
            f"transfer outcome unknown after {code.name}: {details}",
            metadata=metadata,
            request_id=request_id,
            code=code,
        )
    cls = _BY_CODE.get(code, KVServiceError)
    if cls in (RemoteHandlerError,):
        cls = KVServiceError
    return cls(
        details,
        reason=f"TRANSPORT_{code.name}",
        metadata=metadata,
        request_id=request_id,
        code=code,
        retryable=code is grpc.StatusCode.UNAVAILABLE,
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


MALFORMED_LOG_INTERVAL_S = 10.0
_malformed_log = _BoundedLog(logging.getLogger("kvsvc.server"), MALFORMED_LOG_INTERVAL_S)


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
