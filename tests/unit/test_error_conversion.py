"""The error contract without a server: every kvsvc error survives the trip
through a RemoteError envelope as the same class, reason, code and metadata;
other exceptions become HANDLER_FAILED without a traceback; envelopes are
bounded; transport failures map to typed errors, and a transfer whose reply was
lost is unprovable."""

from __future__ import annotations

import grpc
import pytest

from kvsvc import errors
from kvsvc.errors import (
    FINISHED,
    MAX_MESSAGE_BYTES,
    MAX_REASON_CHARS,
    NO_TRANSFER,
    NOT_STARTED,
    UNKNOWN,
    KVServiceError,
    RemoteHandlerError,
    ServiceUnavailable,
    TransferUnprovable,
    classes,
    from_grpc_error,
    from_remote_error,
    to_remote_error,
)
from kvsvc.v1 import error_pb2


def error_classes() -> list[type[KVServiceError]]:
    """Every error class kvsvc.errors declares (in kvsvc.errors.classes), found by
    walking the hierarchy."""
    out: list[type[KVServiceError]] = []
    todo = [KVServiceError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__ == classes.__name__ and sub not in out:
                out.append(sub)
                todo.append(sub)
    return sorted(out, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_round_trips_through_the_envelope(cls: type[KVServiceError]) -> None:
    exc = cls("it failed: blockId=7", metadata={"blockId": 7, "tpRank": 1}, request_id="r-1")
    env = to_remote_error(exc, "r-1")
    assert env.envelope_version == errors.ENVELOPE_VERSION
    assert env.reason == cls.reason and env.type == cls.__name__
    back = from_remote_error(error_pb2.RemoteError.FromString(env.SerializeToString()))
    assert type(back) is cls
    assert (back.reason, back.code, back.retryable) == (cls.reason, cls.code, cls.retryable)
    assert back.message == "it failed: blockId=7"
    assert back.metadata == {"blockId": "7", "tpRank": "1"}
    assert back.request_id == "r-1"
    assert back.transfer_state == exc.transfer_state


def test_reasons_are_upper_snake_and_bounded() -> None:
    for cls in error_classes():
        assert len(cls.reason) <= MAX_REASON_CHARS, cls
        assert cls.reason.replace("_", "").isalnum() and cls.reason.isupper(), cls


def test_a_reason_override_and_retryable_survive() -> None:
    exc = errors.CapacityExhausted("full", reason="REQUEST_EXCEEDS_CAPACITY", retryable=False)
    back = from_remote_error(to_remote_error(exc, "r"))
    assert type(back) is errors.CapacityExhausted
    assert (back.reason, back.retryable) == ("REQUEST_EXCEEDS_CAPACITY", False)


def test_an_unexpected_exception_is_handler_failed_without_a_traceback() -> None:
    try:
        raise KeyError("missing")
    except KeyError as caught:
        env = to_remote_error(caught, "r-2")
    assert env.reason == RemoteHandlerError.reason == "HANDLER_FAILED"
    assert env.code == grpc.StatusCode.INTERNAL.value[0]
    assert env.type == "KeyError"
    assert env.message == "KeyError: 'missing'"
    assert "Traceback" not in env.message and not env.retryable
    back = from_remote_error(env)
    assert isinstance(back, RemoteHandlerError) and back.type == "KeyError"


def test_the_callers_transfer_state_applies_when_the_error_has_none() -> None:
    exc = errors.InvalidRequest("bad")
    assert to_remote_error(exc, "r", NOT_STARTED).transfer_state == NOT_STARTED
    assert to_remote_error(exc, "r").transfer_state == NO_TRANSFER
    own = errors.DeadlineExceeded("late", transfer_state=FINISHED)
    assert to_remote_error(own, "r", NOT_STARTED).transfer_state == FINISHED


def test_an_unknown_transfer_state_is_unprovable_whatever_the_type() -> None:
    env = to_remote_error(errors.DeadlineExceeded("late", transfer_state=UNKNOWN), "r")
    back = from_remote_error(env)
    assert isinstance(back, TransferUnprovable)
    assert back.reason == "DEADLINE_EXCEEDED" and back.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_long_message_is_cut_on_a_character_boundary_and_flagged() -> None:
    message = "é" * MAX_MESSAGE_BYTES  # 2 bytes each: twice the limit
    env = to_remote_error(errors.InvalidRequest(message, metadata={"k": "ü" * 2000}), "r")
    assert env.message_truncated
    assert len(env.message.encode()) <= MAX_MESSAGE_BYTES
    assert set(env.message) == {"é"}
    assert len(env.metadata["k"].encode()) <= 1024 and set(env.metadata["k"]) == {"ü"}
    assert from_remote_error(env).message_truncated  # type: ignore[attr-defined]
    assert not to_remote_error(errors.InvalidRequest("short"), "r").message_truncated


def test_an_overlong_reason_is_cut_to_the_limit() -> None:
    env = to_remote_error(errors.InvalidRequest("x", reason="R" * 100), "r")
    assert env.reason == "R" * MAX_REASON_CHARS


def test_a_newer_servers_envelope_still_maps_by_reason_then_code() -> None:
    by_reason = error_pb2.RemoteError(
        type="SomeNewError",
        code=grpc.StatusCode.NOT_FOUND.value[0],
        reason="MAPPING_NOT_FOUND",
        message="m",
    )
    assert type(from_remote_error(by_reason)) is errors.MappingLost
    by_code = error_pb2.RemoteError(
        type="SomeNewError",
        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        reason="SOME_NEW_REASON",
        message="m",
    )
    back = from_remote_error(by_code)
    assert type(back) is errors.CapacityExhausted
    assert (back.reason, back.type) == ("SOME_NEW_REASON", "SomeNewError")
    unknown_code = error_pb2.RemoteError(type="X", code=99, reason="NEW", message="m")
    back = from_remote_error(unknown_code)
    assert isinstance(back, KVServiceError) and back.code is grpc.StatusCode.UNKNOWN


class _Failed(grpc.RpcError):
    """A transport failure as grpc reports one: a code and details."""

    def __init__(self, code: grpc.StatusCode, details: str | None = "went wrong") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


def test_a_refused_connection_is_retryable_transport_unavailable() -> None:
    """A real transport failure: nothing listens on the port."""
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        call = channel.unary_unary("/kvsvc.v1.KVCacheService/GetServerInfo")
        with pytest.raises(grpc.RpcError) as ei:
            call(b"", timeout=10)
    exc = from_grpc_error(ei.value, request_id="r-3")
    assert type(exc) is ServiceUnavailable
    assert (exc.reason, exc.retryable, exc.request_id) == ("TRANSPORT_UNAVAILABLE", True, "r-3")
    assert exc.metadata == {"grpcCode": "UNAVAILABLE"}


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, errors.Cancelled),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.CapacityExhausted),
        (grpc.StatusCode.UNIMPLEMENTED, errors.Unimplemented),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidRequest),
        # Not a server handler's failure: the transport's, so the base class.
        (grpc.StatusCode.INTERNAL, KVServiceError),
        (grpc.StatusCode.UNKNOWN, KVServiceError),
    ],
)
def test_transport_codes_map_to_classes(code: grpc.StatusCode, cls: type) -> None:
    exc = from_grpc_error(_Failed(code))
    assert type(exc) is cls
    assert exc.reason == f"TRANSPORT_{code.name}"
    assert exc.code is code and not exc.retryable
    assert exc.message == "went wrong"
    assert exc.metadata == {"grpcCode": code.name}


def test_details_default_to_the_code() -> None:
    assert from_grpc_error(_Failed(grpc.StatusCode.CANCELLED, None)).message == str(
        grpc.StatusCode.CANCELLED
    )


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL],
)
def test_a_started_transfer_whose_reply_was_lost_is_unprovable(code: grpc.StatusCode) -> None:
    exc = from_grpc_error(_Failed(code), request_id="r-4", transfer_started=True)
    assert type(exc) is TransferUnprovable
    assert exc.transfer_state == UNKNOWN and exc.reason == "TRANSFER_UNPROVABLE"
    assert exc.code is code and exc.request_id == "r-4"


def test_an_unimplemented_transfer_never_started() -> None:
    exc = from_grpc_error(_Failed(grpc.StatusCode.UNIMPLEMENTED), transfer_started=True)
    assert type(exc) is errors.Unimplemented
