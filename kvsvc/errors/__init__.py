"""The error contract: one exception hierarchy for server and client, and the only
code that converts between exceptions, ``RemoteError`` envelopes and gRPC status
codes. Import from here; the modules are split by job:

- :mod:`~kvsvc.errors.classes`: the hierarchy, shaped by how a caller reacts, and
  the transfer states an error carries;
- :mod:`~kvsvc.errors.reasons`: the catalogue of every reason kvsvc raises
  (``REASONS``, :func:`catalogue`, which scripts/gen_reasons.py publishes);
- :mod:`~kvsvc.errors.envelope`: exception ⇄ ``RemoteError`` and gRPC status →
  exception, bounded on the wire;
- :mod:`~kvsvc.errors.parsing`: request bytes that do not parse, and the
  rate-bounded log that keeps a garbage-sending peer from filling the log.
"""

from kvsvc.errors.classes import (
    FINISHED,
    NO_TRANSFER,
    NOT_STARTED,
    UNKNOWN,
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
from kvsvc.errors.envelope import (
    ENVELOPE_VERSION,
    MAX_MESSAGE_BYTES,
    MAX_REASON_CHARS,
    from_grpc_error,
    from_remote_error,
    to_remote_error,
    truncate_utf8,
)
from kvsvc.errors.parsing import MALFORMED_LOG_INTERVAL_S, BoundedLog, Unparsed, request_parser
from kvsvc.errors.reasons import REASONS, TRANSPORT_REASONS, Reason, catalogue

__all__ = [
    "ENVELOPE_VERSION",
    "FINISHED",
    "MALFORMED_LOG_INTERVAL_S",
    "MAX_MESSAGE_BYTES",
    "MAX_REASON_CHARS",
    "NOT_STARTED",
    "NO_TRANSFER",
    "REASONS",
    "TRANSPORT_REASONS",
    "UNKNOWN",
    "BoundedLog",
    "Cancelled",
    "CapacityExhausted",
    "CudaUnavailable",
    "DataLoss",
    "DeadlineExceeded",
    "FatalServerError",
    "InvalidDeadline",
    "InvalidRequest",
    "KVServiceError",
    "LayoutMismatch",
    "MalformedRequest",
    "MappingLost",
    "Miss",
    "NotFound",
    "PermissionDenied",
    "ProtocolViolation",
    "Reason",
    "RegionUnavailable",
    "RemoteHandlerError",
    "ServiceNotServing",
    "ServiceUnavailable",
    "TransferUnprovable",
    "Unauthenticated",
    "Unimplemented",
    "Unparsed",
    "UnsupportedRequest",
    "catalogue",
    "from_grpc_error",
    "from_remote_error",
    "request_parser",
    "to_remote_error",
    "truncate_utf8",
]
