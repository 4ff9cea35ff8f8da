"""The record of removals the disk tier owes (kvsvc.server.tiers.disk.owed), on
real files: what one process adds the next one loads; only chunk file names come
back (nothing that could name a file outside --disk-dir); a record directory the
server does not own privately is never written; another directory's record is
not this one's."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvsvc.server.tiers.disk.format import file_name
from kvsvc.server.tiers.disk.owed import RECORD_DIR, OwedRecord

A = file_name("ns", "inline", b"a")
B = file_name("ns", "inline", b"b")


def test_what_is_added_is_loaded_by_a_new_record_and_written_down_to_nothing(
    tmp_path: Path,
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    rec = OwedRecord("/srv/disk", str(shm))
    assert rec.load() == []
    assert rec.add([A]) and rec.add([B, A])
    assert OwedRecord("/srv/disk", str(shm)).load() == sorted({A, B})  # a new process
    assert (shm / RECORD_DIR).stat().st_mode & 0o777 == 0o700
    rec.write([B])
    assert OwedRecord("/srv/disk", str(shm)).load() == [B]
    rec.write([])
    assert OwedRecord("/srv/disk", str(shm)).load() == []
    assert list((shm / RECORD_DIR).iterdir()) == []
    assert OwedRecord("/srv/other", str(shm)).load() == []


def test_only_chunk_file_names_come_back(tmp_path: Path) -> None:
    rec = OwedRecord("/srv/disk", str(tmp_path))
    assert rec.add([A])
    with open(rec.path, "a") as f:
        lines = ["../../etc/passwd", "/etc/passwd", "ab/" + "cd" * 20 + ".kv", A[:-3], "zz"]
        f.write("\n".join(lines) + "\n" + B[:10])  # the last one torn by a crash
    assert rec.load() == [A]


def test_a_record_directory_someone_else_made_is_never_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client can make files in the shm dir: a directory open to others (or a
    symlink) in the record's place is refused, logged once, counted."""
    caplog.set_level(logging.ERROR, logger="kvsvc.server.tiers.disk")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / RECORD_DIR)
    rec = OwedRecord("/srv/disk", str(tmp_path))
    assert not rec.add([A]) and not rec.add([B])
    assert list(elsewhere.iterdir()) == []
    os.unlink(tmp_path / RECORD_DIR)
    (tmp_path / RECORD_DIR).mkdir(mode=0o777)
    os.chmod(tmp_path / RECORD_DIR, 0o777)
    assert not rec.add([A])
    assert rec.failures == 3
    assert sum("cannot be recorded" in r.getMessage() for r in caplog.records) == 1
