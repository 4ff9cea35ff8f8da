"""The only code that converts between exceptions, ``RemoteError`` envelopes and gRPC
status codes. The server's handler wrapper turns any exception into a bounded
envelope with :func:`to_remote_error`; the client turns an envelope back into the
same class with :func:`from_remote_error`, and a transport failure with
:func:`from_grpc_error`."""

from __future__ import annotations

import traceback

import grpc

from kvsvc.errors.classes import (
    _BY_CODE,
    _BY_NAME,
    _BY_REASON,
    NO_TRANSFER,
    UNKNOWN,
    KVServiceError,
    RemoteHandlerError,
    TransferState,
    TransferUnprovable,
)
from kvsvc.errors.reasons import TRANSPORT_REASONS
from kvsvc.v1 import error_pb2

ENVELOPE_VERSION = 1
MAX_MESSAGE_BYTES = 4096
MAX_REASON_CHARS = 63


def truncate_utf8(text: str, limit: int = MAX_MESSAGE_BYTES) -> tuple[str, bool]:
    """Cut ``text`` to at most ``limit`` UTF-8 bytes without splitting a character."""
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= limit:
        return text, False
    # errors="ignore" drops the partial character left at the cut.
    return raw[:limit].decode("utf-8", errors="ignore"), True


_STATUS_BY_VALUE = {s.value[0]: s for s in grpc.StatusCode}
#: grpc.StatusCode -> the wire's Code (an enum's .value costs more than a dict hit).
_PROTO_CODE = {s: error_pb2.Code.ValueType(s.value[0]) for s in grpc.StatusCode}
MAX_METADATA_VALUE_BYTES = 1024
MAX_TYPE_CHARS = 256


def _bounded(text: str, limit: int) -> tuple[str, bool]:
    """truncate_utf8 without encoding text that cannot be over: a character is at
    most 4 UTF-8 bytes (the short messages an error path carries skip the encode)."""
    if len(text) * 4 <= limit:
        return text, False
    return truncate_utf8(text, limit)


def describe(exc: BaseException) -> str:
    """What ``traceback.format_exception_only`` says of ``exc`` ("module.Type:
    message"), without building a TracebackException for the usual case."""
    if isinstance(exc, SyntaxError) or getattr(exc, "__notes__", None):
        return "".join(traceback.format_exception_only(type(exc), exc)).strip()
    cls = type(exc)
    name = cls.__qualname__
    if cls.__module__ not in ("builtins", "__main__"):
        name = f"{cls.__module__}.{name}"
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - as traceback does for a __str__ that raises
        text = "<exception str() failed>"
    return f"{name}: {text}" if text else name


def to_remote_error(
    exc: BaseException,
    request_id: str,
    default_state: TransferState = NO_TRANSFER,
    into: error_pb2.RemoteError | None = None,
) -> error_pb2.RemoteError:
    """Build the bounded envelope for ``exc``; the traceback never goes on the wire.

    ``default_state`` is what the caller knows of the transfer when ``exc`` says
    nothing. ``into``: fill this (empty) message in place, e.g. a response's
    ``error`` field, rather than a new one its constructor would copy.
    """
    if isinstance(exc, KVServiceError):
        cls_code, reason, retryable = exc.code, exc.reason, exc.retryable
        metadata, state, type_name = exc.metadata, exc.transfer_state, exc.type
        message = exc.message
    else:
        cls_code, reason, retryable = grpc.StatusCode.INTERNAL, RemoteHandlerError.reason, False
        metadata, state, type_name = {}, NO_TRANSFER, type(exc).__name__
        message = describe(exc)
    env = error_pb2.RemoteError() if into is None else into
    env.envelope_version = ENVELOPE_VERSION
    env.type = type_name[:MAX_TYPE_CHARS]
    env.message, cut = _bounded(message, MAX_MESSAGE_BYTES)
    if cut:
        env.message_truncated = True
    env.code = _PROTO_CODE.get(cls_code, error_pb2.CODE_UNKNOWN)
    env.reason = reason[:MAX_REASON_CHARS]
    if metadata:
        target = env.metadata
        for k, v in metadata.items():
            target[k] = _bounded(v, MAX_METADATA_VALUE_BYTES)[0]
    env.request_id = request_id
    if retryable:
        env.retryable = True
    env.transfer_state = error_pb2.TransferState.ValueType(state or default_state)
    return env


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
