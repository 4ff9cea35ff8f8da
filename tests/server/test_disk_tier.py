"""The local disk tier as a user relies on it (issue 33): chunks outlive the process
(SIGTERM, and kill -9 once --disk-sync made them durable) and come back bit-exact
from disk; a file deleted, truncated or corrupted under the server is a miss (the
bad file quarantined), never an error or wrong bytes; an unwritable --disk-dir is
one line and exit 2; health waits for the index; a full disk skips writes and
fails no call; and without --disk-dir nothing touches the disk."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import NOT_SERVING, SERVING, ServerThread, health_status, wait_health

from kvsvc.client import KVCacheClient
from kvsvc.errors import Miss
from kvsvc.server.ops.health import SERVICE_NAME
from kvsvc.server.tiers.disk import tier as disk_tier
from kvsvc.server.tiers.disk import writer as disk_writer
from kvsvc.server.tiers.disk.format import PAGE, QUARANTINE_DIR, SUFFIX, TMP_DIR, file_name
from kvsvc.server.tiers.disk.index import Rebuilt, rebuild

pytestmark = pytest.mark.slow  # starts servers or subprocesses

MiB = 1 << 20
CHUNK = 256 << 10
NS = "ns"
#: the layout inline Stores are kept under (part of a chunk's identity on disk)
INLINE = "inline"


def chunk_files(root: Path) -> list[Path]:
    """The chunk files in place (not temporaries, not quarantined)."""
    return [p for p in root.glob(f"??/*{SUFFIX}") if p.is_file()]


def wait_files(root: Path, n: int, limit: float = 15) -> None:
    """Until ``n`` chunk files are in place (the write-behind is done with them)."""
    end = time.monotonic() + limit
    while len(chunk_files(root)) < n:
        assert time.monotonic() < end, f"{len(chunk_files(root))} of {n} files after {limit} s"
        time.sleep(0.02)


def make_chunks(n: int, tag: bytes = b"k") -> list[tuple[bytes, bytes]]:
    return [(tag + b"-%03d" % i, os.urandom(CHUNK)) for i in range(n)]


def put_one_by_one(c: KVCacheClient, chunks: list[tuple[bytes, bytes]], root: Path) -> None:
    """Store each chunk and wait for its file: the write-behind queue (a quarter of a
    small store) never overflows, so every chunk reaches the disk."""
    before = len(chunk_files(root))
    for i, item in enumerate(chunks):
        assert c.put(NS, [item]).stored_chunks == 1
        wait_files(root, before + i + 1)


def check_all_back(c: KVCacheClient, chunks: list[tuple[bytes, bytes]]) -> None:
    """Lookup counts every chunk (from disk), and each comes back bit-exact."""
    assert c.lookup([k for k, _ in chunks], namespace=NS) == len(chunks)
    for key, data in chunks:
        assert c.get(NS, key) == data, key


def test_a_warm_restart_serves_more_than_memory_holds_bit_exact(spawn, tmp_path: Path) -> None:
    """40 x 256 KiB into an 8 MiB store: most were evicted from memory. After a
    SIGTERM, then (with --disk-sync, whose Store replies once durable) a kill -9
    right after the last reply, a restart on the same directory serves them all
    from disk, bit-exact."""
    root = tmp_path / "disk"
    args = ("--store-bytes", "8M", "--disk-dir", str(root))
    first = make_chunks(40, b"a")
    srv = spawn(*args)
    with KVCacheClient(srv.address) as c:
        put_one_by_one(c, first, root)
        assert c.server_info().evicted_chunks > 0  # memory could not hold them
    srv.signal(signal.SIGTERM)
    assert srv.wait(30) == 0, srv.output()

    srv = spawn(*args, "--disk-sync")
    wait_health(srv.address, SERVING)
    second = make_chunks(12, b"b")
    with KVCacheClient(srv.address) as c:
        check_all_back(c, first)
        for key, data in second:  # durable on reply: no waiting for the files
            assert c.put(NS, [(key, data)]).stored_chunks == 1
    srv.signal(signal.SIGKILL)
    srv.wait(30)

    srv = spawn(*args)
    wait_health(srv.address, SERVING)
    with KVCacheClient(srv.address) as c:
        check_all_back(c, first + second)
        info = c.server_info()
        assert info.used_bytes <= info.capacity_bytes < len(first + second) * CHUNK


def test_deleted_truncated_or_corrupted_files_are_misses_never_wrong_bytes(
    spawn, tmp_path: Path
) -> None:
    """After a restart (memory empty, the index listing four files), one file is
    deleted, one truncated, one has a flipped data byte: each is a miss (no error,
    health SERVING), the damaged two are quarantined; the fourth comes back intact."""
    root = tmp_path / "disk"
    args = ("--store-bytes", "8M", "--disk-dir", str(root))
    chunks = make_chunks(4, b"f")
    srv = spawn(*args)
    with KVCacheClient(srv.address) as c:
        put_one_by_one(c, chunks, root)
    srv.signal(signal.SIGTERM)
    assert srv.wait(30) == 0, srv.output()

    srv = spawn(*args)
    wait_health(srv.address, SERVING)
    paths = [root / file_name(NS, INLINE, key) for key, _ in chunks]
    assert all(p.is_file() for p in paths), sorted(map(str, chunk_files(root)))
    deleted, truncated, flipped, intact = paths
    deleted.unlink()
    os.truncate(truncated, PAGE + CHUNK // 2)
    with open(flipped, "r+b") as f:
        f.seek(PAGE + 1000)
        byte = f.read(1)
        f.seek(PAGE + 1000)
        f.write(bytes([byte[0] ^ 0x40]))
    with KVCacheClient(srv.address) as c:
        for i in range(3):
            key, _ = chunks[i]
            assert c.lookup([key], namespace=NS) == 1  # listed until read
            assert c.get_many(NS, [key]) == []  # a miss, not an error
            assert c.lookup([key], namespace=NS) == 0  # forgotten
        key, data = chunks[3]
        assert c.get(NS, key) == data
        assert health_status(srv.address) == SERVING
    quarantined = sorted(p.name for p in (root / QUARANTINE_DIR).iterdir())
    expected = sorted(p.relative_to(root).as_posix().replace("/", "_") for p in paths[1:3])
    end = time.monotonic() + 10  # quarantine runs on a reader thread after the reply
    while quarantined != expected and time.monotonic() < end:
        time.sleep(0.05)
        quarantined = sorted(p.name for p in (root / QUARANTINE_DIR).iterdir())
    assert quarantined == expected
    assert not truncated.exists() and not flipped.exists() and intact.is_file()
    assert srv.proc.poll() is None


def test_an_unwritable_disk_dir_is_one_line_and_exit_2(shm_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = blocker / "disk"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kvsvc", "serve", "--listen", "127.0.0.1:0"),
            *("--shm-dir", str(shm_dir), "--store-bytes", "8M", "--disk-dir", str(bad)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0], done.stderr


@pytest.fixture
def held_rebuild(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The real index rebuild, started only once the test sets the event (its end
    under the test's control; set at teardown in any case)."""
    gate = threading.Event()

    def gated(root: str) -> Rebuilt:
        assert gate.wait(30), "the test never let the rebuild run"
        return rebuild(root)

    monkeypatch.setattr(disk_tier, "rebuild", gated)
    yield gate
    gate.set()


