"""A real ``mooncake_master`` (from the mooncake extra: scripts/install_mooncake.sh,
run by `make pytest`) for the Mooncake-tier tests and benchmark, inside a network
namespace they make: Mooncake's transfer engine ignores loopback and dials the
first other interface, so nothing of Mooncake runs in the machine's own
namespace. NETNS_SETUP, run as root in a fresh ``unshare -n``, brings lo up and
makes a veth pair HOST_A - HOST_B that exists only there. Facts measured on this
host are in shared/notes/shared-tiers.md."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HOST_A, HOST_B = "10.250.0.1", "10.250.0.2"
#: what the tier gives each Mooncake call in tests (a dead master answers in 4.5 s)
CALL_S = 1.0
NETNS_SETUP = (
    "set -e; ip link set lo up; ip link add va type veth peer name vb; "
    f"ip addr add {HOST_A}/24 dev va; ip addr add {HOST_B}/24 dev vb; "
    "ip link set va up; ip link set vb up; "
)


def mooncake_bin(name: str) -> str | None:
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else shutil.which(name)


def mooncake_missing() -> str | None:
    """Why Mooncake cannot run here (None: it can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"Mooncake Store not installed (scripts/install_mooncake.sh): {exc}"
    if mooncake_bin("mooncake_master") is None:
        return "mooncake_master not installed (scripts/install_mooncake.sh)"
    return None


def required() -> bool:
    """CI (`make pytest` installs Mooncake) and KVSVC_REQUIRE_MOONCAKE never skip."""
    return bool(os.environ.get("CI") or os.environ.get("KVSVC_REQUIRE_MOONCAKE"))


def _port() -> int:
    while True:
        port = secrets.randbelow(20000) + 20000
        with socket.socket() as s:
            try:
                s.bind((HOST_A, port))
            except OSError:
                continue
        return port


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST_A, port)) == 0


class Master:
    """One ``mooncake_master`` with its HTTP metadata server, on HOST_A."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.rpc, self.http, self.metrics = _port(), _port(), _port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        binary = mooncake_bin("mooncake_master")
        assert binary is not None
        log = open(self.tmp / "master.log", "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(
            [
                binary,
                f"--rpc_port={self.rpc}",
                f"--rpc_address={HOST_A}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={HOST_A}",
                f"--http_metadata_server_port={self.http}",
                f"--metrics_port={self.metrics}",
                f"--metrics_host={HOST_A}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        end = time.monotonic() + 30
        while not (_answers(self.rpc) and _answers(self.http)):
            assert self.proc.poll() is None, (self.tmp / "master.log").read_text()[-2000:]
            assert time.monotonic() < end, "mooncake_master did not answer in 30 s"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def settings(self, host: str = HOST_B, **more: Any) -> dict[str, Any]:
        return {
            "mooncake_master": f"{HOST_A}:{self.rpc}",
            "mooncake_metadata": f"http://{HOST_A}:{self.http}/metadata",
            "mooncake_local_hostname": host,
            "mooncake_segment_bytes": 64 << 20,
            "mooncake_timeout": CALL_S,
            "mooncake_lookup_budget": 2.0,
            **more,
        }

    def flags(self, host: str) -> list[str]:
        """The same settings as `kvsvc serve` flags."""
        out = []
        for name, value in self.settings(host).items():
            out += [f"--{name.replace('_', '-')}", str(value)]
        return out
