"""The engine's side: the sync and asyncio clients (one call table, two faces),
the Session stream, leases, fd passing and the engine-side shared KV cache.
Never imports ``kvsvc.server``; ``SharedKVCache`` (torch) loads on first use, so
importing the client loads no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvsvc.client.clients import AsyncKVCacheClient, KVCacheClient
from kvsvc.client.plans import DEFAULT, MappingHandle
from kvsvc.client.tls import ClientTLS

if TYPE_CHECKING:
    from kvsvc.client.kvcache import SharedKVCache

__all__ = [
    "DEFAULT",
    "AsyncKVCacheClient",
    "ClientTLS",
    "KVCacheClient",
    "MappingHandle",
    "SharedKVCache",
]


def __getattr__(name: str) -> Any:
    if name == "SharedKVCache":
        from kvsvc.client.kvcache import SharedKVCache

        return SharedKVCache
    raise AttributeError(f"module 'kvsvc.client' has no attribute {name!r}")
