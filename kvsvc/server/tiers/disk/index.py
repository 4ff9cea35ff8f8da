"""What the disk holds, in memory: each chunk's file and size, least recently used
first, with the (namespace, key) counts Lookup by namespace needs. Rebuilt at
start by reading every file's header (not its bytes: those are checked when
loaded); a file whose header does not check is quarantined and counted, once
logged per kind. Leftover temporary files (a write a crash interrupted) are
removed. Only the event loop touches an Index once it is built."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import resource
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain

from kvsvc.server.data.store import ChunkKey
from kvsvc.server.tiers.disk.format import (
    IO_ERROR,
    PAGE,
    QUARANTINE_DIR,
    SUFFIX,
    TMP_DIR,
    TRUNCATED,
    Refused,
    file_name,
    fingerprint,
    open_file,
    parse_header,
)

log = logging.getLogger("kvsvc.server.tiers.disk")

#: at most this many quarantined files are kept (the oldest beyond are removed)
QUARANTINE_KEEP = 64
#: threads reading headers at start, and the files each opens at once: a thread opens
#: a batch and asks for every header page of it together (posix_fadvise WILLNEED
#: queues the reads without waiting, so threads x batch are in flight on a disk that
#: serves many at a time), then checks the headers in turn as they land. Files go in
#: inode order: on ext4 the order they were written, inodes and pages side by side.
#: Two threads: one checks while the other is in the kernel (a cold open); more only
#: pass the GIL to and fro, and a thread blocked per read (8 of them, 8 reads in
#: flight) spent more CPU switching than reading (docs/benchmarks.md: 100k chunks)
REBUILD_THREADS = 2
REBUILD_BATCH = 128  # fewer where the limit on open files is low: a quarter of it in all
#: how long a thread holding no file waits for a file descriptor (the other threads
#: close theirs) before it counts the file an io_error
OUT_OF_FILES_WAIT = 1.0


@dataclass(slots=True)
class Entry:
    """One chunk file."""

    name: str  # relative to the tier's directory
    size: int  # the chunk's bytes
    file_bytes: int  # the file's (what counts against --disk-capacity)
    owner: str = ""
    #: which bytes (format.fingerprint of the CRCs): a Store of other bytes replaces it
    version: int = 0


#: a file's (mtime, chunk, entry)
Found = tuple[int, ChunkKey, Entry]
#: a file to read at the rebuild: (inode, position in the listing, name under the root)
Listed = tuple[int, int, str]
#: a refused file: (position in the listing, name, kind, why)
Bad = tuple[int, str, str, str]


@dataclass
class Index:
    entries: OrderedDict[ChunkKey, Entry] = field(default_factory=OrderedDict)
    #: (namespace, key) -> layouts it is on disk in
    keys: dict[tuple[str, bytes], int] = field(default_factory=dict)
    used_bytes: int = 0
    used_by: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: ChunkKey) -> Entry | None:
        return self.entries.get(key)

    def has(self, namespace: str, key: bytes, layout: str | None) -> bool:
        if layout is None:
            return (namespace, key) in self.keys
        return (namespace, key, layout) in self.entries

    def add(self, key: ChunkKey, entry: Entry) -> bool:
        """List a file (most recently used); False if it was listed already (a
        rewrite: the file in place is the new one, so its entry replaces the old)."""
        if key in self.entries:
            self.remove(key)
            self.add(key, entry)
            return False
        self.entries[key] = entry
        pair = (key[0], key[1])
        self.keys[pair] = self.keys.get(pair, 0) + 1
        self.used_bytes += entry.file_bytes
        self.used_by[entry.owner] = self.used_by.get(entry.owner, 0) + entry.file_bytes
        return True

    @classmethod
    def of(cls, items: list[tuple[ChunkKey, Entry]]) -> Index:
        """An index of distinct chunks, least recently used first (built in bulk)."""
        index = cls(OrderedDict(items))
        keys, used_by = index.keys, index.used_by
        for (namespace, key, _), entry in items:
            keys[(namespace, key)] = keys.get((namespace, key), 0) + 1
            used_by[entry.owner] = used_by.get(entry.owner, 0) + entry.file_bytes
        index.used_bytes = sum(used_by.values())
        return index

    def touch(self, key: ChunkKey) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def remove(self, key: ChunkKey) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        pair = (key[0], key[1])
        if self.keys[pair] == 1:
            del self.keys[pair]
        else:
            self.keys[pair] -= 1
        self.used_bytes -= entry.file_bytes
        self.used_by[entry.owner] -= entry.file_bytes
        return entry


@dataclass
class Rebuilt:
    """An index read from a directory, and what was refused on the way."""

    index: Index
    refused: dict[str, int]
    temporaries: int
    seconds: float


def prepare(root: str) -> None:
    """Make the directory and its parts, and prove it writable (OSError if not)."""
    os.makedirs(root, exist_ok=True)
    for sub in (TMP_DIR, QUARANTINE_DIR):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    probe = os.path.join(root, TMP_DIR, f".probe-{os.getpid()}")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"kvsvc")
    finally:
        os.close(fd)
    os.unlink(probe)


def rebuild(root: str) -> Rebuilt:
    """Read every chunk file's header under ``root`` (on a thread: it blocks), oldest
    modified first so the LRU order survives the restart. The cyclic garbage
    collector is held off meanwhile: the entries it builds survive, and the full
    collections they set off walked every object of the server (a third of a warm
    rebuild of 100k chunks); nothing it makes is a cycle."""
    t0 = time.monotonic()
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _rebuild(root, t0)
    finally:
        if collecting:
            gc.enable()


def _rebuild(root: str, t0: float) -> Rebuilt:
    temporaries = 0
    with os.scandir(os.path.join(root, TMP_DIR)) as it:
        for e in it:
            try:
                os.unlink(e.path)
                temporaries += 1
            except FileNotFoundError:
                pass
    with os.scandir(root) as top:
        subdirs = sorted(e.name for e in top if e.is_dir() and len(e.name) == 2)
    with ThreadPoolExecutor(REBUILD_THREADS, thread_name_prefix="kvsvc-disk-index") as pool:
        names = chain.from_iterable(pool.map(lambda sub: _list_dir(root, sub), subdirs))
        # position: the listing's order (subdirectory, then as listed), which breaks
        # ties of mtime below as the reads' order used to
        work: list[Listed] = [(ino, pos, rel) for pos, (ino, rel) in enumerate(names)]
        work.sort(key=lambda t: t[0])
        n = _batch_size()
        batches = [work[i : i + n] for i in range(0, len(work), n)]
        parts = list(pool.map(lambda batch: _read_batch(root, batch), batches))
    refused: dict[str, int] = {}
    found: list[tuple[int, Found]] = []
    bad: list[Bad] = []
    for items, refusals in parts:
        found += items
        bad += refusals
    bad.sort(key=lambda t: t[0])
    for _, rel, kind, detail in bad:  # quarantined here, one thread: logged once per kind
        _refuse(root, rel, kind, detail, refused)
    found.sort(key=lambda t: (t[1][0], t[0]))  # by mtime (a file is named by its chunk)
    index = Index.of([(key, entry) for _, (_, key, entry) in found])
    return Rebuilt(index, refused, temporaries, time.monotonic() - t0)


def _list_dir(root: str, sub: str) -> list[tuple[int, str]]:
    """(inode, name under the root) of one subdirectory's chunk files, as listed
    (the inode is the directory entry's: no stat)."""
    with os.scandir(os.path.join(root, sub)) as it:
        return [(e.inode(), f"{sub}/{e.name}") for e in it if e.name.endswith(SUFFIX)]


def _batch_size() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return REBUILD_BATCH
    return max(1, min(REBUILD_BATCH, soft // (4 * REBUILD_THREADS)))


def _read_batch(root: str, batch: list[Listed]) -> tuple[list[tuple[int, Found]], list[Bad]]:
    """The entries of a run of files, by position, and those refused. Opens them all,
    asks for their header pages at once, then reads and checks each; out of file
    descriptors, it checks those it holds and goes on."""
    found: list[tuple[int, Found]] = []
    bad: list[Bad] = []
    i, waited = 0, 0.0
    while i < len(batch):
        held: list[tuple[int, str, int, os.stat_result]] = []
        try:
            while i < len(batch):
                _, pos, rel = batch[i]
                try:
                    fd, st = open_file(f"{root}/{rel}")
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        if held:
                            break  # check those held (closing them), then go on
                        if waited < OUT_OF_FILES_WAIT:  # the other threads close theirs
                            time.sleep(0.01)
                            waited += 0.01
                            continue
                    i += 1
                    if not isinstance(exc, FileNotFoundError):  # else removed meanwhile
                        bad.append((pos, rel, IO_ERROR, str(exc)))
                    continue
                except Refused as exc:
                    i += 1
                    bad.append((pos, rel, exc.kind, str(exc)))
                    continue
                i += 1
                held.append((pos, rel, fd, st))
                if st.st_size > 0:  # only a hint: the read below asks again
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, PAGE, os.POSIX_FADV_WILLNEED)
            held.reverse()
            while held:
                pos, rel, fd, st = held[-1]
                try:
                    found.append((pos, _read_entry(rel, fd, st)))
                except Refused as exc:
                    bad.append((pos, rel, exc.kind, str(exc)))
                except OSError as exc:
                    bad.append((pos, rel, IO_ERROR, str(exc)))
                finally:
                    held.pop()
                    os.close(fd)
        finally:
            for _, _, fd, _ in held:
                os.close(fd)
    return found, bad


def _read_entry(rel: str, fd: int, st: os.stat_result) -> Found:
    """The entry of an open chunk file (``st``: its stat), or Refused."""
    head = parse_header(os.pread(fd, PAGE, 0) if st.st_size > 0 else b"")
    if head.data_offset > PAGE:  # a long key or many segments: read all of it
        head = parse_header(os.pread(fd, head.data_offset, 0))
    if st.st_size < head.file_bytes:
        raise Refused(TRUNCATED, f"{st.st_size} of {head.file_bytes} bytes")
    if file_name(head.namespace, head.layout, head.key) != rel:
        raise Refused("bad_name", "the file's name is not its header's chunk")
    key: ChunkKey = (head.namespace, head.key, head.layout)
    entry = Entry(rel, head.size, head.file_bytes, head.owner, fingerprint(head.size, head.digests))
    return st.st_mtime_ns, key, entry


def _refuse(root: str, rel: str, kind: str, detail: str, counts: dict[str, int]) -> None:
    counts[kind] = counts.get(kind, 0) + 1
    if counts[kind] == 1:
        log.warning("disk tier: %s refused (%s); quarantined, logged once per kind", rel, detail)
    quarantine(root, rel)


def quarantine(root: str, rel: str) -> None:
    """Move a bad file aside (kept for a post-mortem, at most QUARANTINE_KEEP)."""
    qdir = os.path.join(root, QUARANTINE_DIR)
    try:
        os.rename(os.path.join(root, rel), os.path.join(qdir, rel.replace("/", "_")))
    except FileNotFoundError:
        return
    except OSError:
        try:
            os.unlink(os.path.join(root, rel))
        except OSError:
            log.warning("disk tier: could not quarantine nor remove %s", rel, exc_info=True)
        return
    with os.scandir(qdir) as it:
        kept = sorted((e.stat().st_mtime_ns, e.path) for e in it)
    for _, path in kept[:-QUARANTINE_KEEP]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
