"""The LMCache L2 adapter's settings: the keys of ``adapter_params`` in the
server's ``--l2-adapter '{"type": "plugin", ..., "adapter_params": {...}}'`` (the
same names as the vLLM and SGLang plug-ins'), else ``KVSVC_LMCACHE_<KEY>``
environment variables, else these defaults. Engine-free: loads without LMCache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsvc.integrations.common import ConnectionSettings, parse_settings


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

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> LmcacheAdapterConfig:
        return parse_settings(cls, params, "KVSVC_LMCACHE_", "--l2-adapter adapter_params")
