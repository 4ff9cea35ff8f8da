"""The local disk tier: chunks kept in files under --disk-dir, below memory and
above Redis; they survive restarts (the index is rebuilt from the files' headers
at start) and never come back torn (temporary name, flush, rename; every byte
checked against the header's CRC-32Cs when loaded). Best-effort like every tier:
a disk that refuses writes is skipped writes (counted by their true reason) until
it takes them again, never a failed call or a dead thread.

A version a later Store replaced is never served again, across restarts: its
file goes before the Store replies, and a file the disk refuses to remove is
owed, out of the index at once, recorded under --shm-dir before the reply and
removed by the next start before it indexes (``owed`` says where, and the one
case it cannot cover: a host reboot that empties a tmpfs shm dir before any
server saw the disk take writes again).

One job per module:

- ``tier``: DiskTier, what the servicer calls (the store's listener, Lookup's and
  Retrieve's view) and its life.
- ``capacity``: --disk-capacity's accounting, and which files go to make room.
- ``loads``: Retrieve's loads back into the store, within the caller's budget.
- ``stats``: the tier's counters.
- ``format``: the file format (header, CRC-32C, file names).
- ``index``: what the disk holds, rebuilt at start; quarantine.
- ``writer``: the bounded write-behind queue and its thread.
- ``reader``: loads back into the store on reader threads.
- ``heal``: whether the disk takes writes; the probe; the removals owed.
- ``owed``: the removals owed, recorded where the next start finds them (and paid
  there at start).
"""

from __future__ import annotations

from kvsvc.server.tiers.disk.stats import DiskStats
from kvsvc.server.tiers.disk.tier import DiskTier

__all__ = ["DiskStats", "DiskTier"]
