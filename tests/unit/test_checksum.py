"""The checksum of the copy path: the native copy loop (kvsvc/server/data/native, built by
``make``) and the ``crc32c`` package it falls back to must give the same CRC-32C
for every length and alignment, on the CPU instruction and on tables, and a native
copy must leave the GIL to other threads while it runs."""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from pathlib import Path

import crc32c
import numpy as np
import pytest

from kvsvc.server.data import checksum, copies, nativecopy

# Lengths around every boundary of the native loop: 8-byte words, the three
# interleaved 256-byte and 8 KiB streams, folding (from 1 KiB: 256-byte rounds,
# then 64- and 16-byte steps, then bytes), a segment.
LENGTHS = [0, 1, 7, 8, 9, 255, 256, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 5]
LENGTHS += [1023, 1024, 1025, 1024 + 63, 1024 + 64, 1024 + 79, 1024 + 80, 1024 + 255, 1280 + 15]
LENGTHS += [copies.SEGMENT_BYTES, copies.SEGMENT_BYTES + 13, 3_000_001]


@pytest.fixture(scope="module")
def native() -> nativecopy.NativeCopy:
    assert copies.NATIVE is not None, "the native copy loop is not built: run `make native`"
    return copies.NATIVE


def test_the_store_format_names_its_checksum() -> None:
    assert (checksum.STORE_FORMAT, checksum.CHECKSUM_ALGORITHM) == (2, "crc32c")
    assert copies.checksum(b"123456789") == 0xE3069283  # the CRC-32C check value


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_native_crc32c_equals_the_package(native: nativecopy.NativeCopy, offset: int) -> None:
    data = os.urandom(max(LENGTHS) + 8)
    for n in LENGTHS:
        part = data[offset : offset + n]
        want = copies.checksum(part)
        assert native.crc32c(0, part, n) == want, n
        assert native.crc32c_nofold(0, part, n) == want, n
        assert native.crc32c_tables(0, part, n) == want, n
        # a running CRC (the state is carried into the folding's first bytes)
        assert native.crc32c(want, part, n) == int(crc32c.crc32c(part, want)), n


