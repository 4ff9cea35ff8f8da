"""`kvsvc serve` in a real memory cgroup whose limit cannot hold --store-bytes: one
line naming the limit, exit 2, before anything is allocated (not an OOM kill once
the store fills). Needs a memory cgroup this user may make (cgroup v1's memory
hierarchy, or a v2 one with the memory controller delegated); skipped elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvsvc.limits import MiB

pytestmark = pytest.mark.slow  # starts `kvsvc serve`

CANDIDATES = (
    (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),  # v1
    (Path("/sys/fs/cgroup"), "memory.max"),  # v2, where this user may make one
)


@pytest.fixture
def memory_cgroup() -> Iterator[tuple[Path, str]]:
    """A new memory cgroup (its directory, its limit file), removed afterwards."""
    for parent, limit in CANDIDATES:
        if not (parent / "cgroup.procs").exists():
            continue
        d = parent / f"kvsvc-test-{uuid.uuid4().hex[:8]}"
        try:
            d.mkdir()
        except OSError:
            continue
        if not (d / limit).exists():  # a v2 parent without the memory controller
            d.rmdir()
            continue
        try:
            yield d, limit
        finally:
            d.rmdir()
        return
    pytest.skip("no memory cgroup can be made here")


def test_a_store_larger_than_the_cgroups_limit_exits_2_in_one_line(
    memory_cgroup: tuple[Path, str], shm_dir: Path
) -> None:
    d, limit = memory_cgroup
    (d / limit).write_text(str(512 * MiB))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    done = subprocess.run(
        ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(d),
         sys.executable, "-m", "kvsvc", "serve", "--listen", "127.0.0.1:0",
         "--shm-dir", str(shm_dir), "--store-bytes", "1G"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.splitlines()[-1]
    assert line.startswith(
        "kvsvc serve: error: --store-bytes 1G: more than the cgroup memory limit in "
    ), done.stderr
    assert f"{d.name}/{limit} (0.5 GiB)" in line
    if torch.cuda.is_available():
        return
    # The same store under a limit that holds it and the server: past this check to
    # the next one, which --device cuda fails here (no CUDA) before any allocation.
    (d / limit).write_text(str(2048 * MiB))
    done = subprocess.run(
        ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(d),
         sys.executable, "-m", "kvsvc", "serve", "--listen", "127.0.0.1:0",
         "--shm-dir", str(shm_dir), "--store-bytes", "1G", "--device", "cuda"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--device cuda: CUDA is not available" in done.stderr.splitlines()[-1], done.stderr