@pytest.mark.parametrize("wait_index", [True, False])
def test_health_waits_for_the_index_unless_told_not_to(
    config, tmp_path: Path, held_rebuild: threading.Event, wait_index: bool
) -> None:
    """With --disk-wait-index (the default) readiness (the service name) is
    NOT_SERVING until the index is rebuilt, then SERVING with the disk's chunks
    listed, while liveness ("", the startup probe) is SERVING all along, so a large
    disk tier is never restarted for being slow; with --no-disk-wait-index it
    serves at once (disk hits appear as the index lands)."""
    root = tmp_path / "disk"
    cfg = config.replace(store_bytes=8 * MiB, disk_dir=str(root), disk_wait_index=wait_index)
    chunks = make_chunks(2, b"h")
    held_rebuild.set()
    st = ServerThread(cfg)
    try:
        with KVCacheClient(st.address) as c:
            put_one_by_one(c, chunks, root)
    finally:
        st.stop()
    held_rebuild.clear()
    st = ServerThread(cfg)
    try:
        if wait_index:
            time.sleep(0.5)  # the rebuild is held: readiness must not turn SERVING meanwhile
            assert health_status(st.address, SERVICE_NAME) == NOT_SERVING
            assert health_status(st.address) == SERVING  # alive: the probes leave it be
        else:
            wait_health(st.address, SERVING)
        with KVCacheClient(st.address) as c:
            assert c.lookup([k for k, _ in chunks], namespace=NS) == 0  # not listed yet
            held_rebuild.set()
            end = time.monotonic() + 30
            while health_status(st.address, SERVICE_NAME) != SERVING:
                assert time.monotonic() < end, "not ready 30 s after the index was released"
                time.sleep(0.05)
            end = time.monotonic() + 10  # --no-disk-wait-index: listed once indexed
            while c.lookup([k for k, _ in chunks], namespace=NS) < 2:
                assert time.monotonic() < end
                time.sleep(0.02)
            assert all(c.get(NS, k) == v for k, v in chunks)
    finally:
        st.stop()