def test_the_native_crc_runs_on_the_fastest_path_this_cpu_has(
    native: nativecopy.NativeCopy,
) -> None:
    """Folding is used where the CPU has it (it is checked against the crc32
    instruction at load time, so a wrong constant would show here as level 1)."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = cpuinfo.split("\nflags")[1].split("\n")[0].split()
    want = 0
    if "sse4_2" in flags:
        want = 2 if {"avx512f", "vpclmulqdq", "pclmulqdq"} <= set(flags) else 1
    assert native.level == want


def test_a_native_copy_and_the_python_loop_agree(native: nativecopy.NativeCopy) -> None:
    """Runs that start and end inside segments, copied both ways by both loops."""
    size = 3 * copies.SEGMENT_BYTES + 4321
    engine = np.frombuffer(bytearray(os.urandom(size + 100)), dtype=np.uint8)
    cuts = [0, 10, 700_000, copies.SEGMENT_BYTES + 5, 2 * copies.SEGMENT_BYTES, size]
    base = engine.ctypes.data
    # Chunk bytes [a, b) come from the engine at a scattered place: reversed runs.
    rows = [(base + 100 + size - b, a, b - a) for a, b in itertools.pairwise(cuts)]
    runs = np.array(rows, dtype=np.uint64)
    chunk = np.zeros(size, dtype=np.uint8)
    nseg = len(copies.segments(size))
    digests = (ctypes.c_uint32 * nseg)()
    assert native.copy(runs, chunk.ctypes.data, 0, size, digests, to_store=True) == (-1, 0)
    expect = b"".join(engine[addr - base : addr - base + n].tobytes() for addr, _, n in rows)
    assert chunk.tobytes() == expect
    segs = copies.segments(size)
    assert list(digests) == [copies.checksum(chunk[lo:hi].tobytes()) for lo, hi in segs]
    # Back out, from segment 1 on, into zeroed engine memory: only those bytes land.
    engine[:] = 0
    lo = copies.SEGMENT_BYTES
    expected = (ctypes.c_uint32 * (nseg - 1))(*digests[1:])
    assert native.copy(runs, chunk.ctypes.data, lo, size, expected, to_store=False) == (-1, 0)
    for addr, pos, n in rows:
        got = engine[addr - base : addr - base + n]
        want = chunk[pos : pos + n].copy()
        want[: max(0, lo - pos)] = 0
        assert np.array_equal(got, want)


@pytest.mark.parametrize("stream", [True, False], ids=["non-temporal", "cached"])
def test_a_retrieve_checks_each_segment_in_the_pass_that_copies_it(
    native: nativecopy.NativeCopy, stream: bool
) -> None:
    """The CRC of what was written is compared once the segment is in the engine's
    memory; the first mismatch stops the copy (the segments after it are not
    written) and names the segment and the CRC of the bytes that were written."""
    was = native.streaming
    native.stream(stream)
    try:
        size = 6 * copies.SEGMENT_BYTES  # from 4 MiB a span streams where it can
        chunk = np.frombuffer(bytearray(os.urandom(size)), dtype=np.uint8)
        segs = copies.segments(size)
        digests = [copies.checksum(chunk[lo:hi].tobytes()) for lo, hi in segs]
        chunk[copies.SEGMENT_BYTES + 77] ^= 0xFF  # segment 1 goes bad in the store
        engine = np.zeros(size + 64, dtype=np.uint8)[3:]  # unaligned: head and tail copies
        runs = np.array([(engine.ctypes.data, 0, size)], dtype=np.uint64)
        expected = (ctypes.c_uint32 * len(segs))(*digests)
        failed, got = native.copy(runs, chunk.ctypes.data, 0, size, expected, to_store=False)
        bad = chunk[copies.SEGMENT_BYTES : 2 * copies.SEGMENT_BYTES]
        assert failed == 1 and got == copies.checksum(bad.tobytes()) != digests[1]
        assert np.array_equal(engine[: 2 * copies.SEGMENT_BYTES], chunk[: 2 * copies.SEGMENT_BYTES])
        assert not engine[2 * copies.SEGMENT_BYTES : size].any()  # nothing after it is written
    finally:
        native.stream(was)


def test_a_native_copy_lets_other_threads_run(native: nativecopy.NativeCopy) -> None:
    """While one thread copies, another runs Python: the counter it advances moves
    during a native call (it cannot if the call holds the GIL)."""
    size = 64 << 20
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    runs = np.array([(src.ctypes.data, 0, size)], dtype=np.uint64)
    digests = (ctypes.c_uint32 * len(copies.segments(size)))()
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    moved = []
    try:
        for _ in range(20):
            before = count[0]
            native.copy(runs, dst.ctypes.data, 0, size, digests, to_store=True)
            moved.append(count[0] - before)
            if moved[-1] > 0:
                break
    finally:
        stop.set()
        spinner.join(10)
    assert max(moved) > 0, moved


def test_a_missing_or_broken_library_means_the_python_loop_and_says_why(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(copies, "NATIVE", None)
    monkeypatch.setattr(nativecopy, "_WHY_NOT", "")
    assert copies.copy_loop() == ("python", "the native loop is turned off in this process")
    assert nativecopy.native_path(tmp_path) is None
    assert nativecopy.load_native(tmp_path / "_copyloop.so") is None
    name, why = copies.copy_loop()
    assert name == "python" and "not built when kvsvc was installed" in why
    bad = tmp_path / "bad.so"
    bad.write_bytes(b"not a shared object")
    assert nativecopy.load_native(bad) is None
    name, why = copies.copy_loop()
    assert name == "python" and why.startswith("cannot load bad.so (")


def test_the_package_builds_copy_loop_is_found_by_this_interpreters_suffix(tmp_path) -> None:
    """setup.py builds it as an extension module's file (no PyInit): the name
    carries the interpreter's suffix, and the one this interpreter would import wins."""
    import importlib.machinery

    for suffix in reversed(importlib.machinery.EXTENSION_SUFFIXES):
        (tmp_path / f"_copyloop{suffix}").write_bytes(b"")
    best = importlib.machinery.EXTENSION_SUFFIXES[0]
    assert nativecopy.native_path(tmp_path) == tmp_path / f"_copyloop{best}"


