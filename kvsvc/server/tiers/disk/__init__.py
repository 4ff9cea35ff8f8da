"""The local disk tier: chunks kept in files under --disk-dir, below memory and
above Redis; they survive restarts (the index is rebuilt from the files' headers
at start) and never come back torn (temporary name, flush, rename; every byte
checked against the header's CRC-32Cs when loaded). Best-effort like every tier.

One job per module:

- ``tier``: DiskTier, what the servicer calls (the store's listener, Lookup's and
  Retrieve's view, the capacity) and its life.
- ``format``: the file format (header, CRC-32C, file names).
- ``index``: what the disk holds, rebuilt at start; quarantine.
- ``writer``: the bounded write-behind queue and its thread.
- ``reader``: loads back into the store on reader threads.
"""

from __future__ import annotations

from kvsvc.server.tiers.disk.tier import DiskStats, DiskTier

__all__ = ["DiskStats", "DiskTier"]