def test_a_fifo_named_like_a_chunk_file_does_not_hang_the_rebuild(spawn, tmp_path: Path) -> None:
    """Not a regular file: refused and quarantined, health SERVING (its open used to
    wait for a writer for ever, holding health NOT_SERVING)."""
    root = tmp_path / "disk"
    (root / "ab").mkdir(parents=True)
    fifo = root / "ab" / f"ab{'0' * 38}{SUFFIX}"
    os.mkfifo(fifo)
    try:
        srv = spawn("--store-bytes", "8M", "--disk-dir", str(root))
        wait_health(srv.address, SERVING)
        assert not fifo.exists()
        assert [p.name for p in (root / QUARANTINE_DIR).iterdir()] == [f"ab_{fifo.name}"]
        assert "not_a_file" in srv.output()  # logged once, by kind
    finally:
        with contextlib.suppress(OSError):  # unblock a rebuild that still waits
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_off_by_default_no_directory_is_made(make_server, tmp_path: Path) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        srv = make_server(store_bytes=8 * MiB)
        assert srv.server.servicer.tiers.named("disk") is None
        with KVCacheClient(srv.address) as c:
            chunks = make_chunks(40, b"d")
            for item in chunks:
                c.put(NS, [item])
            assert c.lookup([k for k, _ in chunks], namespace=NS) < len(chunks)  # evicted: gone
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only; the test is skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], timeout=30, check=False)


