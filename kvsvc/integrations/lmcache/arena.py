"""LMCache's L1 arena mapped by kvsvc itself: the direct data path (one copy, done
by kvsvc's server, straight between its store and LMCache's objects).

LMCache's MP server started with ``--shm-name NAME`` (and, where pinned memory
is lazy, ``--no-l1-use-lazy``) allocates its L1 arena as the POSIX shm file
``/dev/shm/lmcache_l1_pool_NAME`` (its engine workers open it by that name). The
adapter gets only ``l1_memory_desc`` (a pointer and a size), so ``find_l1_file``
looks the pointer up in /proc/self/maps, opens the file behind it by path and
checks it is that very file (device and inode). kvsvc's client passes it by fd as
a plain shared file (``register_memfd(fd, shared_file=True)``): the server copies
it with ``preadv``/``pwritev``, never maps it, so an owner that shrinks it causes
a typed error, not a SIGBUS; and the server holds the file by its own fd, so a copy
that lands after LMCache exited writes an orphaned file, never other memory.

Per object size S and direction, one mapping of the whole file: a tensor of
``(size - S) // G + 1`` blocks of S bytes whose block stride is G (the arena's
alignment): block i is the S bytes at ``i * G``, so every object is one block and
one chunk is one block id. Its layout (uint8, blocks of [S]) is the staging
lanes', so chunks one node stored through staging load here and the other way.
Anything else (anonymous or pinned memory, no ``--shm-name``, a file kvsvc
refuses) keeps the staging lanes (lanes.py), chosen at construction and said why."""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Any

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.client.kvcache import rank_context
from kvsvc.errors import InvalidRequest, KVServiceError, PermissionDenied, RegionUnavailable
from kvsvc.integrations.common import Link
from kvsvc.pidfds import ProcessWatch
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger("kvsvc.lmcache")

#: The smallest block stride: objects whose offset in the arena is not a multiple
#: of max(this, the arena's alignment) go through staging.
MIN_STRIDE = 4096


@dataclass
class L1File:
    """The shared file behind LMCache's L1 arena, opened read-write."""

    fd: int
    path: str
    base: int  # address of the arena's first byte in this process
    offset: int  # of that byte in the file
    size: int  # arena bytes
    stride: int  # block stride G


def _maps_line(ptr: int) -> list[str] | None:
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, _, hi = parts[0].partition("-")
            if int(lo, 16) <= ptr < int(hi, 16):
                return parts
    return None


def find_l1_file(desc: Any) -> L1File | str:
    """The shared file behind ``desc`` (LMCache's ``L1MemoryDesc``), or why the
    arena cannot be passed to kvsvc (one line)."""
    if desc is None:
        return "LMCache passed no l1_memory_desc"
    try:
        ptr, size, align = int(desc.ptr), int(desc.size), int(desc.align_bytes or 1)
    except (AttributeError, TypeError, ValueError):
        return f"l1_memory_desc {desc!r} has no pointer and size"
    if ptr <= 0 or size <= 0:
        return f"l1_memory_desc names no memory (ptr {ptr:#x}, size {size})"
    parts = _maps_line(ptr)
    if parts is None:
        return f"the L1 arena at {ptr:#x} is not mapped in this process"
    path = parts[5].strip() if len(parts) == 6 else ""
    if len(parts[1]) < 4 or parts[1][3] != "s" or not path.startswith("/"):
        return (
            "the L1 arena is anonymous or private memory (start LMCache's server with "
            "--shm-name NAME, and --no-l1-use-lazy where its L1 is lazily pinned)"
        )
    if path.endswith(" (deleted)"):
        return f"the L1 arena's file {path} was unlinked"
    lo, _, hi = parts[0].partition("-")
    if ptr + size > int(hi, 16):
        return f"the L1 arena spans more than one mapping of {path}"
    offset = ptr - int(lo, 16) + int(parts[2], 16)
    major, _, minor = parts[3].partition(":")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        return f"cannot open the L1 arena's file {path} ({exc.strerror})"
    st = os.fstat(fd)
    why = ""
    if not stat.S_ISREG(st.st_mode):
        why = f"{path} is not a regular file"
    elif (st.st_dev, st.st_ino) != (os.makedev(int(major, 16), int(minor, 16)), int(parts[4])):
        why = f"{path} is no longer the file the L1 arena maps"
    elif st.st_size < offset + size:
        why = f"{path} has {st.st_size} bytes, the L1 arena needs {offset + size}"
    if why:
        os.close(fd)
        return why
    stride = max(MIN_STRIDE, align)
    return L1File(fd, path, ptr, offset, size, stride)


