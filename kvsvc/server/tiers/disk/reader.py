"""Loads from disk back into the store: the leading keys of a Retrieve that memory
misses and the disk holds are reserved in the store (as a Store reserves them; a
refused reservation is a miss), read straight into their chunks on a reader
thread, checked against their header and CRC-32Cs, then committed in key order up
to the first that fails. A file that fails (I/O error, bad header or checksum,
truncated) is quarantined and forgotten; one deleted under the server is only
forgotten: both are misses. The caller waits within its budget; a load that
ends later still commits (the next call hits memory)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import fcntl
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvsvc.errors import CapacityExhausted
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.tiers.disk.format import (
    IO_ERROR,
    OTHER_CHUNK,
    PAGE,
    TRUNCATED,
    Refused,
    open_file,
    parse_header,
    verify,
)
from kvsvc.server.tiers.disk.index import Entry

log = logging.getLogger("kvsvc.server.tiers.disk")

#: threads reading chunk files (a disk serves few readers well)
READERS = 2
#: read in pieces of at most this many bytes
READ_PIECE = 8 << 20
#: chunks of at least this many bytes are read with O_DIRECT where the filesystem
#: takes it: from the device straight into the store, no page-cache copy
DIRECT_MIN = 4 << 20

#: a load's outcome per chunk: its digests, or why it failed ("gone": deleted)
Outcome = tuple[list[int], None] | tuple[None, str]


@dataclass
class Job:
    chunk: Chunk
    entry: Entry


class Reader:
    """The reader threads; the tier decides what to load and settles the outcome."""

    def __init__(self, root: str, store: ChunkStore, loop: asyncio.AbstractEventLoop) -> None:
        self.root, self.store, self.loop = root, store, loop
        self._pool = concurrent.futures.ThreadPoolExecutor(
            READERS, thread_name_prefix="kvsvc-disk-read"
        )

    def run(self, fn: Callable[..., object], *args: object) -> None:
        """Run a blocking file operation off the loop (a quarantine), failures logged."""
        future = self._pool.submit(fn, *args)
        future.add_done_callback(_log_failure)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def reserve(
        self, namespace: str, layout: str, todo: list[tuple[bytes, Entry]]
    ) -> list[Job] | None:
        """Room in the store for the longest leading part of ``todo`` that fits (all,
        else half, and so on: the caller's prefix ends there), or None (a miss)."""
        budget = self.store.capacity // 2  # never evict the whole store for one call
        n, total = 0, 0
        while n < len(todo) and total + todo[n][1].size <= budget:
            total += todo[n][1].size
            n += 1
        n = max(n, 1)
        while n:
            part = todo[:n]
            try:
                chunks, _ = self.store.reserve(
                    namespace,
                    [(key, e.size) for key, e in part],
                    layout,
                    part[0][1].owner,
                    origin="disk",
                )
            except CapacityExhausted:
                n //= 2
                continue
            return [Job(c, e) for c, (_, e) in zip(chunks, part, strict=True)]
        return None

    def read(self, jobs: list[Job]) -> asyncio.Future[list[Outcome]]:
        """Read every job's file into its chunk on a reader thread (stops at the first
        failure: the rest would not be committed)."""
        return asyncio.wrap_future(self._pool.submit(self._read_all, jobs), loop=self.loop)

    def _read_all(self, jobs: list[Job]) -> list[Outcome]:
        out: list[Outcome] = []
        for job in jobs:
            outcome = self._read_one(job)
            out.append(outcome)
            if outcome[0] is None:
                break
        return out

    def _read_one(self, job: Job) -> Outcome:
        chunk, entry = job.chunk, job.entry
        path = os.path.join(self.root, entry.name)
        try:
            fd, _ = open_file(path)
        except FileNotFoundError:
            return None, "gone"
        except Refused as exc:
            return None, exc.kind
        except OSError:
            return None, IO_ERROR
        try:
            head = parse_header(os.pread(fd, PAGE, 0))
            if head.data_offset > PAGE:
                head = parse_header(os.pread(fd, head.data_offset, 0))
            if (head.namespace, head.key, head.layout) != chunk.key or head.size != chunk.size:
                raise Refused(OTHER_CHUNK, "the header names another chunk")
            buf = self.store.buffer(chunk)
            view = buf.view
            whole = len(view) // PAGE * PAGE if buf.addr % PAGE == 0 else 0
            if len(view) >= DIRECT_MIN and whole and _direct(fd, on=True):
                try:
                    _read_all(fd, view[:whole], head.data_offset)
                finally:
                    _direct(fd, on=False)
                _read_all(fd, view[whole:], head.data_offset + whole)  # the partial page
            else:
                _read_all(fd, view, head.data_offset)
            verify(view, head.digests)
            return list(head.digests), None
        except Refused as exc:
            return None, exc.kind
        except OSError:
            return None, IO_ERROR
        finally:
            os.close(fd)


def _direct(fd: int, *, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False where the filesystem refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + READ_PIECE]], offset + done)
        if n == 0:
            raise Refused(TRUNCATED, f"{done} of {len(view)} bytes")
        if n < 0:
            raise OSError(errno.EIO, "read failed")
        done += n


def _log_failure(future: concurrent.futures.Future[object]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("disk tier: a file operation failed", exc_info=future.exception())
