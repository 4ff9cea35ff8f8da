"""The S3 tier: chunks shared across nodes through S3-compatible object storage
(AWS S3, SeaweedFS, MinIO, Ceph RGW...), below the local tiers and best-effort by
design: a failure is a miss or a skipped write and a counter, never an error, a
hang or a health change. boto3 is its client (the ``s3`` extra).

One job per module:

- ``tier``: S3Tier, what the chain calls (Lookup, Retrieve, DropNamespace), its life.
- ``reads``: Retrieve's GETs, read straight into the chunks reserved for them.
- ``writer``: the write-behind (a bounded queue, writer threads, one PUT a chunk).
- ``endpoint``: the client behind the breaker, the counters, what the bucket holds
  as far as this server knows.
- ``client``: boto3's client and credentials, error kinds, the breaker.
- ``objects``: object names and the self-verifying object format.
- ``metrics``: its Prometheus series.
"""

from __future__ import annotations

from kvsvc.server.tiers.s3.tier import S3Tier

__all__ = ["S3Tier"]