@dataclass
class ArenaMapping:
    """One direction's mapping of the file for objects of ``object_bytes``."""

    object_bytes: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    mapping: MappingHandle | None = None
    # The server process that took the file for ``mapping`` (None: cannot be
    # watched): its exit proves its copies of this mapping ended (held.py).
    server: ProcessWatch | None = None


class Arena:
    """The L1 file and its mappings (per direction and object size); ``block`` says
    which objects it addresses. Each direction runs on one task thread, so a
    mapping is used by one thread at a time and its unproven transfers are that
    thread's own."""

    def __init__(self, file: L1File) -> None:
        self.file = file
        self._mappings: dict[tuple[str, int], ArenaMapping] = {}
        self._lock = threading.Lock()
        self.refused = ""  # why kvsvc refused the file: then staging only

    def block(self, address: int, size: int) -> int | None:
        """The block id of the object of ``size`` bytes at ``address``, or None
        when the arena does not address it (outside, or off the stride)."""
        f = self.file
        rel = address - f.base
        if rel < 0 or rel + size > f.size or (f.offset + rel) % f.stride:
            return None
        return (f.offset + rel) // f.stride

    def region(self, object_bytes: int, token: str) -> pb.RankRegion:
        f = self.file
        end = f.offset + f.size
        blocks = (end - object_bytes) // f.stride + 1
        return pb.RankRegion(
            context=rank_context(0, 1),
            tensors=[
                pb.KVTensor(
                    name="lmcache_l1",
                    handle=pb.MemoryHandle(
                        sealed_memfd=pb.SealedMemfdHandle(token=token, size_bytes=end)
                    ),
                    offset_bytes=0,
                    shape=[blocks, object_bytes],
                    strides=[f.stride, 1],
                    dtype=pb.DTYPE_UINT8,
                    block_dim=0,
                )
            ],
        )

    def entry(self, direction: str, object_bytes: int) -> ArenaMapping:
        with self._lock:
            key = (direction, object_bytes)
            found = self._mappings.get(key)
            if found is None:
                found = self._mappings[key] = ArenaMapping(object_bytes)
            return found

    def sizes(self, direction: str) -> set[int]:
        with self._lock:
            return {s for d, s in self._mappings if d == direction}

    def names(self) -> list[str]:
        with self._lock:
            return [f"{d}/{s}" for d, s in self._mappings]

    def forget(self) -> None:
        """After a kvsvc failure: every mapping is made again on the next use."""
        with self._lock:
            for m in self._mappings.values():
                m.mapping = None

    def mapped(
        self, entry: ArenaMapping, link: Link, namespace: str, timeout: float
    ) -> tuple[KVCacheClient, MappingHandle] | None:
        """The client and ``entry``'s mapping (made again after a kvsvc restart or
        an outage), or None while kvsvc counts as down or once it refused the file.
        Called under ``entry.lock``."""
        client = link.get()
        if client is None or self.refused:
            return None
        if entry.mapping is not None:
            return client, entry.mapping
        try:
            token = client.register_memfd(self.file.fd, shared_file=True, timeout=timeout)
            region = self.region(entry.object_bytes, token)
            entry.mapping = client.map(namespace, [region], timeout=timeout)
            entry.server = client.fd_server_watch()
        except (InvalidRequest, PermissionDenied, RegionUnavailable) as exc:
            # kvsvc will not take this file (fd passing off, another container's
            # view of it, ...): staging from now on, said once.
            self.refused = f"kvsvc refused the L1 file ({exc.reason}: {exc.message})"
            log.warning("kvsvc: %s; objects go through staging lanes", self.refused)
            return None
        except (KVServiceError, OSError) as exc:
            log.warning(
                "kvsvc: the L1 arena not mapped for %d-byte objects (%s: %s)",
                entry.object_bytes,
                type(exc).__name__,
                getattr(exc, "message", exc),
            )
            link.failed()
            return None
        log.info(
            "kvsvc: L1 arena %s mapped for %d-byte objects as %s",
            self.file.path,
            entry.object_bytes,
            entry.mapping.mapping_id,
        )
        return client, entry.mapping

    def close(self) -> None:
        os.close(self.file.fd)
