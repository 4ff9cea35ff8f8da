"""`python -m kvsvc.cli.healthprobe`, the stand-in for grpc_health_probe in images built
without GitHub (our CI): the image's HEALTHCHECK line runs it with the same flags, and
Docker/podman read only its exit code, so flags and exit codes must be grpc_health_probe's."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvsvc.cli.healthprobe import (
    BAD_FLAGS,
    CONNECTION_FAILURE,
    RPC_FAILURE,
    SERVING,
    UNHEALTHY,
    main,
    parse_duration,
)
from kvsvc.client import KVCacheClient
from kvsvc.errors import FatalServerError
from kvsvc.server.ops.health import SERVICE_NAME


def probe(*flags: str) -> subprocess.CompletedProcess[str]:
    """The command the HEALTHCHECK runs, as a process (exit code and output)."""
    return subprocess.run(
        [sys.executable, "-m", "kvsvc.cli.healthprobe", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_exit_codes_are_grpc_health_probes() -> None:
    assert (SERVING, BAD_FLAGS, CONNECTION_FAILURE, RPC_FAILURE, UNHEALTHY) == (0, 1, 2, 3, 4)


@pytest.mark.parametrize(
    ("text", "seconds"), [("1s", 1.0), ("500ms", 0.5), ("1m30s", 90.0), ("1.5s", 1.5)]
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "argv",
    [
        [],  # -addr is required
        ["-addr=127.0.0.1:1", "-tls"],  # a flag it does not support
        ["-addr=127.0.0.1:1", "-rpc-timeout=1"],  # not a Go duration
        ["-addr=127.0.0.1:1", "-connect-timeout=0s"],
        ["-addr"],  # no value
        ["127.0.0.1:1"],
    ],
)
def test_bad_flags_exit_1(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == BAD_FLAGS
    assert capsys.readouterr().err.startswith("error: ")


def test_no_server_exits_2() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        r = probe(f"-addr=127.0.0.1:{port}", "-connect-timeout=1s")
    assert r.returncode == CONNECTION_FAILURE, r
    assert "failed to connect" in r.stderr


@pytest.mark.slow
def test_against_a_server(spawn) -> None:
    """SERVING while it serves (both flag spellings); an unknown service is an RPC
    failure (NOT_FOUND); after a fatal failure the probe exits 4 and the container
    turns unhealthy."""
    srv = spawn(env={"KVSVC_FAILPOINTS": "transfer.before_copy=raise"})
    for flags in (
        [f"-addr={srv.address}", f"-service={SERVICE_NAME}"],
        ["-addr", srv.address, "-service", ""],
        [f"--addr={srv.address}", "-rpc-timeout=5s", "-connect-timeout=5s"],
    ):
        r = probe(*flags)
        assert (r.returncode, r.stdout.strip()) == (SERVING, "status: SERVING"), r

    r = probe(f"-addr={srv.address}", "-service=no.such.Service")
    assert r.returncode == RPC_FAILURE and "NOT_FOUND" in r.stderr, r

    # An inline Put goes through the copy path: the failpoint makes it fatal.
    with KVCacheClient(srv.address) as client, pytest.raises(FatalServerError):
        client.put("ns", [(b"k", bytes(4096))], timeout=30)
    r = probe(f"-addr={srv.address}", f"-service={SERVICE_NAME}")
    assert r.returncode == UNHEALTHY, r
    assert "NOT_SERVING" in r.stderr
