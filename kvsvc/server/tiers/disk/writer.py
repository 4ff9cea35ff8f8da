"""Write-behind to disk: a bounded queue (in bytes; a full queue skips the write
and counts it, so no reply waits for the disk unless it asked to) drained by one
writer thread, which also removes the files the capacity gives up (in queue
order, so room is made before the write that needs it). Each file is written
under a temporary name, flushed (fsynced with --disk-sync), renamed into place,
and with --disk-sync its directory synced: a crash leaves either the old state or
the whole new file, never a torn one at a final name."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvsvc.server.data.store import Chunk, ChunkKey, ChunkStore
from kvsvc.server.tiers.disk.format import PAGE, QUARANTINE_DIR, TMP_DIR

log = logging.getLogger("kvsvc.server.tiers.disk")

#: errors that mean "the disk is full", not "the disk is broken"
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: errors that mean "the filesystem takes no writes now" (it may again: a remount)
READ_ONLY_ERRNOS = frozenset({errno.EROFS})
PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM})


def failure(exc: OSError) -> str:
    """Why a write or a removal failed, as counted: "full", "read_only",
    "permission" or "io" (any other error of the device or filesystem)."""
    if exc.errno in FULL_ERRNOS:
        return "full"
    if exc.errno in READ_ONLY_ERRNOS:
        return "read_only"
    if exc.errno in PERMISSION_ERRNOS:
        return "permission"
    return "io"


#: written in pieces of at most this many bytes (a partial write continues)
WRITE_PIECE = 8 << 20
#: chunks of at least this many bytes are written with O_DIRECT where the filesystem
#: takes it: from the store straight to the device, no copy into the page cache
#: (whose allocation and reclaim halved Store-to-disk: docs/benchmarks.md)
DIRECT_MIN = 4 << 20


@dataclass
class Write:
    """One chunk file to write: its header and its bytes, either a read-pinned
    store chunk (``chunk``) or bytes copied out of the store (``data``)."""

    key: ChunkKey
    name: str
    header: bytes
    size: int
    owner: str
    chunk: Chunk | None = None
    data: bytes | None = None
    version: int = 0  # format.fingerprint of its bytes
    #: a later Store of other bytes replaced it: it must not land (under Writer.lock)
    superseded: bool = False
    renamed: bool = False  # at its final name (under Writer.lock)
    #: a Store waiting until it is durable (--disk-sync through)
    waiter: asyncio.Future[bool] | None = None

    @property
    def file_bytes(self) -> int:
        return len(self.header) + self.size


@dataclass
class Unlink:
    names: list[str]


@dataclass
class Probe:
    """Whether the filesystem takes writes again: a temporary file made, written,
    removed (the tier's heal schedule queues one)."""


#: outcome of a write: "written", "superseded", or why it was skipped (``failure``)
Done = Callable[[Write, str], None]
#: after a batch of removals: the names removed, and (name, failure) of those that
#: could not be (still on disk: the tier owes their removal)
Unlinked = Callable[[list[str], list[tuple[str, str]]], None]
#: after a probe: None (writes land again) or its failure
Probed = Callable[[str | None], None]


class Writer:
    """The queue and its thread. ``done`` runs on the loop after each write,
    ``unlinked`` after each batch of removals."""

    def __init__(
        self,
        root: str,
        store: ChunkStore,
        loop: asyncio.AbstractEventLoop,
        sync: bool,
        limit: int,
        done: Done,
        unlinked: Unlinked,
        probed: Probed,
    ) -> None:
        self.root, self.store, self.loop, self.sync = root, store, loop, sync
        self.limit = limit
        self.queued_bytes = 0  # on the loop
        self._done, self._unlinked, self._probed = done, unlinked, probed
        self._queue: queue.Queue[Write | Unlink | Probe | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvsvc-disk-write", daemon=True)
        self._closed = False
        self.idle = threading.Event()
        self.idle.set()
        self.direct = True  # until the filesystem refuses O_DIRECT (then buffered)
        self.direct_writes = 0  # files written with O_DIRECT (the writer thread counts)
        #: orders a rename against ``supersede`` (held for one rename, never for I/O)
        self.lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def has_room(self, size: int) -> bool:
        return not self._closed and self.queued_bytes + size <= self.limit

    def put(self, write: Write, *, bounded: bool = True) -> bool:
        """On the loop: queue ``write`` (pinning its chunk), or False when the queue
        is full (``bounded``: a write a caller waits for is never turned away)."""
        if self._closed or (bounded and not self.has_room(write.size)):
            return False
        self.queued_bytes += write.size
        if write.chunk is not None:
            write.chunk.readers += 1  # the store frees nothing the writer still reads
        self.idle.clear()
        self._queue.put(write)
        return True

    def supersede(self, write: Write) -> str | None:
        """On the loop: ``write``'s bytes were replaced by a later Store. Not yet
        renamed: it never will be. Renamed: its file is removed now, before the
        reply, so no crash brings back a version a later Store replaced. Returns
        why that removal failed (the file is still there), else None."""
        with self.lock:
            write.superseded = True
            landed = write.renamed
        if landed:
            try:
                os.unlink(os.path.join(self.root, write.name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                return failure(exc)
        return None

    def unlink(self, names: list[str]) -> None:
        if names:
            self.idle.clear()
            self._queue.put(Unlink(names))

    def probe(self) -> None:
        """Queue a probe (behind what is queued); ``probed`` tells its outcome."""
        if not self._closed:
            self.idle.clear()
            self._queue.put(Probe())

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float) -> None:
        """Stop after what is queued, waiting up to ``timeout`` s for it."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    # --- the writer thread ---
    def _run(self) -> None:
        """Every item ends in a callback to the loop, whatever it raised: one item's
        failure never ends the thread (a dead writer would skip every later write)."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._handle(item)
            except Exception:
                log.exception("disk tier: the writer failed on %r; it goes on", type(item).__name__)
                if isinstance(item, Write):
                    self._back(item, "io")
                elif isinstance(item, Probe):
                    self._tell(self._probed, "io")
                else:  # not known to be gone: owed (a later removal of a gone file is a no-op)
                    self._tell(self._unlinked, item.names, [(name, "io") for name in item.names])
            if self._queue.empty():
                self.idle.set()

    def _handle(self, item: Write | Unlink | Probe) -> None:
        if isinstance(item, Unlink):
            failed: list[tuple[str, str]] = []
            for name in item.names:
                try:
                    os.unlink(os.path.join(self.root, name))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    failed.append((name, failure(exc)))
            self._tell(self._unlinked, item.names, failed)
        elif isinstance(item, Probe):
            self._tell(self._probed, self._probe())
        else:
            self._back(item, self._write(item))

    def _tell(self, fn: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone
            self.loop.call_soon_threadsafe(fn, *args)

    def _probe(self) -> str | None:
        tmp = os.path.join(self.root, TMP_DIR, "probe-" + uuid.uuid4().hex)
        try:
            for sub in (TMP_DIR, QUARANTINE_DIR):  # made again if removed under the server
                os.makedirs(os.path.join(self.root, sub), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"kvsvc")
            finally:
                os.close(fd)
            os.unlink(tmp)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return failure(exc)
        return None

    def _back(self, write: Write, outcome: str) -> None:
        self._tell(self._finish, write, outcome)

    def _finish(self, write: Write, outcome: str) -> None:
        self.queued_bytes -= write.size
        if write.chunk is not None:
            self.store.release([write.chunk])
        self._done(write, outcome)

    def _write(self, w: Write) -> str:
        if w.superseded:  # read unlocked: a stale False is settled before the rename
            return "superseded"
        tmp = os.path.join(self.root, TMP_DIR, uuid.uuid4().hex)
        final = os.path.join(self.root, w.name)
        try:
            if w.data is not None:
                body, addr = memoryview(w.data), -1
            else:
                assert w.chunk is not None
                buf = self.store.buffer(w.chunk)
                body, addr = buf.view, buf.addr
            direct = self.direct and w.size >= DIRECT_MIN and addr % PAGE == 0
            fd, direct = self._open(tmp, direct)
            try:
                if direct:
                    _write_direct(fd, w.header, body)
                    self.direct_writes += 1
                else:
                    _write_all(fd, memoryview(w.header), 0)
                    _write_all(fd, body, len(w.header))
                if self.sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self.lock:
                if w.superseded:
                    with contextlib.suppress(OSError):  # a leftover temporary: removed at start
                        os.unlink(tmp)
                    return "superseded"
                try:
                    os.rename(tmp, final)
                except FileNotFoundError:  # its subdirectory is new (or was removed)
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    if self.sync:
                        _sync_dir(self.root)
                    os.rename(tmp, final)
                w.renamed = True
            if self.sync:
                _sync_dir(os.path.dirname(final))
            return "written"
        except OSError as exc:
            # A read-only filesystem refuses this removal too: the temporary is then
            # left for the next start, which removes interrupted writes.
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.debug("disk tier: writing %s failed: %s", w.name, exc)
            return failure(exc)

    def _open(self, tmp: str, direct: bool) -> tuple[int, bool]:
        """A new temporary file, with O_DIRECT if asked and the filesystem takes it."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if direct:
            try:
                return os.open(tmp, flags | os.O_DIRECT, 0o600), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
                log.info("disk tier: %s refuses O_DIRECT; writes go through the page cache", tmp)
                with contextlib.suppress(FileNotFoundError):  # made before the refusal
                    os.unlink(tmp)
        return os.open(tmp, flags, 0o600), False


def _write_direct(fd: int, header: bytes, body: memoryview) -> None:
    """Header and bytes through an O_DIRECT fd: the header (a whole number of pages)
    and the bytes' last partial page from page-aligned copies, the rest from the
    store (page-aligned); the file then cut to its length."""
    whole = len(body) // PAGE * PAGE
    tail = len(body) - whole
    with mmap.mmap(-1, len(header) + (PAGE if tail else 0)) as aligned:
        aligned[: len(header)] = header
        view = memoryview(aligned)
        try:
            _write_all(fd, view[: len(header)], 0)
            _write_all(fd, body[:whole], len(header))
            if tail:
                view[len(header) : len(header) + tail] = body[whole:]
                _write_all(fd, view[len(header) :], len(header) + whole)
        finally:
            view.release()
    if tail:
        os.ftruncate(fd, len(header) + len(body))


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done : done + WRITE_PIECE], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
