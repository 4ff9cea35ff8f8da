"""Opening and holding an engine's memory: a shared-memory file under --shm-dir,
a sealed memfd passed over the fd socket, a plain shared file passed by fd, or a
CUDA allocation from its IPC handle. Regions only open, check and release memory
and move one byte range; copy plans and checksums are kvsvc.server.data.copies',
tensor layouts kvsvc.layout's.

Shared-memory files under --shm-dir are copied with ``preadv``/``pwritev`` on the
file, not through ``mmap``: a client that truncates its file then causes a short
read (a typed error), never a SIGBUS that would kill the server. Sealed memfds
(kvsvc.client.fdpass) cannot shrink, so they are mapped and copied with memcpy
(``ctypes.memmove``, which releases the GIL and costs ~1 µs a call where a
torch slice copy costs several: runs are as small as one block of one layer).

A plain shared file passed by fd (``PassedFileRegion``: LMCache's L1 arena on the
adapter's direct path, vLLM's /dev/shm offload file) is mapped too, and the native
copy loop copies it like a memfd, inside a guarded copy: a SIGBUS from a page its
owner truncated away is caught on the copying thread and becomes that copy's
REGION_TRUNCATED (native/copyloop.c, "Guarded copies"). Why not positional I/O
there as well: measured (benchmarks.lmcache_l2 --total-mib 256 --rounds 100
--repeat 3, 2-core VM), kvsvc's Retrieve wrote the arena's file with ``pwritev``,
a 1 MiB segment at a time from Python and the CRC-32C in a second pass, at
2.8 / 3.0 GB/s (2 / 32 MiB objects) against 7.1 / 15.2 GB/s into a sealed memfd
(mapped, native loop, CRC folded into the copy). Without the native loop (or
with a build that has no guarded copy) the file is still copied with positional
I/O.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import torch

from kvsvc.errors import InvalidRequest, PermissionDenied, RegionUnavailable
from kvsvc.layout import (
    HandleKey,
    HandleKind,
    TensorLayout,
    handle_identity,
    layout_fingerprint,
    no_cuda,
    parse_rank,
    rank_label,
    rank_metadata,
)
from kvsvc.server.data.fdbroker import FdBroker, Owner
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: The default trust of name-based regions: files of the server's own uid only.
SELF_ONLY = frozenset({os.geteuid()})


def safe_shm_path(shm_dir: str, name: str) -> str:
    """A plain file name inside ``shm_dir``; anything that could escape it is refused."""
    if (
        not name
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name in (".", "..")
        or len(name) > 255
    ):
        raise _bad_name(name, "must be a plain file name inside the shm dir")
    return os.path.join(shm_dir, name)


def _bad_name(name: str, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"shared-memory name {name[:255]!r} {why}",
        reason="INVALID_REGION_NAME",
        metadata={"name": name[:255]},
    )


def _untrusted(name: str, why: str) -> PermissionDenied:
    """Refused because the server would use its own rights on a file it cannot tie
    to the caller: no owner, mode or link count is echoed back (nothing about a
    file the caller may not see)."""
    return PermissionDenied(
        f"shared-memory region {name!r} is refused: {why}",
        reason="REGION_NOT_TRUSTED",
        metadata={"name": name},
    )


def open_trusted(shm_dir: str, name: str, owners: frozenset[int] | None) -> int:
    """An ``O_RDWR`` fd of ``shm_dir/name``, opened only if it is safe to use with the
    server's rights on a client's behalf: a regular file (not a symlink, FIFO, device
    or directory), with one link (no hard link to a file elsewhere), owned by a uid in
    ``owners`` (None: names are off) and writable by its owner only.

    The name is first opened ``O_PATH | O_NOFOLLOW`` (no side effect on a FIFO or a
    device), checked with ``fstat``, then re-opened through that very fd, so the file
    checked is the file used even if the name is swapped in between."""
    path = safe_shm_path(shm_dir, name)
    if owners is None:
        raise _untrusted(name, "this server maps no memory by name (--shm-uids off); pass a memfd")
    pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(pfd)
        if stat.S_ISLNK(st.st_mode):
            raise _bad_name(name, "is a symbolic link; it is refused")
        if not stat.S_ISREG(st.st_mode):
            raise _bad_name(name, "is not a regular file")
        if st.st_nlink != 1:
            raise _untrusted(name, "a file with more than one link (a hard link) is not mapped")
        if st.st_uid not in owners:
            raise _untrusted(name, "its owner is not a uid this server maps files of (--shm-uids)")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise _untrusted(name, "it is writable by its group or others")
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDWR | os.O_CLOEXEC)
    finally:
        os.close(pfd)
    again = os.fstat(fd)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):  # pragma: no cover - kernel
        os.close(fd)
        raise _untrusted(name, "it changed while it was opened")
    return fd


class ShmRegion:
    """A client's file under --shm-dir, accessed only by positional read/write."""

    device = torch.device("cpu")

    def __init__(
        self, shm_dir: str, name: str, need_bytes: int, owners: frozenset[int] | None
    ) -> None:
        path = safe_shm_path(shm_dir, name)
        fd = open_trusted(shm_dir, name, owners)
        try:
            st = os.fstat(fd)
            if st.st_size < need_bytes:
                raise RegionUnavailable(
                    f"shared-memory region {name!r} has {st.st_size} bytes, "
                    f"its tensors need {need_bytes}",
                    reason="REGION_TOO_SMALL",
                    metadata={"name": name, "sizeBytes": st.st_size, "needBytes": need_bytes},
                )
        except BaseException:
            os.close(fd)
            raise
        self.name = name
        self.path = path
        self.fd = fd
        self.size = need_bytes
        self.inode = (st.st_dev, st.st_ino)

    def is_current(self) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    def read(self, offset: int, buf: memoryview, addr: int, a: int, b: int) -> None:
        """Region bytes from ``offset`` into ``buf[a:b]``."""
        dst = buf[a:b]
        done = 0
        while done < len(dst):
            n = os.preadv(self.fd, [dst[done:]], offset + done)
            if n <= 0:
                raise self._truncated(offset + done)
            done += n

    def write(self, offset: int, buf: memoryview, addr: int, a: int, b: int) -> None:
        """``buf[a:b]`` into the region at ``offset``; the caller brackets its writes
        with :meth:`check_size` (``pwritev`` past the end would extend the file)."""
        src = buf[a:b]
        done = 0
        while done < len(src):
            n = os.pwritev(self.fd, [src[done:]], offset + done)
            if n <= 0:
                raise self._truncated(offset + done)
            done += n

    def check_size(self) -> None:
        """REGION_TRUNCATED if the file is now shorter than the mapping needs.

        Writing never re-grows a file its owner truncated: writes are checked
        before (so none lands past the end) and after (see below). Plain files
        cannot be sealed against shrinking, so a truncate can still land between
        the first check and a ``pwritev``, which then extends the file to the end
        of that write; the check after the writes sees the file shorter than the
        mapping needs and fails the call. What stays open: when the last write of
        that span ends at the mapping's last byte, the file is re-grown unseen,
        to exactly its mapped size (holes read as zeros). Sealed memfd regions
        have no such window. One fstat per checksum segment, not per run: it
        costs about as much as a small run's copy."""
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise self._truncated(size)

    def _truncated(self, at: int) -> RegionUnavailable:
        return RegionUnavailable(
            f"shared-memory region {self.name!r} ends before byte {at}: "
            "its owner truncated it after Map",
            reason="REGION_TRUNCATED",
            metadata={"name": self.name, "offset": at},
        )

    def synchronize(self) -> None:
        """File copies are synchronous; nothing is left in flight."""

    def close(self) -> None:
        os.close(self.fd)


