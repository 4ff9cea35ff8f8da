"""The engine's side: the sync and asyncio clients (one call table, two faces),
the Session stream, leases, fd passing and the engine-side shared KV cache.
Never imports ``kvsvc.server``."""

from kvsvc.client.calls import DEFAULT, MappingHandle
from kvsvc.client.clients import AsyncKVCacheClient, KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.client.tls import ClientTLS

__all__ = [
    "DEFAULT",
    "AsyncKVCacheClient",
    "ClientTLS",
    "KVCacheClient",
    "MappingHandle",
    "SharedKVCache",
]
