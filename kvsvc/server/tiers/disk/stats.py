"""The disk tier's counters: what metrics (kvsvc.server.ops.tier_metrics), stats
and tests read. Only the event loop changes them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DiskStats:
    """The tier's counters (read by tests and metrics)."""

    writes: int = 0
    bytes_written: int = 0
    skipped_full: int = 0  # ENOSPC / EDQUOT: the write was skipped
    skipped_queue: int = 0  # the write-behind queue was full
    skipped_capacity: int = 0  # does not fit --disk-capacity (the rest: writes landing)
    replaced: int = 0  # files (or writes) dropped because a Store brought other bytes
    durable_late: int = 0  # --disk-sync Stores that replied before their chunks were durable
    write_errors: int = 0
    evicted: int = 0  # files removed for room
    hits: int = 0  # chunks loaded back into memory
    bytes_read: int = 0
    misses: int = 0  # chunks the disk listed and could not give back
    load_refused: int = 0  # no room in memory to load into
    load_late: int = 0  # loads that ended after their caller's budget
    refused: dict[str, int] = field(default_factory=dict)  # files that did not check, by kind
    index_seconds: float = 0.0
    indexed_chunks: int = 0