def test_copy_loop_names_the_native_loop_and_its_crc_path(native: nativecopy.NativeCopy) -> None:
    name, why = copies.copy_loop()
    assert name == "native"
    assert why.endswith(nativecopy.CRC_PATHS[native.level])


@pytest.mark.parametrize("streaming", [True, False], ids=["non-temporal", "cached"])
def test_copies_at_every_alignment_agree_with_the_package(
    native: nativecopy.NativeCopy, streaming: bool
) -> None:
    """Both store paths (non-temporal stores with a one-pass CRC where the CPU folds,
    cached stores elsewhere) land the same bytes and CRCs, and a Retrieve lands the
    same bytes, for chunks and engine runs at every alignment and run lengths around
    the non-temporal path's 64- and 256-byte steps and 4 KiB threshold (a Retrieve
    streams only from 4 MiB a span: the engine reads a small one next)."""
    if streaming and native.level < 2:
        pytest.skip("this CPU does not fold the CRC: copies use cached stores only")
    assert native.stream(streaming) == streaming
    try:
        # 4.6 MiB in all: a Retrieve of it streams too (from 4 MiB a span)
        lengths = [1, 63, 4095, 4096, 4097, 4096 + 255, 40_000, 32768 + 64 + 7, 300_001, 4 << 20]
        size = sum(lengths)
        rng = np.random.default_rng(7)
        for shift in (0, 1, 17, 63):
            engine = np.frombuffer(bytearray(rng.bytes(size + 4096)), dtype=np.uint8)
            base = engine.ctypes.data
            rows, pos, gap = [], 0, shift
            for n in lengths:  # runs at odd engine addresses, in chunk order
                rows.append((base + gap, pos, n))
                pos, gap = pos + n, gap + n + (shift or 5)
            runs = np.array(rows[: sum(1 for r in rows if r[0] + r[2] <= base + len(engine))],
                            dtype=np.uint64)  # fmt: skip
            total = int(runs[-1][1] + runs[-1][2])
            room = np.zeros(total + 64 + shift, dtype=np.uint8)
            chunk = room[shift : shift + total]  # a chunk at an odd address too
            nseg = copies.segment_count(total)
            digests = (ctypes.c_uint32 * nseg)()
            assert native.copy(runs, chunk.ctypes.data, 0, total, digests, to_store=True) == (
                -1, 0,
            )  # fmt: skip
            want = b"".join(engine[a - base : a - base + n].tobytes() for a, _, n in runs)
            assert chunk.tobytes() == want, shift
            segs = copies.segments(total)
            assert list(digests) == [copies.checksum(want[lo:hi]) for lo, hi in segs], shift
            out = np.zeros_like(engine)
            back = np.array([(out.ctypes.data + a - base, p, n) for a, p, n in runs.tolist()],
                            dtype=np.uint64)  # fmt: skip
            assert native.copy(back, chunk.ctypes.data, 0, total, digests, to_store=False) == (
                -1, 0,
            )  # fmt: skip
            for a, _, n in runs:
                assert np.array_equal(out[a - base : a - base + n], engine[a - base : a - base + n])
    finally:
        native.stream(True)


