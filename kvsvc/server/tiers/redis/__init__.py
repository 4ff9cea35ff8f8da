"""The remote tier: chunks shared across nodes through Redis / Valkey (standalone
or Redis Cluster), behind the local store and best-effort by design. Redis is
never part of the contract: a failure is a miss and a counter, never an error, a
hang or a health change.

One job per module:

- ``tier``: RemoteTier, what the servicer calls, and its life (start, close).
- ``writer``: write-behind after a Store (a bounded queue, writer threads).
- ``fetch``: Retrieve's pipelined GET, copied into the store by groups.
- ``lookup``: Lookup's pipelined EXISTS on the event loop; ``links``: the
  connections it keeps (redis-py's packer, hiredis' reader, a callback).
- ``connection``: the clients, their settings (URL, TLS, password, timeouts, no
  retries) and the gate every exchange passes; the tier's counters; Retrieve's
  GET replies read off the socket (``Replies``).
- ``health``: error kinds, the circuit breaker, DNS on its own thread.
- ``values``: the self-verifying value format (header, parts, checksums).

Inside this package ``import redis`` is redis-py (absolute imports).
"""

from __future__ import annotations

from kvsvc.server.tiers.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from kvsvc.server.tiers.redis.connection import reuse_freed_memory, value_connection_settings
from kvsvc.server.tiers.redis.health import (
    AUTH,
    BREAKER_OPEN,
    BUSY,
    CONNECTION,
    DNS,
    OTHER,
    RESPONSE,
    TIMEOUT,
    TLS,
    Resolver,
    error_kind,
)
from kvsvc.server.tiers.redis.tier import RemoteTier
from kvsvc.server.tiers.redis.values import (
    BAD_CHECKSUM,
    BAD_HEADER,
    FORMAT_VERSION,
    MAGIC,
    MISSING_PART,
    OTHER_LAYOUT,
    Rejected,
    Staging,
    Value,
    encode,
    header_bytes,
    load_into,
    parse_head,
    redis_key,
    redis_keys,
)

__all__ = [
    "AUTH",
    "BAD_CHECKSUM",
    "BAD_HEADER",
    "BREAKER_OPEN",
    "BUSY",
    "CLOSED",
    "CONNECTION",
    "DNS",
    "FORMAT_VERSION",
    "HALF_OPEN",
    "MAGIC",
    "MISSING_PART",
    "OPEN",
    "OTHER",
    "OTHER_LAYOUT",
    "RESPONSE",
    "TIMEOUT",
    "TLS",
    "Breaker",
    "Rejected",
    "RemoteTier",
    "Resolver",
    "Staging",
    "Value",
    "encode",
    "error_kind",
    "header_bytes",
    "load_into",
    "parse_head",
    "redis_key",
    "redis_keys",
    "reuse_freed_memory",
    "value_connection_settings",
]