def test_a_full_disk_skips_writes_and_fails_no_call(make_server, small_tmpfs: Path) -> None:
    """10 MiB through a 4 MiB filesystem with a disk capacity far above it: every
    Store succeeds, writes past ENOSPC are skipped and counted, and every Retrieve
    is the stored bytes or a miss (from memory or disk), never other bytes."""
    root = small_tmpfs / "disk"
    srv = make_server(store_bytes=8 * MiB, disk_dir=str(root), disk_capacity=1 << 30)
    disk = srv.server.servicer.tiers.named("disk")
    assert disk is not None
    chunks = make_chunks(40, b"full")
    with KVCacheClient(srv.address) as c:
        wait_health(srv.address, SERVING)
        for i, item in enumerate(chunks):
            assert c.put(NS, [item]).stored_chunks == 1
            end = time.monotonic() + 15  # each write done (written or skipped) before the next
            while disk.stats.writes + disk.stats.skipped_full + disk.stats.write_errors <= i:
                assert time.monotonic() < end, disk.stats
                time.sleep(0.02)
        stats = disk.stats
        assert stats.skipped_full > 0 and stats.writes > 0, stats
        assert stats.write_errors == 0 and stats.skipped_queue == 0, stats
        served = 0
        for key, data in chunks:
            got = c.get_many(NS, [key])
            assert got in ([], [data]), key
            served += len(got)
        assert c.server_info().evicted_chunks > 0
        assert disk.stats.hits > 0, disk.stats  # some came back from the full disk
    text = generate_latest(srv.server.servicer.metrics.registry).decode()
    seen = {
        (m.name, tuple(m.labels.values())): m.value
        for f in text_string_to_metric_families(text)
        for m in f.samples
    }
    for name, labels, value in (  # what an operator sees of it
        ("kvsvc_disk_skipped_writes_total", ("full",), stats.skipped_full),
        ("kvsvc_tier_written_chunks_total", ("disk",), disk.stats.writes),
        ("kvsvc_tier_hits_total", ("disk",), disk.stats.hits),
        ("kvsvc_disk_files", (), len(disk.index)),
        ("kvsvc_tier_used_bytes", ("disk",), disk.index.used_bytes),
        ("kvsvc_disk_index_ready", (), 1),
    ):
        assert seen[(name, labels)] == value, (name, labels, seen.get((name, labels)))
    print(f"disk full: {stats.writes} written, {stats.skipped_full} skipped, {served}/40 served")


def test_a_restart_refuses_damaged_files_and_drops_interrupted_writes(
    config, tmp_path: Path
) -> None:
    """Damage done while the server is down (a torn header, a short file, a leftover
    temporary of a write a crash cut): the rebuilt index lists only the good files,
    the bad ones are counted by kind and quarantined, the temporary removed."""
    root = tmp_path / "disk"
    cfg = config.replace(store_bytes=8 * MiB, disk_dir=str(root))
    chunks = make_chunks(3, b"r")
    st = ServerThread(cfg)
    try:
        with KVCacheClient(st.address) as c:
            put_one_by_one(c, chunks, root)
    finally:
        st.stop()
    torn, short, good = (root / file_name(NS, INLINE, key) for key, _ in chunks)
    with open(torn, "r+b") as f:
        f.seek(20)  # inside the header's identity: its CRC no longer checks
        f.write(b"\xff\xff")
    os.truncate(short, PAGE + 10)
    (root / TMP_DIR / "interrupted").write_bytes(b"half a chunk")
    st = ServerThread(cfg)
    try:
        wait_health(st.address, SERVING)
        disk = st.server.servicer.tiers.named("disk")
        assert disk is not None
        assert disk.stats.indexed_chunks == 1
        assert disk.stats.refused == {"bad_header": 1, "truncated": 1}, disk.stats
        assert sorted(p.name for p in (root / QUARANTINE_DIR).iterdir()) == sorted(
            p.relative_to(root).as_posix().replace("/", "_") for p in (torn, short)
        )
        assert list((root / TMP_DIR).iterdir()) == [] and good.is_file()
        with KVCacheClient(st.address) as c:
            assert c.lookup([k for k, _ in chunks], namespace=NS) == 0
            assert c.lookup([chunks[2][0]], namespace=NS) == 1
            assert c.get(NS, chunks[2][0]) == chunks[2][1]
    finally:
        st.stop()


