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
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import SERVING, ServerProcess, ServerThread, wait_health

from kvsvc.client import KVCacheClient
from kvsvc.errors import Miss
from kvsvc.server.config import ServerConfig
from kvsvc.server.tiers.disk import DiskTier
from kvsvc.server.tiers.disk.format import SUFFIX

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
        """Remount (retried while a file open for writing makes it busy)."""
        end = time.monotonic() + SOON_S
        while True:
            done = subprocess.run(
                ["mount", "-o", f"remount,{mode}", str(self.path)], capture_output=True, text=True
            )
            if done.returncode == 0:
                return
            assert time.monotonic() < end, f"remount,{mode}: {done.stderr.strip()}"
            time.sleep(0.05)

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


@pytest.mark.parametrize(
    "stop", ["healed", "stopped-at-once", "stopped-read-only"], ids=lambda s: s
)
def test_a_replaced_version_whose_file_stayed_is_never_served_again(
    mount: Mount, shm_dir: Path, stop: str
) -> None:
    """10 keys on disk; the disk turns read-only; a Store brings new bytes for each
    (their old files cannot be removed); the server stops once the disk healed, at
    once after it takes writes again, or while it is still read-only (the disk
    then takes writes again); a new server on the same directory never serves the
    old bytes."""
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
            if stop != "stopped-read-only":
                mount.remount("rw")
            if stop == "healed":
                until("owed files removed", lambda: disk.writing and not disk.health.owed)
    finally:
        st.stop()
    if stop == "stopped-read-only":
        assert len(chunk_files(root)) == 10  # the old files stayed
        mount.remount("rw")
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


def chunk_files(root: Path) -> list[Path]:
    return [p for p in root.glob(f"??/*{SUFFIX}") if p.is_file()]


def test_a_kill_9_while_read_only_never_brings_a_replaced_version_back(
    mount: Mount, spawn: Callable[..., ServerProcess]
) -> None:
    """`kvsvc serve` holds 10 keys on disk (restarted: memory empty); the disk turns
    read-only; a Store brings new bytes for each; the server is killed -9 while the
    disk is still read-only, so nothing on the disk could say the old files are
    replaced; the disk takes writes again; a new server never serves the old bytes."""
    root = mount.path / "disk"
    args = ("--store-bytes", "16M", "--disk-dir", str(root))
    old, new = items(10, b"k", b"o"), items(10, b"k", b"n")
    srv = spawn(*args)
    with KVCacheClient(srv.address) as c:
        c.put(NS, old)
    srv.signal(signal.SIGTERM)  # the queue drained: the old files are in place
    assert srv.wait(30) == 0, srv.output()
    assert len(chunk_files(root)) == 10

    srv = spawn(*args)
    wait_health(srv.address, SERVING)
    mount.remount("ro")
    with KVCacheClient(srv.address) as c:
        for key, data in new:
            assert c.put(NS, [(key, data)]).stored_chunks == 1  # memory was empty
        assert all(c.get(NS, k) == v for k, v in new)
    srv.signal(signal.SIGKILL)
    srv.wait(30)
    assert len(chunk_files(root)) == 10  # the old files stayed
    mount.remount("rw")

    srv = spawn(*args)
    wait_health(srv.address, SERVING)
    with KVCacheClient(srv.address) as c:
        for key, data in new:
            with contextlib.suppress(Miss):
                assert c.get(NS, key) == data, "a replaced version came back after kill -9"
    assert chunk_files(root) == [], "the replaced files were not removed at the start"


def test_a_namespace_dropped_while_read_only_stays_dropped_after_a_restart(
    mount: Mount, shm_dir: Path
) -> None:
    """10 chunks on disk; the disk turns read-only; DropNamespace forgets them (the
    writer's removals are refused); the server stops while the disk is still
    read-only; the disk takes writes again: a new server neither lists nor serves
    them, and their files are gone."""
    root = mount.path / "disk"
    chunks = items(10, b"d", b"x")
    st = ServerThread(disk_config(shm_dir, root))
    try:
        disk = disk_of(st)
        with KVCacheClient(st.address) as c:
            c.put(NS, chunks)
            until("10 written", lambda: disk.stats.writes == 10)
            mount.remount("ro")
            c.drop_namespace(NS)
            until("the refused removals owed", lambda: len(disk.health.owed) == 10)
            assert c.lookup([k for k, _ in chunks], namespace=NS) == 0
    finally:
        st.stop()
    assert len(chunk_files(root)) == 10  # the files stayed
    mount.remount("rw")
    st = ServerThread(disk_config(shm_dir, root))
    try:
        with KVCacheClient(st.address) as c:
            wait_health(st.address, SERVING)
            assert c.lookup([k for k, _ in chunks], namespace=NS) == 0
            assert c.get_many(NS, [chunks[0][0]]) == []
        assert chunk_files(root) == []
    finally:
        st.stop()


def test_a_disk_dir_removed_under_the_server_heals_by_itself(
    shm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--disk-dir removed whole while the server runs (an operator's cleanup): the
    next write fails (ENOENT: counted as io), the tier goes down, and its probe
    makes the directory again, so writes land without a restart."""
    caplog.set_level(logging.INFO, logger="kvsvc.server.tiers.disk")
    root = tmp_path / "disk"
    st = ServerThread(disk_config(shm_dir, root))
    try:
        disk = disk_of(st)
        with KVCacheClient(st.address) as c:
            c.put(NS, items(2, b"before", b"a"))
            until("2 written", lambda: disk.stats.writes == 2)
            shutil.rmtree(root)
            c.put(NS, items(1, b"during", b"b"))
            until("written after the heal", lambda: _put_until_written(c, disk, 3))
            assert disk.writing and disk.health.skipped["io"] >= 1
            assert disk.writer._thread.is_alive()
            assert messages(caplog, "refuses writes") == 1
            assert messages(caplog, "takes writes again") == 1
        assert len(chunk_files(root)) >= 1
    finally:
        st.stop()


def _put_until_written(c: KVCacheClient, disk: DiskTier, n: int) -> bool:
    """One more new chunk (skipped while the tier is down); True once ``n`` landed."""
    if disk.stats.writes >= n:
        return True
    if disk.writing and not disk.writer.depth:
        c.put(NS, items(1, b"after-%d" % time.monotonic_ns(), b"c"))
    time.sleep(0.05)
    return False
