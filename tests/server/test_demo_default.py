"""`kvsvc serve` with no --store-bytes (the quickstart's demo) does not take a
gigabyte at start: its store is 256 MiB, the process well under 1 GiB resident."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvsvc.limits import MiB

pytestmark = pytest.mark.slow  # starts `kvsvc serve`


def test_the_default_store_is_a_demos(shm_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvsvc", "serve", "--listen", "127.0.0.1:0",
             "--shm-dir", str(shm_dir)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        end = time.monotonic() + 120
        while "serving on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.1)
        assert f"(store {256 * MiB} bytes," in log.read_text()
        status = Path(f"/proc/{proc.pid}/status").read_text()
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        assert m is not None
        assert int(m[1]) * 1024 < 768 * MiB, status  # measured ~0.5 GB
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
