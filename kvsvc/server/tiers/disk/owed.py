"""Removals the disk tier owes, recorded where the next start finds them.

A Store that replaces a version on disk removes the old file before it replies.
When the disk refuses that removal (read-only, EIO, EACCES) the file stays, and
nothing on that disk can say it must not be served again: a disk that refuses a
removal takes no record either. Kept in memory only, the debt would die with the
process, and a later start on the recovered disk would index the old version and
serve it. So the file's name is written, before the reply, to a small record on
another filesystem the server always has writable: ``<--shm-dir>/kvsvc-disk/<hash
of --disk-dir>.owed``, in a directory of the server's own (mode 0700, owned by
it; a region name cannot hold a "/", so no client can map the record). The same
goes for files evicted or dropped whose removal the disk refused.

The tier settles the record as the files go: removed once the disk takes writes
again (or at stop), or replaced by the rename of a newer version. A start removes
every file the record lists before it rebuilds the index, and never indexes one
it still cannot remove. A name in the record whose file was meanwhile rewritten
(a crash between a removal and the record's update) costs a miss, never wrong
bytes.

What the record cannot cover: it lives as long as the shm dir's contents. Where
that is a tmpfs (/dev/shm, the default), a host reboot or a new pod forgets it, so
a replaced version can come back only if the disk refused its removal, no server
saw the disk take writes again before that reboot, and the next start found the
disk writable. A record that cannot be written (the shm dir refuses) is logged
once as an error and counted (``failures``)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import stat
import threading
from collections.abc import Iterable

log = logging.getLogger("kvsvc.server.tiers.disk")

#: the record's directory under --shm-dir
RECORD_DIR = "kvsvc-disk"
#: a chunk file's name (format.file_name): nothing else is ever removed from a record
_NAME = re.compile(r"([0-9a-f]{2})/([0-9a-f]{40})\.kv")


class OwedRecord:
    """The record of one --disk-dir. ``add`` runs on the loop before a reply;
    ``load`` and ``write`` wherever the tier needs them (a lock orders them)."""

    def __init__(self, root: str, shm_dir: str) -> None:
        self.root = root
        self.dir = os.path.join(os.path.abspath(shm_dir), RECORD_DIR)
        digest = hashlib.blake2b(root.encode(), digest_size=10).hexdigest()
        self.path = os.path.join(self.dir, f"{digest}.owed")
        self._head = f"# kvsvc disk tier: files under {root} owed removal\n"
        self.failures = 0  # records that could not be written
        self._lock = threading.Lock()

    def load(self) -> list[str]:
        """The names recorded (checked: chunk file names only), or []."""
        with self._lock:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                return []
            except OSError as exc:
                log.error("disk tier: the record of removals owed %s: %s", self.path, exc)
                return []
            with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
                text = f.read()
        if not text.startswith(self._head):  # not this directory's (or torn)
            return []
        names = set()
        for line in text[len(self._head) :].splitlines():
            m = _NAME.fullmatch(line)
            if m and m[2].startswith(m[1]):
                names.add(line)
        return sorted(names)

    def add(self, names: Iterable[str]) -> bool:
        """Append ``names`` (durable for the process's successor once this returns)."""
        lines = "".join(f"{name}\n" for name in names)
        with self._lock:
            try:
                self._own_dir()
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                fd = os.open(self.path, flags, 0o600)
                try:
                    head = self._head if os.fstat(fd).st_size == 0 else ""
                    _write_all(fd, (head + lines).encode())
                finally:
                    os.close(fd)
            except OSError as exc:
                self._failed(exc)
                return False
        return True

    def write(self, names: Iterable[str]) -> None:
        """Replace the record by ``names`` (none: the record is removed)."""
        lines = "".join(f"{name}\n" for name in sorted(names))
        with self._lock:
            try:
                if not lines:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
                    return
                self._own_dir()
                tmp = f"{self.path}.{os.getpid()}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                try:
                    _write_all(fd, (self._head + lines).encode())
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
            except OSError as exc:
                self._failed(exc)

    def pay(self) -> list[str]:
        """At start, before the index is rebuilt: remove the files an earlier process
        owed. Returns those still refused (recorded again: never to be indexed)."""
        names = self.load()
        if not names:
            return []
        left = []
        for name in names:
            try:
                os.unlink(os.path.join(self.root, name))
            except FileNotFoundError:
                continue
            except OSError as exc:
                left.append(name)
                log.warning("disk tier: removing %s, owed by an earlier server: %s", name, exc)
        self.write(left)
        log.warning(
            "disk tier: %d files an earlier server owed removal (a version replaced, or a "
            "file dropped, while %s refused writes): removed before the index is rebuilt%s",
            len(names) - len(left),
            self.root,
            f"; {len(left)} still refused, kept out of the index" if left else "",
        )
        return left

    def _own_dir(self) -> None:
        """The record's directory, made if missing; refused (OSError) unless it is a
        directory of this user that no one else may enter (never one a client made)."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.dir, 0o700)
        st = os.lstat(self.dir)
        if (
            not stat.S_ISDIR(st.st_mode)
            or st.st_uid != os.geteuid()
            or stat.S_IMODE(st.st_mode) & 0o077
        ):
            raise OSError(errno.EPERM, "not a private directory of this user", self.dir)

    def _failed(self, exc: OSError) -> None:
        self.failures += 1
        if self.failures == 1:
            log.error(
                "disk tier: the removals owed under %s cannot be recorded in %s (%s): a "
                "restart before the disk takes writes again may serve a replaced version; "
                "logged once",
                self.root,
                self.path,
                exc,
            )


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
