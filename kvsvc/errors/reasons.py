"""The reason catalogue: every ``reason`` kvsvc raises, declared once with the class
that carries it (hence its gRPC code), whether a retry may help by default and what
it means. docs/errors.md's reason table and proto/kvsvc/v1/reasons.json are generated from
:func:`catalogue` (scripts/gen_reasons.py); tests/server/test_reasons.py fails on a
reason raised anywhere in kvsvc that is not declared here."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvsvc.errors.classes import (
    _BY_CODE,
    _BY_NAME,
    _RETRYABLE_BY_REASON,
    Cancelled,
    CapacityExhausted,
    CudaUnavailable,
    DataLoss,
    DeadlineExceeded,
    FatalServerError,
    InvalidDeadline,
    InvalidRequest,
    KVServiceError,
    LayoutMismatch,
    MalformedRequest,
    MappingLost,
    Miss,
    NotFound,
    PermissionDenied,
    ProtocolViolation,
    RegionUnavailable,
    RemoteHandlerError,
    ServiceNotServing,
    ServiceUnavailable,
    TransferUnprovable,
    Unauthenticated,
    Unimplemented,
    UnsupportedRequest,
)


@dataclass(frozen=True)
class Reason:
    """One ``reason`` of the wire contract, as the other clients' tests read it."""

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
        "FD_NOT_A_FILE",
        InvalidRequest,
        "a passed shared-memory file is not a non-empty regular file open for reading and writing",
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
        "INLINE_BUDGET_EXHAUSTED",
        CapacityExhausted,
        "large requests (inline data) hold --inline-budget-bytes already: refused before "
        "it was parsed; retry",
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
    _reason(
        "EVENTS_PROTOCOL",
        ProtocolViolation,
        "an events stream broke its contract (gap, duplicate, incarnation without lost): "
        "the follower resyncs",
        client=True,
    ),
    _reason(
        "EVENTS_LAYOUTS",
        KVServiceError,
        "a presence index saw more (layout, tier) pairs in one namespace than it tracks",
        client=True,
    ),
    _reason(
        "EVENTS_CALLBACK",
        KVServiceError,
        "a presence index's on_batch callback raised; the index keeps following",
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
        "a stored chunk failed its checksum; this server answers it as a chunk not "
        "loaded (and drops it), older ones with this fatal error",
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
_RETRYABLE_BY_REASON.update({r.name: r.retryable for r in _CATALOGUE})


def catalogue() -> dict[str, object]:
    """The catalogue as JSON-able data, for the other clients' tests and docs/errors.md:
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
