"""The staging path: "one copy per batch into a mapped region" (lanes.py), for an
L1 arena kvsvc cannot take (anonymous or pinned memory, no ``--shm-name``). A store
copies a piece of objects into a lane's slots and Stores them as blocks while the
next piece is copied; a load Retrieves into slots (kvsvc checks each chunk's
CRC-32C as it copies it) and copies the verified ones into LMCache's objects.
kvsvc never writes LMCache's memory here, so a task always completes by its
deadline: a copy whose end is not proven can only land in a slot, and its lane is
barred until a Fence proves it ended (or kvsvc restarted)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.errors import BoundedLog, KVServiceError, Miss
from kvsvc.integrations.common import Link
from kvsvc.integrations.lmcache.config import BACKSTOP_S, MAX_SKIPS, LmcacheAdapterConfig
from kvsvc.integrations.lmcache.keys import Namespaces, chunk_key
from kvsvc.integrations.lmcache.lanes import Lane, make_lane, mapped, object_bytes


class Host(Protocol):
    """What a data path uses of the adapter (adapter.py's KvsvcL2Adapter)."""

    cfg: LmcacheAdapterConfig
    link: Link
    namespaces: Namespaces
    warn: BoundedLog

    def _count(self, name: str, n: int = 1) -> None: ...
    def _failed(self, what: str, exc: BaseException | None) -> None: ...


class StagingPath:
    """The lanes (one per direction and object size, made on first use) and the
    transfers through them."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.lanes: dict[tuple[str, int], Lane] = {}
        self._lock = threading.Lock()

    def store(self, lane: Lane, ns: str, keys: list[Any], objects: list[Any]) -> list[bool]:
        """Per object, whether kvsvc holds it now: copied into the lane a piece at a
        time, each piece Stored while the next is copied."""
        out = [False] * len(keys)
        cfg = self.host.cfg
        deadline = time.monotonic() + cfg.store_timeout_s
        with lane.lock:
            got = mapped(lane, self.host.link, self.host.namespaces.staging(), cfg.fence_timeout_s)
            if got is None:
                return out
            client, mapping = got
            staged = lane.staging.tensor
            for r0 in range(0, len(keys), lane.slots):
                r1 = min(r0 + lane.slots, len(keys))
                pending: list[tuple[int, int, Future[Any], bool]] = []
                for a in range(r0, r1, lane.piece(cfg.piece_mib)):
                    b = min(a + lane.piece(cfg.piece_mib), r1)
                    chunks = []
                    for j in range(a, b):
                        src = object_bytes(objects[j])
                        if src is None or src.numel() != lane.object_bytes:
                            continue
                        staged[j - r0].copy_(src)
                        chunks.append((chunk_key(keys[j]), [j - r0]))
                    if not chunks:
                        continue
                    left = max(deadline - time.monotonic(), 0.001)
                    f = client.store_async(mapping, chunks, namespace=ns, timeout=left)
                    # A piece with an object that could not be staged is awaited
                    # (its copy reads the slots) but counts as failed.
                    pending.append((a, b, f, len(chunks) == b - a))
                errors = self._settle_stores(pending, out, deadline)
                if errors:
                    self._after_failure(lane, client, mapping, errors[0], "store")
                    break
        return out

    def _settle_stores(
        self,
        pending: list[tuple[int, int, Future[Any], bool]],
        out: list[bool],
        deadline: float,
    ) -> list[BaseException]:
        errors: list[BaseException] = []
        for a, b, f, whole in pending:
            try:
                r = f.result(max(deadline - time.monotonic(), 0) + BACKSTOP_S)
            except (KVServiceError, FutureTimeout) as exc:
                errors.append(exc)
                continue
            if whole and int(r.stored_chunks) + int(r.present_chunks) == b - a:
                out[a:b] = [True] * (b - a)
        return errors

    def load(self, lane: Lane, ns: str, keys: list[Any], objects: list[Any]) -> list[bool]:
        """Per object, whether it was loaded and verified: Retrieved into the lane's
        slots a piece at a time, the verified ones copied out into LMCache's object.
        A miss (or a chunk that failed its checksum) ends its piece; the objects
        after it are tried again, up to MAX_SKIPS times per task."""
        out = [False] * len(keys)
        cfg = self.host.cfg
        deadline = time.monotonic() + cfg.load_timeout_s
        targets = [object_bytes(o) for o in objects]
        todo = [
            j for j, t in enumerate(targets) if t is not None and t.numel() == lane.object_bytes
        ]
        skips = 0
        with lane.lock:
            got = mapped(lane, self.host.link, self.host.namespaces.staging(), cfg.fence_timeout_s)
            if got is None:
                return out
            client, mapping = got
            staged = lane.staging.tensor
            while todo and time.monotonic() < deadline:
                batch, todo = todo[: lane.slots], todo[lane.slots :]
                pending = []
                for a in range(0, len(batch), lane.piece(cfg.piece_mib)):
                    b = min(a + lane.piece(cfg.piece_mib), len(batch))
                    chunks = [(chunk_key(keys[batch[s]]), [s]) for s in range(a, b)]
                    left = max(deadline - time.monotonic(), 0.001)
                    f = client.retrieve_async(mapping, chunks, namespace=ns, timeout=left)
                    pending.append((a, b, f))
                errors: list[BaseException] = []
                retry: list[int] = []
                for a, b, f in pending:
                    try:
                        r = f.result(max(deadline - time.monotonic(), 0) + BACKSTOP_S)
                    except (KVServiceError, FutureTimeout) as exc:
                        errors.append(exc)
                        continue
                    n = min(int(r.loaded_chunks), b - a)
                    for s in range(a, a + n):
                        target = targets[batch[s]]
                        assert target is not None
                        target.copy_(staged[s])
                        out[batch[s]] = True
                    if a + n < b:
                        skips += 1
                        retry.extend(batch[a + n + 1 : b])
                if errors:
                    self._after_failure(lane, client, mapping, errors[0], "retrieve")
                    break
                if skips > MAX_SKIPS:
                    self.host._count("loads_cut_short")
                    break
                todo = retry + todo
        return out

    def lane(self, direction: str, size: int) -> Lane | None:
        lane = self.lanes.get((direction, size))
        if lane is not None:
            return lane
        sizes = {s for d, s in self.lanes if d == direction}
        if len(sizes) >= self.host.cfg.max_object_sizes or size <= 0:
            self.host._count("objects_of_unstaged_size")
            self.host.warn.warning(
                "kvsvc: objects of %d bytes: %s lanes exist for %d sizes already "
                "(max_object_sizes): failed stores, misses",
                size,
                direction,
                len(sizes),
            )
            return None
        lane = make_lane(direction, size, self.host.cfg.staging_mib << 20)
        with self._lock:
            self.lanes[(direction, size)] = lane
        return lane

    def _after_failure(
        self,
        lane: Lane,
        client: KVCacheClient,
        mapping: MappingHandle,
        exc: BaseException,
        what: str,
    ) -> None:
        """After a failed transfer: bar the lane while a copy of it may still run (a
        Fence lifts the bar), else count kvsvc as down; a plain miss counts as nothing."""
        ids = client.unproven_transfers(mapping)
        if ids or isinstance(exc, FutureTimeout):
            lane.bar(mapping, ids)
            self.host._count("lanes_barred")
            self.host._failed(f"{what} (unproven: lane {lane.name} barred until a Fence)", exc)
        elif not isinstance(exc, Miss):
            lane.mapping = None
            self.host._failed(what, exc)
