"""What both ends agree on: message and name limits, gRPC channel options, the
socket names in --socket-dir, and the client's deadline defaults and their
validation. Server settings are kvsvc.server.config's; this module holds no flag."""

from __future__ import annotations

import math

from kvsvc.errors import InvalidDeadline

MiB = 1 << 20
GiB = 1 << 30

# One limit for both ends: a Store of 16 inline 2 MiB chunks must fit, and the
# 4 MiB gRPC default must never be the silent ceiling.
MAX_MESSAGE_BYTES = 256 * MiB

# Chunk keys are hashes and namespaces name a model + layout + tenant: both are
# short. Bounding them keeps what one chunk costs the server near its bytes.
MAX_KEY_BYTES = 1024
MAX_NAMESPACE_BYTES = 1024

# Keepalive: the client pings no more often than the server permits, so no
# GOAWAY "too_many_pings".
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
SERVER_MIN_PING_INTERVAL_MS = 10_000


def channel_options() -> list[tuple[str, int]]:
    """Options for client channels."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        # Its own connections: a client made after the server restarted connects at
        # once, instead of sharing another channel's subchannel and reconnect backoff
        # (gRPC's global pool), which failed a fresh client with the old error.
        ("grpc.use_local_subchannel_pool", 1),
    ]


def server_options() -> list[tuple[str, int]]:
    """Options for the server."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),
    ]


# The sockets' names in --socket-dir.
FD_SOCKET_NAME = "fd.sock"
GRPC_SOCKET_NAME = "grpc.sock"
# How long the client waits for the fd socket's answer.
FD_EXCHANGE_TIMEOUT_S = 5.0

# --- client deadlines ---
DEFAULT_TRANSFER_DEADLINE_S = 30.0
DEFAULT_CONTROL_DEADLINE_S = 5.0
# gRPC's deadline arithmetic overflows near 8e9 s; nothing needs more than days.
MAX_DEADLINE_S = 1e6


def validate_deadline(value: object, setting: str) -> float:
    """A deadline is a finite number of seconds > 0; anything else is InvalidDeadline
    (a kvsvc error that is also the ValueError this was documented to raise)."""
    metadata = {"setting": setting, "value": repr(value)[:100]}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidDeadline(
            f"{setting} must be a number of seconds, got {value!r}", metadata=metadata
        )
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidDeadline(
            f"{setting} must be finite and > 0 seconds, got {value!r}", metadata=metadata
        )
    if seconds > MAX_DEADLINE_S:
        raise InvalidDeadline(
            f"{setting} must be at most {MAX_DEADLINE_S:g} seconds, got {value!r}",
            metadata=metadata,
        )
    return seconds