@pytest.mark.parametrize("loop", ["native", "python"])
def test_tasks_sharing_a_chunk_copy_each_segment_once_and_help_from_the_back(
    native: nativecopy.NativeCopy, loop: str
) -> None:
    """Two tasks of one chunk's copy (copies.Claims): a task that has ended its own
    range takes the rest of the other's from its back, but never the other's first
    segment before its owner began; the CRCs and bytes are those of one copy."""
    nseg = 7
    size = nseg * copies.SEGMENT_BYTES - 999
    engine = np.frombuffer(bytearray(os.urandom(size)), dtype=np.uint8)
    runs = np.array([(engine.ctypes.data, 0, size)], dtype=np.uint64)
    chunk = np.zeros(size, dtype=np.uint8)
    want = [copies.checksum(engine[lo:hi].tobytes()) for lo, hi in copies.segments(size)]

    def task(claims: copies.Claims, me: int) -> int:
        if loop == "native":
            failed, _ = native.claim(runs, chunk.ctypes.data, size, claims, me, to_store=True)
            return failed
        while (s := claims.next(me)) is not None:
            lo, hi = s * copies.SEGMENT_BYTES, min((s + 1) * copies.SEGMENT_BYTES, size)
            chunk[lo:hi] = engine[lo:hi]
            claims.digests[s] = copies.checksum(chunk[lo:hi].tobytes())
        return -1

    # Task 0 has not begun: task 1 copies its own range [4, 7) and leaves 0's alone.
    claims = copies.Claims([(0, 4), (4, 7)], None)
    assert task(claims, 1) == -1
    assert (claims.mine(0), claims.mine(1)) == ([], [4, 5, 6])
    assert task(claims, 0) == -1
    assert claims.mine(0) == [0, 1, 2, 3]
    assert list(claims.digests) == want and chunk.tobytes() == engine.tobytes()
    # Task 0 has begun (holds segment 0): task 1 then helps, from the back.
    chunk[:] = 0
    claims = copies.Claims([(0, 4), (4, 7)], None)
    claims.ranges[0] = 1 | 4 << 32  # task 0 claimed segment 0 and copies it
    claims.owner[0] = 1
    assert task(claims, 1) == -1
    assert claims.mine(1) == [1, 2, 3, 4, 5, 6]
    assert task(claims, 0) == -1 and claims.mine(0) == [0]  # nothing left to claim
    lo, hi = 0, copies.SEGMENT_BYTES
    chunk[lo:hi] = engine[lo:hi]  # what task 0 was copying
    claims.digests[0] = copies.checksum(chunk[lo:hi].tobytes())
    assert list(claims.digests) == want and chunk.tobytes() == engine.tobytes()


def test_a_failed_check_in_a_shared_retrieve_stops_every_task(
    native: nativecopy.NativeCopy,
) -> None:
    size = 6 * copies.SEGMENT_BYTES
    chunk = np.frombuffer(bytearray(os.urandom(size)), dtype=np.uint8)
    digests = [copies.checksum(chunk[lo:hi].tobytes()) for lo, hi in copies.segments(size)]
    chunk[4 * copies.SEGMENT_BYTES + 5] ^= 0xFF  # segment 4 goes bad in the store
    engine = np.zeros(size, dtype=np.uint8)
    runs = np.array([(engine.ctypes.data, 0, size)], dtype=np.uint64)
    claims = copies.Claims([(0, 3), (3, 6)], digests)
    claims.ranges[0] = 1 | 3 << 32  # task 0 holds segment 0
    failed, got = native.claim(runs, chunk.ctypes.data, size, claims, 1, to_store=False)
    assert failed == 4 and got == copies.checksum(chunk[4 << 20 : 5 << 20].tobytes())
    assert claims.mine(1) == [3, 4]  # stopped at the bad one
    # written (its blocks hold bytes that failed), then nothing after it
    assert np.array_equal(engine[3 << 20 : 5 << 20], chunk[3 << 20 : 5 << 20])
    assert not engine[5 * copies.SEGMENT_BYTES :].any()
    assert all(claims.ranges[k] & 0xFFFFFFFF == claims.ranges[k] >> 32 for k in range(2))
    assert native.claim(runs, chunk.ctypes.data, size, claims, 0, to_store=False) == (-1, 0)
    assert claims.mine(0) == []  # nothing left to claim for anyone