def test_evict_mode_keeps_what_memory_evicts(config, tmp_path: Path) -> None:
    """--disk-write evict: only chunks memory evicts go to disk (copied out in the
    eviction); every one of the 40 stays retrievable bit-exact, Lookup counting the
    memory prefix continued on disk, and a restart keeps exactly the evicted ones."""
    root = tmp_path / "disk"
    cfg = config.replace(store_bytes=8 * MiB, disk_dir=str(root), disk_write="evict")
    chunks = make_chunks(40, b"e")
    st = ServerThread(cfg)
    try:
        with KVCacheClient(st.address) as c:
            for i, item in enumerate(chunks):
                assert c.put(NS, [item]).stored_chunks == 1
                evicted = c.server_info().evicted_chunks
                wait_files(root, evicted)  # each eviction's copy lands before the next
                assert len(chunk_files(root)) == evicted, i
            on_disk = len(chunk_files(root))
            assert 0 < on_disk < len(chunks)
            assert c.lookup([k for k, _ in chunks], namespace=NS) == len(chunks)
            disk = st.server.servicer.tiers.named("disk")
            assert disk is not None
            for key, data in chunks:
                assert c.get(NS, key) == data, key
                # Its load evicted another chunk: copied out before the next get (on a
                # loaded host the 2 MiB queue could fill, and a full queue skips).
                assert disk.writer.idle.wait(15)
            assert disk.stats.skipped_queue == 0, disk.stats
    finally:
        st.stop()
    st = ServerThread(cfg)
    try:
        wait_health(st.address, SERVING)
        with KVCacheClient(st.address) as c:
            back = c.lookup([k for k, _ in chunks], namespace=NS)
            assert back >= on_disk, (back, on_disk)  # the get()s above evicted more
            for key, data in chunks[:back]:
                assert c.get(NS, key) == data, key
    finally:
        st.stop()


def test_a_kill_9_mid_writes_leaves_no_torn_chunk(spawn, tmp_path: Path) -> None:
    """Without --disk-sync, kill -9 while Stores stream to disk: after the restart
    every chunk served is the bytes stored under its key (or a miss), and the
    interrupted writes' temporaries are gone."""
    root = tmp_path / "disk"
    args = ("--store-bytes", "8M", "--disk-dir", str(root))
    chunks = make_chunks(60, b"x")
    srv = spawn(*args)
    with KVCacheClient(srv.address) as c:
        for i, item in enumerate(chunks):
            assert c.put(NS, [item]).stored_chunks == 1
            if i == 30:
                wait_files(root, 10)  # some on disk for sure, the rest racing the kill
        srv.signal(signal.SIGKILL)  # the last Stores' writes may still be queued
    srv.wait(30)

    srv = spawn(*args)
    wait_health(srv.address, SERVING)
    assert list((root / TMP_DIR).iterdir()) == []
    with KVCacheClient(srv.address) as c:
        served = 0
        for key, data in chunks:
            got = c.get_many(NS, [key])
            assert got in ([], [data]), key
            served += len(got)
    assert served >= 10, served
    print(f"kill -9 mid writes: {served}/60 chunks back")


def test_a_key_stored_anew_with_other_bytes_is_never_served_its_old_bytes(
    spawn, tmp_path: Path
) -> None:
    """Keys are the client's: a Store of other bytes under a key memory evicted
    replaces the disk's copy (the old file goes before the reply). The new bytes
    come back from disk, before and after a restart; so do a same-bytes re-Store's,
    without rewriting the file."""
    root = tmp_path / "disk"
    args = ("--store-bytes", "8M", "--disk-dir", str(root))
    key = b"versioned"
    old, new = os.urandom(CHUNK), os.urandom(CHUNK)
    srv = spawn(*args)
    with KVCacheClient(srv.address) as c:
        put_one_by_one(c, [(key, old)], root)
        put_one_by_one(c, make_chunks(40, b"p"), root)  # evicts it from memory
        assert c.put(NS, [(key, new)]).stored_chunks == 1
        put_one_by_one(c, make_chunks(40, b"q"), root)  # and the new bytes too
        assert c.get(NS, key) == new
        path = root / file_name(NS, INLINE, key)
        inode = path.stat().st_ino
        put_one_by_one(c, make_chunks(40, b"r"), root)
        assert c.put(NS, [(key, new)]).stored_chunks == 1  # the same bytes again
        put_one_by_one(c, make_chunks(2, b"s"), root)  # the queue is past it
        assert path.stat().st_ino == inode  # not rewritten (a rename is a new inode)
    srv.signal(signal.SIGTERM)
    assert srv.wait(30) == 0, srv.output()
    srv = spawn(*args)
    wait_health(srv.address, SERVING)
    with KVCacheClient(srv.address) as c:
        assert c.get(NS, key) == new


