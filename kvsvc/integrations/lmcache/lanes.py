"""Staging regions for LMCache's L1 objects: "one copy per batch into a mapped
region". LMCache's L1 arena is its own memory (pinned or anonymous, or a POSIX shm
file its owner can shrink), which kvsvc's server does not map; so each direction
and object size has a ``Lane``: a sealed memfd of whole-object slots that kvsvc
maps once per server start (SGLang's staging region, ``make_staging``). A store
copies a piece of objects into slots and Stores them as blocks; a load Retrieves
into slots and copies the verified ones out. kvsvc never writes LMCache's memory,
so a late copy can only land in a slot, and a slot a copy may still write is
barred until a Fence proves the copy ended."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.errors import KVServiceError
from kvsvc.integrations.common import Link
from kvsvc.integrations.sglang.pages import Staging, make_staging
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger("kvsvc.lmcache")


@dataclass
class Lane:
    """One direction's staging region for objects of ``object_bytes``, its mapping
    (per kvsvc server start) and the transfers that bar it. Used by one task thread
    at a time (``lock``): store and load lanes never wait on each other."""

    name: str
    staging: Staging
    lock: threading.Lock = field(default_factory=threading.Lock)
    mapping: MappingHandle | None = None
    # A server start whose late copies may still land in the region, and the ids
    # of those transfers: a Fence of them, or another server start, lifts the bar.
    barred: MappingHandle | None = None
    barred_ids: list[str] = field(default_factory=list)

    @property
    def slots(self) -> int:
        return self.staging.capacity

    @property
    def object_bytes(self) -> int:
        return self.staging.page_bytes

    def piece(self, piece_mib: int) -> int:
        """Objects per Store/Retrieve: ``piece_mib`` MiB of them, at least one."""
        return max(1, min(self.slots, (piece_mib << 20) // self.object_bytes))

    def bar(self, mapping: MappingHandle, ids: list[str]) -> None:
        self.barred = mapping
        self.barred_ids = sorted(set(self.barred_ids) | set(ids))
        self.mapping = None

    def close(self) -> None:
        with self.lock:
            self.staging.close()


def object_bytes(obj: Any) -> torch.Tensor | None:
    """The object's logical bytes as a flat uint8 view of LMCache's own memory, or
    None when it has none in host memory (an invalidated object, a device one)."""
    try:
        raw = obj.raw_tensor
        size = int(obj.get_size())
    except Exception:  # noqa: BLE001 - an object LMCache cannot describe: skipped
        return None
    if not isinstance(raw, torch.Tensor) or raw.device.type != "cpu" or not raw.is_contiguous():
        return None
    flat = raw.reshape(-1).view(torch.uint8)
    return flat[:size] if 0 < size <= flat.numel() else None


def make_lane(direction: str, object_bytes: int, budget_bytes: int) -> Lane:
    """A lane of as many whole objects as ``budget_bytes`` holds (at least one)."""
    slots = max(1, budget_bytes // object_bytes)
    name = f"kvsvc-lmcache-{direction}-{object_bytes}"
    return Lane(f"{direction}/{object_bytes}", make_staging(name, object_bytes, slots, 0, 1))


def mapped(
    lane: Lane, link: Link, namespace: str, timeout: float
) -> tuple[KVCacheClient, MappingHandle] | None:
    """The client and the lane's mapping (made again after a kvsvc restart or an
    outage), or None while kvsvc counts as down, or while a copy into the lane may
    still run on the same server start and no Fence proves it ended. Called under
    ``lane.lock``; bounded by ``timeout`` per call."""
    client = link.get()
    if client is None:
        return None
    if lane.mapping is not None:
        return client, lane.mapping
    try:
        info = client.server_info(timeout=timeout)
        barred = lane.barred
        if barred is not None and info.server_start_id == barred.server_start_id:
            # Same server start: a copy of ours may still run; only a Fence (of those
            # transfers, else of the whole mapping) proves it ended.
            client.fence(None if lane.barred_ids else barred, lane.barred_ids, timeout=timeout)
            log.info("kvsvc: lane %s fenced: its staging region is free again", lane.name)
        lane.barred, lane.barred_ids = None, []
        token = client.register_memfd(lane.staging.fd, timeout=timeout)
        region = pb.RankRegion()
        region.CopyFrom(lane.staging.region)
        for t in region.tensors:
            t.handle.sealed_memfd.token = token
        lane.mapping = client.map(namespace, [region], timeout=timeout)
    except (KVServiceError, OSError) as exc:
        log.warning(
            "kvsvc: lane %s not mapped (%s: %s)",
            lane.name,
            type(exc).__name__,
            getattr(exc, "message", exc),
        )
        link.failed()
        return None
    log.info("kvsvc: staging lane %s mapped as %s", lane.name, lane.mapping.mapping_id)
    return client, lane.mapping


def close_lanes(lanes: list[Lane]) -> None:
    for lane in lanes:
        with contextlib.suppress(Exception):
            lane.close()
