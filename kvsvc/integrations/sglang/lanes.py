"""The staging lanes of SGLang's HiCache storage backend: per direction ("get",
"set") a sealed-memfd staging region (kvsvc.integrations.sglang.pages), the lock
that orders its batches, its mapping in kvsvc, and the bar a transfer of unproven
end leaves on it. Reads and writes each have a lane, so SGLang's prefetch thread
never waits on its backup thread (nor the reverse)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.integrations.sglang.pages import HostPages, Staging, make_staging
from kvsvc.v1 import kv_cache_service_pb2 as pb

DIRECTIONS = ("get", "set")


@dataclass
class Lane:
    """One direction's staging region, its mapping and the lock that orders its
    batches."""

    name: str
    staging: Staging
    lock: threading.Lock = field(default_factory=threading.Lock)
    mapping: MappingHandle | None = None
    # A server start whose late copies may still land in the staging region, and
    # the ids of those transfers (a Fence of them lifts the bar).
    barred_start: str = ""
    barred_ids: list[str] = field(default_factory=list)

    def map(self, client: KVCacheClient, namespace: str, timeout: float) -> MappingHandle:
        """Map the staging region in kvsvc (again, after a restart or an outage);
        KVServiceError or OSError when it cannot be. Under ``lock``."""
        info = client.server_info(timeout=timeout)
        if self.barred_start and info.server_start_id == self.barred_start:
            # Same server start: a copy of ours may still run; only a Fence of
            # those transfer ids proves it ended.
            client.fence(None, self.barred_ids, timeout=timeout)
        self.barred_start, self.barred_ids = "", []
        token = client.register_memfd(self.staging.fd, timeout=timeout)
        region = pb.RankRegion()
        region.CopyFrom(self.staging.region)
        for t in region.tensors:
            t.handle.sealed_memfd.token = token
        self.mapping = client.map(namespace, [region], timeout=timeout)
        return self.mapping

    def bar(self, mapping: MappingHandle, ids: list[str]) -> None:
        """A transfer failed without proof that its copy ended: the staging region
        is barred for this server start until a Fence of ``ids`` proves it."""
        self.barred_start = mapping.server_start_id
        self.barred_ids = sorted(set(self.barred_ids) | set(ids))


def make_lanes(pages: HostPages, pages_per_batch: int, rank: int, tp: int) -> dict[str, Lane]:
    """A lane per direction, each staging ``pages_per_batch`` pages."""
    return {
        name: Lane(
            name,
            make_staging(
                f"kvsvc-sglang-{name}-tp{rank}", pages.page_bytes, pages_per_batch, rank, tp
            ),
        )
        for name in DIRECTIONS
    }