def takes_o_direct(path: Path) -> bool:
    probe = path / "o_direct_probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()
    return True


def test_large_chunks_are_written_with_o_direct_and_come_back_bit_exact(
    config, tmp_path: Path
) -> None:
    """Chunks of at least DIRECT_MIN bytes go to disk with O_DIRECT where the
    filesystem takes it (a whole number of pages, and one with a partial last page:
    padded, then cut): each file is its header page and its bytes, and after a
    restart every chunk is its bytes."""
    root = tmp_path / "disk"
    root.mkdir()
    sizes = [disk_writer.DIRECT_MIN, disk_writer.DIRECT_MIN + 1234, 256 << 10]
    chunks = [(b"big-%d" % i, os.urandom(n)) for i, n in enumerate(sizes)]
    cfg = config.replace(store_bytes=64 * MiB, disk_dir=str(root))
    st = ServerThread(cfg)
    try:
        disk = st.server.servicer.tiers.named("disk")
        assert disk is not None
        with KVCacheClient(st.address) as c:
            wait_health(st.address, SERVING)
            put_one_by_one(c, chunks, root)
        direct = takes_o_direct(root)
        assert disk.writer.direct == direct, "O_DIRECT used where refused, or not"
        assert disk.writer.direct_writes == (2 if direct else 0)  # the two large ones
    finally:
        st.stop()
    for key, data in chunks:
        assert (root / file_name(NS, INLINE, key)).stat().st_size == PAGE + len(data)
    st = ServerThread(cfg)
    try:
        with KVCacheClient(st.address) as c:
            wait_health(st.address, SERVING)
            check_all_back(c, chunks)
    finally:
        st.stop()


def test_a_warm_restart_reports_the_disk_contents_in_the_events_snapshot(
    spawn, tmp_path: Path
) -> None:
    """A presence index opened on the new incarnation learns from its snapshot what
    the rebuilt disk index holds (memory is empty after the restart): the keys on
    disk are hits, others are not."""
    root = tmp_path / "disk"
    args = ("--store-bytes", "8M", "--disk-dir", str(root))
    chunks = make_chunks(6, b"e")
    srv = spawn(*args)
    with KVCacheClient(srv.address) as c:
        put_one_by_one(c, chunks, root)
    srv.signal(signal.SIGTERM)
    assert srv.wait(30) == 0, srv.output()

    srv = spawn(*args)
    wait_health(srv.address, SERVING)
    keys = [k for k, _ in chunks] + [b"absent"]
    with KVCacheClient(srv.address) as c:
        assert c.server_info().used_bytes == 0  # nothing in memory: all on disk
        with c.presence(NS) as index:
            end = time.monotonic() + 30
            while (hits := index.hits(keys)) is None:
                assert time.monotonic() < end, "the presence index never became fresh"
                time.sleep(0.02)
            assert hits == [True] * len(chunks) + [False]
            assert index.prefix_hits(keys) == len(chunks)


def _tenant_file(path: Path) -> Path:
    """Two tenants with half the store each (their share of the disk too)."""
    spec = {
        name: {
            "tokens": [f"{name}-token-0123456789abcdef"],
            "namespaces": ["*"],
            "quota": {"store_share": 0.5},
        }
        for name in ("filler", "quiet")
    }
    path.write_text(json.dumps({"tenants": spec}))
    path.chmod(0o600)
    return path


