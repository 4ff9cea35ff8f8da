"""The disk tier on a filesystem that turns read-only and back (a real tmpfs,
remounted; skipped where this process may not mount): writes are skipped with
their true reason while it refuses them, the writer never dies, the tier resumes
by itself once the filesystem takes writes again (each change logged once), and
a version a Store replaced while its old file could not be removed is never
served again, after a restart either."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import ServerThread

from kvsvc.client import KVCacheClient
from kvsvc.errors import Miss
from kvsvc.server.config import ServerConfig
from kvsvc.server.tiers.disk import DiskTier

pytestmark = pytest.mark.slow  # starts servers

NS = "heal"
CHUNK = 64 << 10
SOON_S = 30.0


class Mount:
    """A small tmpfs this test mounts, remounted read-only and back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], check=True)

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.remount("rw")
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    m = Mount(tmp_path / "mnt")
    yield m
    m.close()


def disk_config(shm_dir: Path, root: Path) -> ServerConfig:
    return ServerConfig.from_settings(
        listen="127.0.0.1:0",
        store_bytes=16 << 20,
        shm_dir=str(shm_dir),
        disk_dir=str(root),
        disk_write="through",
    )


def disk_of(st: ServerThread) -> DiskTier:
    tier = st.server.servicer.tiers.named("disk")
    assert isinstance(tier, DiskTier)
    return tier


def until(what: str, ok: Callable[[], bool]) -> None:
    end = time.monotonic() + SOON_S
    while not ok():
        assert time.monotonic() < end, f"not {what} after {SOON_S} s"
        time.sleep(0.02)


def items(n: int, tag: bytes, version: bytes) -> list[tuple[bytes, bytes]]:
    return [(tag + b"-%d" % i, version * (CHUNK // len(version))) for i in range(n)]


def forget_in_memory(st: ServerThread) -> None:
    """Memory gives up the namespace; the disk is not told (as when memory evicts)."""

    async def drop() -> None:
        st.server.servicer.store.drop_namespace(NS)

    st.run(drop())


def messages(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_a_disk_that_turns_read_only_and_back_heals_by_itself(
    mount: Mount, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvsvc.server.tiers.disk")
    st = ServerThread(disk_config(shm_dir, mount.path / "disk"))
    try:
        disk = disk_of(st)
        with KVCacheClient(st.address) as c:
            c.put(NS, items(3, b"before", b"a"))
            until("3 written", lambda: disk.stats.writes == 3)
            mount.remount("ro")
            for key, data in items(5, b"during", b"b"):
                assert c.put(NS, [(key, data)]).stored_chunks == 1  # memory serves
            until("read-only seen", lambda: not disk.writing)
            assert disk.health.skipped["read_only"] >= 1
            assert disk.stats.skipped_queue == 0  # the true reason, never "queue"
            assert disk.writer._thread.is_alive()
            assert messages(caplog, "refuses writes") == 1
            mount.remount("rw")
            until("writing again", lambda: disk.writing)
            c.put(NS, items(3, b"after", b"c"))
            until("written after the heal", lambda: disk.stats.writes == 6)
            assert messages(caplog, "takes writes again") == 1
            assert messages(caplog, "refuses writes") == 1
    finally:
        st.stop()


@pytest.mark.parametrize("wait_heal", [True, False], ids=["healed", "stopped-at-once"])
def test_a_replaced_version_whose_file_stayed_is_never_served_again(
    mount: Mount, shm_dir: Path, wait_heal: bool
) -> None:
    """10 keys on disk; the disk turns read-only; a Store brings new bytes for each
    (their old files cannot be removed); the disk takes writes again and the server
    stops (once healed, or at once); a new server on the same directory never
    serves the old bytes."""
    root = mount.path / "disk"
    old, new = items(10, b"k", b"o"), items(10, b"k", b"n")
    st = ServerThread(disk_config(shm_dir, root))
    try:
        disk = disk_of(st)
        with KVCacheClient(st.address) as c:
            c.put(NS, old)
            until("10 written", lambda: disk.stats.writes == 10)
            forget_in_memory(st)  # the next Stores are new versions, not "present"
            mount.remount("ro")
            for key, data in new:
                assert c.put(NS, [(key, data)]).stored_chunks == 1
            assert all(c.get(NS, k) == v for k, v in new)
            assert len(disk.health.owed) == 10
            mount.remount("rw")
            if wait_heal:
                until("owed files removed", lambda: disk.writing and not disk.health.owed)
    finally:
        st.stop()
    st = ServerThread(disk_config(shm_dir, root))
    try:
        with KVCacheClient(st.address) as c:
            for key, data in new:
                try:
                    got = c.get(NS, key)
                except Miss:
                    continue
                assert got == data, "a replaced version was served after the restart"
    finally:
        st.stop()