class PassedFileRegion(ShmRegion):
    """A plain shared-memory file a client passed by fd (``FILE_LEASE_MAGIC``: it
    cannot be sealed, e.g. LMCache's L1 arena, vLLM's /dev/shm offload file), current
    while its owner's lease is. Mapped (``base``) for the native loop's guarded
    copies, which turn a SIGBUS from a truncated page into REGION_TRUNCATED; the
    Python loop copies it with positional I/O like a file under --shm-dir.

    Both paths bracket a copy with :meth:`check_size` (after it, and before a
    write). A mapped write cannot extend the file at all (a page past the end
    faults: the copy fails as truncated), so the re-grow window ``pwritev`` leaves
    (see ShmRegion.check_size) does not exist on the mapped path; the check after
    the copy catches a truncate inside the last page, whose bytes past the end read
    as zeros and are written nowhere instead of faulting."""

    def __init__(self, fd: int, token: str, need_bytes: int, owner: Owner | None) -> None:
        self.name = f"memfd {token[:12]}"
        self.path = ""
        self.fd = fd
        self.size = need_bytes
        self.owner = owner
        self.mm: mmap.mmap | None = None
        self._anchor: ctypes.c_char | None = None
        #: the mapping's address, or None where it could not be mapped (positional I/O)
        self.base: int | None = None
        try:
            self.mm = mmap.mmap(fd, need_bytes)
        except (OSError, ValueError):
            return
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)

    def is_current(self) -> bool:
        return self.owner is None or not self.owner.gone()

    def close(self) -> None:
        self._anchor = None
        if self.mm is not None:
            self.mm.close()
        os.close(self.fd)
        if self.owner is not None:
            self.owner.close()
            self.owner = None


