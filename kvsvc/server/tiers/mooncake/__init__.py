"""The Mooncake tier: chunks shared across nodes through Mooncake Store (the
distributed memory pool of SGLang HiCache, vLLM, LMCache and Dynamo), below the
local tiers and best-effort by design: a failure is a miss or a skipped write
and a counter, never an error, a hang or a health change. Its client is
``mooncake.store`` (the ``mooncake`` extra); every call into it runs on the
tier's own threads, bounded (kvsvc's deadline, not Mooncake's).

One job per module:

- ``tier``: MooncakeTier, what the chain calls (Lookup, Retrieve, DropNamespace), its life.
- ``reads``: Retrieve's reads, straight into the chunks reserved for them.
- ``writer``: the write-behind (a bounded queue, a writer thread, batched puts);
  what this server knows Mooncake holds.
- ``gate``: the threads, deadlines, breaker and counters every call passes.
- ``client``: the Mooncake client and its set-up, the registered header slots,
  what each Mooncake code means.
- ``values``: key names and the self-verifying value format (the S3 tier's).
- ``metrics``: its Prometheus series.
"""

from __future__ import annotations

from kvsvc.server.tiers.mooncake.tier import MooncakeTier

__all__ = ["MooncakeTier"]
