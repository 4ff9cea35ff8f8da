"""Real redis-server processes for the remote-tier tests and the benchmark: a private
standalone instance or a three-node Redis Cluster on loopback ports found at run
time, each with its own directory, killed at the end. `make pytest` installs
redis-server and redis-tools (scripts/install_redis.sh)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

START_TIMEOUT_S = 20.0


def require_redis() -> None:
    """Skip without redis-server, except in CI (`make pytest` installs it there)."""
    if shutil.which("redis-server") and shutil.which("redis-cli"):
        return
    if os.environ.get("CI"):
        pytest.fail("redis-server/redis-cli missing: run scripts/install_redis.sh")
    pytest.skip("redis-server not installed (scripts/install_redis.sh installs it)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server on 127.0.0.1, no persistence, in ``workdir``. ``user``: an
    ACL user (with ``password``) and the default user off. ``tls``: a directory
    with ca.pem, server.pem and server.key (tests/certs.py): TLS only, clients must
    show a certificate that CA signed (Redis' default tls-auth-clients yes)."""

    def __init__(
        self, workdir: Path, *args: str, password: str = "", user: str = "", tls: Path | None = None
    ) -> None:
        self.workdir = workdir
        self.args = args
        self.password = password
        self.user = user
        self.tls = tls
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, port: int = 0) -> None:
        """Start (again, on the same port when restarting)."""
        for attempt in range(5):
            self.port = port or free_port()
            auth = ["--requirepass", self.password] if self.password else []
            if self.user:  # one config line, given as separate words
                acl = [self.user, "on", f">{self.password}", "~*", "&*", "+@all"]
                auth = ["--user", *acl, "--user", "default", "off"]
            port_args = ["--port", str(self.port)]
            if self.tls is not None:
                port_args = ["--port", "0", "--tls-port", str(self.port),
                             "--tls-cert-file", str(self.tls / "server.pem"),
                             "--tls-key-file", str(self.tls / "server.key"),
                             "--tls-ca-cert-file", str(self.tls / "ca.pem")]  # fmt: skip
            self.log = self.workdir / f"redis-{self.port}.log"
            self.proc = subprocess.Popen(
                [
                    "redis-server",
                    *port_args,
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                    "--logfile",
                    str(self.log),
                    *auth,
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.kill()
            if port and attempt >= 2:
                break
        raise RuntimeError(f"redis-server did not start: {self.log.read_text()[-2000:]}")

    def _wait_ready(self) -> bool:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            if self.cli("ping", check=False).strip() == "PONG":
                return True
            time.sleep(0.05)
        return False

    def cli(self, *args: str, check: bool = True, stdin: bytes | None = None) -> str:
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        if self.user:
            auth += ["--user", self.user]
        if self.tls is not None:
            auth += ["--tls", "--cacert", str(self.tls / "ca.pem"),
                     "--cert", str(self.tls / "client.pem"),
                     "--key", str(self.tls / "client.key")]  # fmt: skip
        done = subprocess.run(
            ["redis-cli", "-p", str(self.port), *auth, *args],
            input=stdin,
            capture_output=True,
            timeout=20,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"redis-cli {args}: {done.stderr.decode()}")
        return done.stdout.decode(errors="replace")

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls is not None else "redis"
        user = f"{self.user}@" if self.user else ""
        return f"{scheme}://{user}127.0.0.1:{self.port}"

    def stop_process(self) -> None:
        """SIGSTOP: the socket accepts connections, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def continue_process(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process must get the kill
            self.proc.kill()
            self.proc.wait(10)


class RedisCluster:
    """Three masters on loopback ports, slots spread by `redis-cli --cluster create`."""

    def __init__(self, workdir: Path, nodes: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for i in range(nodes):
                d = workdir / f"node{i}"
                self.nodes.append(
                    RedisServer(
                        d,
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(d / "nodes.conf"),
                    )
                )
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            self.nodes[0].cli(
                "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"
            )
            end = time.monotonic() + START_TIMEOUT_S
            while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
                if time.monotonic() > end:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.kill()
            raise

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()