def open_passed(fds: FdBroker | None, token: str, need_bytes: int) -> MemfdRegion | ShmRegion:
    """The region of a passed fd: a MemfdRegion if it is sealed against shrinking
    (the kernel says so, whatever the client claimed), else a PassedFileRegion."""
    if fds is None:
        raise InvalidRequest(
            "this server runs with --fd-socket off: sealed memfd handles are refused",
            reason="FD_PASSING_DISABLED",
        )
    fd, size, owner = fds.open(token)  # owner: its lease, or a pidfd of it
    try:
        if size < need_bytes:
            raise InvalidRequest(
                f"memfd {token[:12]!r} has {size} bytes, its tensors declare {need_bytes}",
                reason="REGION_TOO_SMALL",
                metadata={"token": token[:12], "sizeBytes": size, "needBytes": need_bytes},
            )
        try:
            sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        except OSError:  # EINVAL: not a shmem file
            sealed = 0
        if not sealed:
            return PassedFileRegion(fd, token, need_bytes, owner)
        region = MemfdRegion(fd, need_bytes, owner)
    except BaseException:
        os.close(fd)
        if owner is not None:
            owner.close()
        raise
    os.close(fd)  # the mapping keeps the memfd alive
    return region


class MemfdRegion:
    """A client's sealed memfd, mapped: it cannot shrink, so memcpy is safe. Copies
    stay inside the mapping because every tensor was checked to end within
    ``need_bytes``, and the mapping is released only after its copies are fenced."""

    device = torch.device("cpu")

    def __init__(self, fd: int, need_bytes: int, owner: Owner | None) -> None:
        """Maps ``fd`` (checked by open_passed, which closes it)."""
        self.owner = owner
        self.mm = mmap.mmap(fd, need_bytes)
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self.size = need_bytes

    def read(self, offset: int, buf: memoryview, addr: int, a: int, b: int) -> None:
        """Region bytes from ``offset`` into ``buf[a:b]`` (``buf`` is at ``addr``)."""
        ctypes.memmove(addr + a, self.base + offset, b - a)

    def write(self, offset: int, buf: memoryview, addr: int, a: int, b: int) -> None:
        """``buf[a:b]`` into the region at ``offset``."""
        ctypes.memmove(self.base + offset, addr + a, b - a)

    def is_current(self) -> bool:
        """False once the engine that passed the memfd is gone: its lease connection
        closed, or (one-shot passes) its process exited."""
        return self.owner is None or not self.owner.gone()

    def synchronize(self) -> None:
        """memcpy is synchronous; nothing is left in flight."""

    def close(self) -> None:
        self._anchor = None
        self.mm.close()
        if self.owner is not None:
            self.owner.close()
            self.owner = None


