"""All configuration in one place: server settings (flags with ``KVSVC_*``
environment equivalents), gRPC channel options shared by both ends, and the
client's deadline defaults and their validation."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

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


# --- sealed memfd passing (kvsvc.fdpass) ---
# A passed fd that a Map has used is held until this long after it was passed (a
# failed Map can be retried, ranks can share one fd); one that no Map has used is
# closed FD_TOKEN_UNUSED_TTL_S after it was passed, so an abandoned pass frees its
# place promptly.
FD_TOKEN_TTL_S = 60.0
FD_TOKEN_UNUSED_TTL_S = 10.0
# At most this many passed fds held at once (and at most a quarter of the soft
# RLIMIT_NOFILE), and at most FD_TOKENS_PER_PEER_MAX from one process, so one
# cannot take every place. Peers in another pid namespace show as pid 0: they
# share one per-peer quota.
FD_TOKENS_MAX = 1024
FD_TOKENS_PER_PEER_MAX = 256
# The fd socket serves up to FD_PEERS_MAX connections at once; one that has not
# sent its fd FD_PEER_TIMEOUT_S after it was accepted is closed, and never delays
# the others.
FD_PEERS_MAX = 64
FD_PEER_TIMEOUT_S = 2.0
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


# --- server settings ---
def _parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '1GiB', '64M' or '2G'."""
    units = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if s and s[-1] in units:
        mult, s = units[s[-1]], s[:-1]
    try:
        value = int(float(s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        return validate_deadline(float(text), "value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one ``kvsvc serve`` process (flags, else KVSVC_* env, else default)."""

    listen: str = "127.0.0.1:50051"
    store_bytes: int = GiB
    shm_dir: str = "/dev/shm"
    fd_socket: str = "auto"
    device: str = "auto"
    transfer_threads: int = 2
    shutdown_grace: float = 10.0
    stall_timeout: float = 10.0
    default_deadline: float = DEFAULT_TRANSFER_DEADLINE_S
    exit_on_fatal: bool = False
    metrics_port: int = 0
    log_format: str = "text"
    log_level: str = "INFO"


_HELP = {
    "listen": "address to listen on: HOST:PORT (port 0 picks a free one) or unix:PATH",
    "store_bytes": "chunk store capacity in bytes (suffixes K, M, G; MiB/GiB accepted); "
    "least recently used chunks are evicted beyond it",
    "shm_dir": "directory holding clients' shared-memory regions; names cannot escape it",
    "fd_socket": "unix socket that takes clients' sealed memfds (the fast CPU region kind): "
    "a path, 'auto' (a per-server name in the shm dir) or 'off'",
    "device": "where mapped regions live: 'cpu', 'cuda', or 'auto' (cuda when available)",
    "transfer_threads": "worker threads that run copies off the event loop",
    "shutdown_grace": "seconds that SIGTERM/SIGINT lets in-flight calls finish",
    "stall_timeout": "seconds a copy may run before the server declares itself stalled",
    "default_deadline": "seconds a call that carries no gRPC deadline may take here: "
    "queueing, copying and the handler alike",
    "exit_on_fatal": "exit non-zero after a fatal failure once in-flight copies are fenced",
    "metrics_port": "Prometheus metrics HTTP port (0 = off)",
    "log_format": "'text' or 'json' (one JSON object per line, with request ids)",
    "log_level": "logging level (DEBUG, INFO, WARNING, ERROR)",
}
_TYPES: dict[str, Callable[[str], Any]] = {
    "store_bytes": _parse_size,
    "transfer_threads": _positive_int,
    "shutdown_grace": _positive_float,
    "stall_timeout": _positive_float,
    "default_deadline": _positive_float,
    "metrics_port": int,
}


def env_name(field_name: str) -> str:
    return "KVSVC_" + field_name.upper()


def _env_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare one flag per ServerConfig field; the env var is the fallback default."""
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = env_name(f.name)
        help_text = f"{_HELP[f.name]} (env {env}; default %(default)s)"
        if f.type in (bool, "bool"):
            default_b = _env_bool(os.environ[env]) if env in os.environ else f.default
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default_b, help=help_text
            )
            continue
        conv: Callable[[str], Any] = _TYPES.get(f.name, str)
        default = os.environ.get(env, f.default)
        if isinstance(default, str) and f.name in _TYPES:
            try:
                default = conv(default)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"{env}: {exc}")
        parser.add_argument(flag, type=conv, default=default, help=help_text)
    parser.set_defaults(_config_fields=[f.name for f in fields(ServerConfig)])


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    cfg = ServerConfig(**{name: getattr(args, name) for name in args._config_fields})
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"--device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.log_format not in ("text", "json"):
        raise SystemExit(f"--log-format must be text or json, got {cfg.log_format!r}")
    return cfg


def parse_server_config(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser(prog="kvsvc serve")
    add_server_arguments(parser)
    return config_from_args(parser.parse_args(argv))
