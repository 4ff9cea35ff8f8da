"""The exception hierarchy of the error contract, shaped by how a caller reacts
(google-api-core's model): each class declares only its code and reason, and
registers itself by name, by reason and as the default class of its code, the
lookups :mod:`kvsvc.errors.envelope` converts with. The server raises these
classes and the client re-raises the same ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, TypeAlias

import grpc

from kvsvc.v1 import error_pb2

TransferState: TypeAlias = int  # a kvsvc.v1.TransferState value
NO_TRANSFER: TransferState = error_pb2.TRANSFER_STATE_UNSPECIFIED
NOT_STARTED: TransferState = error_pb2.TRANSFER_STATE_NOT_STARTED
FINISHED: TransferState = error_pb2.TRANSFER_STATE_FINISHED
UNKNOWN: TransferState = error_pb2.TRANSFER_STATE_UNKNOWN


# Filled by KVServiceError.__init_subclass__, in declaration order.
_BY_NAME: dict[str, type[KVServiceError]] = {}
_BY_REASON: dict[str, type[KVServiceError]] = {}
_BY_CODE: dict[grpc.StatusCode, type[KVServiceError]] = {}
#: The catalogue's ``retryable`` default of each declared reason. Filled by
#: kvsvc.errors.reasons, which names these classes and so is declared after them.
_RETRYABLE_BY_REASON: dict[str, bool] = {}


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
            if retryable is None:
                retryable = _RETRYABLE_BY_REASON.get(reason)  # the catalogue's default
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


# --- streams (declared after RemoteHandlerError: INTERNAL stays a handler's) ---
class ProtocolViolation(KVServiceError):
    """A stream broke its contract (a gap, a duplicate, a live batch before the
    snapshot ended, another incarnation without ``lost``): a follower drops its
    cursor and resyncs from a fresh snapshot."""

    code = grpc.StatusCode.INTERNAL
    reason = "EVENTS_PROTOCOL"


# TransferUnprovable is declared first with UNKNOWN, but an unknown failure is a handler's.
_BY_CODE[grpc.StatusCode.UNKNOWN] = RemoteHandlerError