def cuda_device_for_uuid(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RegionUnavailable(
        f"no visible CUDA device has uuid {uuid}",
        reason="DEVICE_NOT_FOUND",
        metadata={"deviceUuid": uuid},
    )


class CudaRegion:
    """A CUDA allocation opened from torch's IPC handle on the matching device."""

    def __init__(self, h: pb.CudaIpcHandle, need_bytes: int) -> None:
        if not torch.cuda.is_available():
            raise no_cuda({})
        index = cuda_device_for_uuid(h.device_uuid)
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(self.device)
        self.storage = torch.UntypedStorage._new_shared_cuda(
            index,
            h.ipc_handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle or None,
            h.event_sync_required,
        )
        if self.storage.nbytes() < need_bytes:
            raise RegionUnavailable(
                f"CUDA region has {self.storage.nbytes()} bytes, its tensors need {need_bytes}",
                reason="REGION_TOO_SMALL",
                metadata={"sizeBytes": self.storage.nbytes(), "needBytes": need_bytes},
            )
        self.stream = torch.cuda.Stream(device=self.device)
        self.size = need_bytes
        torch.cuda.synchronize(self.device)

    def view(self, t: TensorLayout) -> torch.Tensor:
        base = torch.empty(0, dtype=getattr(torch, t.dtype_name), device=self.device)
        return base.set_(self.storage, t.offset // t.elsize, t.shape, t.strides)

    def synchronize(self) -> None:
        torch.cuda.set_device(self.device)
        self.stream.synchronize()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.synchronize()
        del self.storage


Region = ShmRegion | MemfdRegion | CudaRegion
HostRegion = ShmRegion | MemfdRegion


@dataclass
class RankMapping:
    context: pb.RankContext
    tensors: list[TensorLayout]
    regions: dict[HandleKey, Region]

    def close(self) -> None:
        for region in self.regions.values():
            region.close()


def open_rank(
    rank: pb.RankRegion,
    index: int,
    shm_dir: str,
    fds: FdBroker | None = None,
    owners: frozenset[int] | None = SELF_ONLY,
) -> RankMapping:
    """Validate and open one rank's regions (all or none); raises with the rank named.
    ``owners``: the uids whose files may be mapped by name (see open_trusted)."""
    tensors = parse_rank(rank, index, cuda=torch.cuda.is_available())
    need: dict[HandleKey, tuple[int, pb.MemoryHandle]] = {}
    for t in rank.tensors:
        key, declared = handle_identity(t.handle)
        need[key] = (max(need.get(key, (0, t.handle))[0], declared), t.handle)
    regions: dict[HandleKey, Region] = {}
    try:
        for key, (nbytes, handle) in need.items():
            regions[key] = _open_region(key, handle, nbytes, shm_dir, fds, owners)
    except BaseException:
        for region in regions.values():
            region.close()
        raise
    return RankMapping(rank.context, tensors, regions)


def check_ranks_agree(ranks: list[RankMapping]) -> None:
    """One mapping is one memory kind and one number of blocks; the first rank that
    differs from ranks[0] is named like every other rank error."""
    first = ranks[0]
    first_cuda = any(isinstance(r, CudaRegion) for r in first.regions.values())
    first_blocks = first.tensors[0].num_blocks
    for index, rank in enumerate(ranks[1:], start=1):
        label, context = rank_label(rank.context, index), rank_metadata(rank.context, index)
        if any(isinstance(r, CudaRegion) for r in rank.regions.values()) != first_cuda:
            raise InvalidRequest(
                f"{label}: a mapping's ranks must all be shared memory or all CUDA, "
                f"and {rank_label(first.context, 0)} is not of the same kind",
                reason="MIXED_REGION_KINDS",
                metadata=context,
            )
        if rank.tensors[0].num_blocks != first_blocks:
            raise InvalidRequest(
                f"{label}: ranks disagree on the number of blocks: {rank.tensors[0].num_blocks} "
                f"here, {first_blocks} in {rank_label(first.context, 0)}",
                reason="RANK_BLOCKS_DISAGREE",
                metadata={
                    **context,
                    "numBlocks": rank.tensors[0].num_blocks,
                    "expectedBlocks": first_blocks,
                },
            )


def _open_region(
    key: HandleKey,
    handle: pb.MemoryHandle,
    nbytes: int,
    shm_dir: str,
    fds: FdBroker | None,
    owners: frozenset[int] | None,
) -> Region:
    if key.kind is HandleKind.SHM:
        return ShmRegion(shm_dir, key.ident, nbytes, owners)
    if key.kind is HandleKind.MEMFD:
        return open_passed(fds, key.ident, nbytes)
    return CudaRegion(handle.cuda_ipc, nbytes)


@dataclass
class Mapping:
    """One engine's mapped ranks: the unit Store/Retrieve copy blocks of."""

    mapping_id: str
    namespace: str
    descriptor: bytes  # the MapRequest's ranks, to make re-mapping idempotent
    ranks: list[RankMapping]
    num_blocks: int
    block_bytes: int
    fingerprint: str
    closing: bool = False
    #: kvsvc.server.data.copies' copy plans of this mapping by block ids: they die with it.
    plans: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False, compare=False)
    #: the tenant (kvsvc.server.security.auth) that mapped it: no other sees it
    tenant: str = "default"

    @classmethod
    def of(
        cls, mapping_id: str, namespace: str, descriptor: bytes, ranks: list[RankMapping]
    ) -> Mapping:
        """The mapping of opened ranks that agree (see check_ranks_agree)."""
        check_ranks_agree(ranks)
        return cls(
            mapping_id=mapping_id,
            namespace=namespace,
            descriptor=descriptor,
            ranks=ranks,
            num_blocks=ranks[0].tensors[0].num_blocks,
            block_bytes=sum(t.block_bytes for r in ranks for t in r.tensors),
            fingerprint=layout_fingerprint([(r.context, r.tensors) for r in ranks]),
        )

    def is_current(self) -> bool:
        """Every shm region's name still names the file we hold open (a restarted
        client may have made a new file under the same name), and every memfd's
        owner is still running."""
        for rank in self.ranks:
            for region in rank.regions.values():
                if isinstance(region, (ShmRegion, MemfdRegion)) and not region.is_current():
                    return False
        return True

    def owner_gone(self) -> bool:
        """Whether an engine that passed one of its memfds is gone: then nobody can
        use this mapping again, and holding it keeps dead KV memory alive."""
        return any(
            isinstance(region, (MemfdRegion, PassedFileRegion)) and not region.is_current()
            for rank in self.ranks
            for region in rank.regions.values()
        )

    @functools.cached_property
    def memfds(self) -> int:
        """Passed memfds this mapping holds (a tenant's fd quota counts them)."""
        passed = (MemfdRegion, PassedFileRegion)
        return sum(isinstance(r, passed) for rm in self.ranks for r in rm.regions.values())

    @functools.cached_property
    def memfd_only(self) -> bool:
        """Every region is a sealed memfd: copies are memcpy of memory that cannot shrink."""
        return all(isinstance(r, MemfdRegion) for rm in self.ranks for r in rm.regions.values())

    @functools.cached_property
    def is_cuda(self) -> bool:
        return any(isinstance(r, CudaRegion) for rm in self.ranks for r in rm.regions.values())

    def check_blocks(self, block_ids: list[int], chunk_index: int) -> None:
        if not block_ids:
            raise InvalidRequest(
                f"chunk {chunk_index} lists no blocks", metadata={"chunkIndex": chunk_index}
            )
        for b in block_ids:
            if b >= self.num_blocks:
                raise InvalidRequest(
                    f"chunk {chunk_index}: block id {b} out of range [0, {self.num_blocks})",
                    reason="BLOCK_OUT_OF_RANGE",
                    metadata={
                        "chunkIndex": chunk_index,
                        "blockId": b,
                        "numBlocks": self.num_blocks,
                    },
                )

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()

    def synchronize(self) -> None:
        for rank in self.ranks:
            for region in rank.regions.values():
                region.synchronize()
