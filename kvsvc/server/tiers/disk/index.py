"""What the disk holds, in memory: each chunk's file and size, least recently used
first, with the (namespace, key) counts Lookup by namespace needs. Rebuilt at
start by reading every file's header (not its bytes: those are checked when
loaded); a file whose header does not check is quarantined and counted, once
logged per kind. Leftover temporary files (a write a crash interrupted) are
removed. Only the event loop touches an Index once it is built."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvsvc.server.data.store import ChunkKey
from kvsvc.server.tiers.disk.format import (
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
#: threads reading headers at start: a cold disk answers several reads at once, and
#: open/pread/close release the GIL (docs/benchmarks.md: the rebuild of 100k chunks)
REBUILD_THREADS = 8


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
    modified first so the LRU order survives the restart."""
    t0 = time.monotonic()
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
        parts = list(pool.map(lambda sub: _read_dir(root, sub), subdirs))
    refused: dict[str, int] = {}
    found: list[Found] = []
    for items, bad in parts:
        found += items
        for rel, kind, detail in bad:  # quarantined here, one thread: logged once per kind
            _refuse(root, rel, kind, detail, refused)
    found.sort(key=lambda t: t[0])  # distinct chunks: a file is named by its chunk
    index = Index.of([(key, entry) for _, key, entry in found])
    return Rebuilt(index, refused, temporaries, time.monotonic() - t0)


def _read_dir(root: str, sub: str) -> tuple[list[Found], list[tuple[str, str, str]]]:
    """The entries of one subdirectory's files, and those refused: (name, kind, why)."""
    found: list[Found] = []
    bad: list[tuple[str, str, str]] = []
    with os.scandir(os.path.join(root, sub)) as it:
        names = [e.name for e in it if e.name.endswith(SUFFIX)]
    for name in names:
        rel = f"{sub}/{name}"
        try:
            found.append(_read_entry(root, rel))
        except FileNotFoundError:
            continue  # removed meanwhile
        except Refused as exc:
            bad.append((rel, exc.kind, str(exc)))
        except OSError as exc:
            bad.append((rel, "io_error", str(exc)))
    return found, bad


def _read_entry(root: str, rel: str) -> Found:
    fd, st = open_file(os.path.join(root, rel))
    try:
        head = parse_header(os.pread(fd, PAGE, 0) if st.st_size > 0 else b"")
        if head.data_offset > PAGE:  # a long key or many segments: read all of it
            head = parse_header(os.pread(fd, head.data_offset, 0))
    finally:
        os.close(fd)
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
