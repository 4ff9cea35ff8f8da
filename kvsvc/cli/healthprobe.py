"""``python -m kvsvc.cli.healthprobe``: grpc_health_probe's command line and exit codes,
in Python, for images built where its release binary cannot be downloaded
(docker/Dockerfile ``--build-arg GRPC_HEALTH_PROBE_SOURCE=kvsvc``: our CI). The
image's HEALTHCHECK line stays the same either way.

Flags (Go style, ``-name=value`` or ``-name value``): ``-addr`` (required),
``-service`` (default ""), ``-connect-timeout`` and ``-rpc-timeout`` (Go durations,
default 1s). Exit codes: 0 SERVING, 1 bad flags, 2 no connection, 3 the RPC failed,
4 any other status."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING, BAD_FLAGS, CONNECTION_FAILURE, RPC_FAILURE, UNHEALTHY = range(5)
_FLAGS = {"addr": "", "service": "", "connect-timeout": "1s", "rpc-timeout": "1s"}
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")


class _BadFlags(ValueError):
    pass


def parse_duration(text: str) -> float:
    """A Go duration ("1s", "500ms", "1m30s") in seconds; it must be positive."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise _BadFlags(f"invalid duration {text!r}")
    seconds = sum(float(n) * _UNIT[u] for n, u in parts)
    if seconds <= 0:
        raise _BadFlags(f"duration {text!r} must be positive")
    return seconds


def parse_flags(argv: Sequence[str]) -> dict[str, str]:
    flags = dict(_FLAGS)
    args = list(argv)
    while args:
        arg = args.pop(0)
        name, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or name not in flags:
            raise _BadFlags(f"unknown flag {arg!r} (supported: -{', -'.join(_FLAGS)})")
        if not eq:
            if not args:
                raise _BadFlags(f"flag -{name} needs a value")
            value = args.pop(0)
        flags[name] = value
    if not flags["addr"]:
        raise _BadFlags("-addr is required")
    return flags


def probe(addr: str, service: str, connect_timeout: float, rpc_timeout: float) -> tuple[int, str]:
    """(exit code, the line grpc_health_probe would print) for one Check."""
    with grpc.insecure_channel(addr) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            return CONNECTION_FAILURE, (
                f"timeout: failed to connect service {addr!r} within {connect_timeout:g}s"
            )
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=rpc_timeout
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            return RPC_FAILURE, f"error: health rpc failed: {code}: {exc}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return UNHEALTHY, f"service unhealthy (responded with {status!r})"
    return SERVING, f"status: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        flags = parse_flags(sys.argv[1:] if argv is None else argv)
        timeouts = parse_duration(flags["connect-timeout"]), parse_duration(flags["rpc-timeout"])
    except _BadFlags as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_FLAGS
    code, line = probe(flags["addr"], flags["service"], *timeouts)
    print(line, file=sys.stdout if code == SERVING else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