def test_tenants_on_disk_a_share_counts_disk_bytes_and_keys_stay_apart(
    spawn, tmp_path: Path
) -> None:
    """A tenant writing the disk five times over evicts its own files, not the quiet
    tenant's (within its share); after a restart each tenant reads its own bytes of
    the same namespace and key from disk, and never the other's."""
    root = tmp_path / "disk"
    tenants = _tenant_file(tmp_path / "tenants.json")
    args = ("--store-bytes", "8M", "--disk-dir", str(root), "--disk-capacity", "4M")
    args += ("--auth-token-file", str(tenants))
    quiet_chunks = make_chunks(4, b"q")  # 1 MiB: within half of 4 MiB
    shared_key = b"same-key"
    srv = spawn(*args)
    with KVCacheClient(srv.address, token="quiet-token-0123456789abcdef") as quiet:
        put_one_by_one(quiet, [*quiet_chunks, (shared_key, b"Q" * CHUNK)], root)
    with KVCacheClient(srv.address, token="filler-token-0123456789abcdef") as filler:
        assert filler.put(NS, [(shared_key, b"F" * CHUNK)]).stored_chunks == 1
        for i in range(80):  # 80 x 256 KiB = 20 MiB through a 4 MiB disk
            assert filler.put(NS, [(b"f-%03d" % i, os.urandom(CHUNK))]).stored_chunks == 1
            time.sleep(0.01)  # the write-behind keeps up (a full queue skips writes)
        wait_files(root, 6)
    srv.signal(signal.SIGTERM)
    assert srv.wait(30) == 0, srv.output()

    srv = spawn(*args)
    wait_health(srv.address, SERVING, token="quiet-token-0123456789abcdef")
    with KVCacheClient(srv.address, token="quiet-token-0123456789abcdef") as quiet:
        assert quiet.server_info().used_bytes == 0  # what is served comes from disk
        check_all_back(quiet, quiet_chunks)
        assert quiet.get(NS, shared_key) == b"Q" * CHUNK
    with KVCacheClient(srv.address, token="filler-token-0123456789abcdef") as filler:
        assert filler.lookup([k for k, _ in quiet_chunks], namespace=NS) == 0
        with contextlib.suppress(Miss):  # its own bytes (or a miss: evicted), never quiet's
            assert filler.get(NS, shared_key) == b"F" * CHUNK


def test_one_store_larger_than_the_capacity_keeps_the_capacity(make_server, tmp_path) -> None:
    """Six 512 KiB chunks in one Store to a 3 MiB disk: a write that cannot be made
    room for by evicting landed files (the others may still be being written) is
    skipped and counted, so the files on disk never exceed the capacity."""
    root = tmp_path / "disk"
    capacity = 3 * MiB
    # A store whose write-behind queue (a quarter of it) takes all six at once.
    srv = make_server(store_bytes=32 * MiB, disk_dir=str(root), disk_capacity=capacity)
    disk = srv.server.servicer.tiers.named("disk")
    assert disk is not None
    wait_health(srv.address, SERVING)
    chunks = [(b"big%d" % i, os.urandom(512 << 10)) for i in range(6)]
    with KVCacheClient(srv.address) as c:
        assert c.put(NS, chunks).stored_chunks == 6
    end = time.monotonic() + 30
    while disk.queued_bytes or disk.pending_bytes:
        assert time.monotonic() < end, "the disk writes did not land in 30 s"
        time.sleep(0.05)
    files = chunk_files(root)
    held = sum(p.stat().st_size for p in files)
    assert held <= capacity, (held, capacity)
    assert len(files) == 5, disk.stats  # each 512 KiB plus its header: five fit
    assert disk.stats.skipped_queue == 0, disk.stats
    assert disk.used_bytes <= capacity
    # Whichever way the writes' landing interleaved with the Store: made room or skipped.
    assert disk.stats.skipped_capacity + disk.stats.evicted >= 1, disk.stats
