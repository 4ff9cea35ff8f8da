"""The LMCache L2 adapter's settings: the keys of ``adapter_params`` in the
server's ``--l2-adapter '{"type": "plugin", ..., "adapter_params": {...}}'`` (the
same names as the vLLM and SGLang plug-ins'), else ``KVSVC_LMCACHE_<KEY>``
environment variables, else these defaults. Engine-free: loads without LMCache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsvc.integrations.common import ConnectionSettings, parse_settings

# How long past a task's own deadline a kvsvc future may take before it counts as
# unproven: every kvsvc future ends by its deadline, so this is only a backstop.
BACKSTOP_S = 1.0
# Objects a load skips (a miss or a chunk that failed its checksum) before it
# gives up on the rest of the task: each skip costs one more Retrieve.
MAX_SKIPS = 8


@dataclass(frozen=True)
class LmcacheAdapterConfig(ConnectionSettings):
    """What ``KvsvcL2Adapter`` reads from ``adapter_params`` (the connection keys are
    kvsvc.integrations.common.ConnectionSettings'); ``namespace`` is the tenant
    prefix: each LMCache model and cache salt gets its own namespace under it."""

    namespace: str = "lmcache"
    # Each staging region (one per direction and object size) holds this many MiB
    # of objects, at least one: a batch larger than that goes in several rounds.
    staging_mib: int = 256
    # MiB per Store/Retrieve inside a round (at least one object): the copy into
    # (or out of) the staging region of one piece overlaps kvsvc's copy of another.
    piece_mib: int = 8
    # Object sizes with a staging region of their own; an object of yet another
    # size is a failed store / a miss (said once), never an unbounded allocation.
    max_object_sizes: int = 4
    # Copy LMCache's L1 objects in place where its L1 arena is a shared file
    # (``--shm-name``): kvsvc's server reads and writes them, one copy; False
    # keeps the staging lanes whatever LMCache's L1 is.
    l1_direct: bool = True

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> LmcacheAdapterConfig:
        return parse_settings(cls, params, "KVSVC_LMCACHE_", "--l2-adapter adapter_params")
