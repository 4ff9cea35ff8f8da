"""The Prometheus collectors of the disk and Redis tiers (``kvsvc_disk_*``,
``kvsvc_remote_*``; what :meth:`Tier.collector` returns), each also giving its
row of the series every tier shares (``figures``: ``kvsvc_tier_*{tier}``, in
kvsvc.server.ops.metrics). Read from the tiers when scraped, through the narrow
views below; nothing here imports a tier."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvsvc.server.ops.metrics import TierFigures


class RemoteStats(Protocol):
    """What the remote-tier metrics read (kvsvc.server.tiers.redis.RemoteTier has these)."""

    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    writes: int
    dropped_writes: int
    queued_bytes: int

    @property
    def errors(self) -> Mapping[str, int]: ...
    @property
    def rejected(self) -> Mapping[str, int]: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def breaker_state(self) -> int: ...


class DiskCounters(Protocol):
    """The disk tier's counters (kvsvc.server.tiers.disk.DiskStats)."""

    writes: int
    bytes_written: int
    skipped_full: int
    skipped_queue: int
    skipped_capacity: int
    write_errors: int
    replaced: int
    durable_late: int
    evicted: int
    hits: int
    bytes_read: int
    misses: int
    load_refused: int
    load_late: int
    index_seconds: float

    @property
    def refused(self) -> Mapping[str, int]: ...


class DiskHealth(Protocol):
    """Whether the disk takes writes (kvsvc.server.tiers.disk.heal.WriteHealth)."""

    @property
    def skipped(self) -> Mapping[str, int]: ...
    @property
    def owed(self) -> Collection[str]: ...


class DiskView(Protocol):
    """What the disk-tier metrics read (kvsvc.server.tiers.disk.DiskTier has these)."""

    capacity: int
    ready: bool

    @property
    def health(self) -> DiskHealth: ...
    @property
    def writing(self) -> bool: ...

    @property
    def stats(self) -> DiskCounters: ...
    @property
    def files(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def queued_bytes(self) -> int: ...


class DiskCollector:
    """Disk-tier counters and gauges, read from the tier when scraped."""

    def __init__(self, disk: DiskView) -> None:
        self.disk = disk

    def collect(self) -> Iterator[Any]:
        d, s = self.disk, self.disk.stats
        for name, doc, gauge in (
            ("kvsvc_disk_files", "chunk files the disk tier holds", d.files),
            ("kvsvc_disk_index_ready", "1 once the index of --disk-dir is rebuilt", d.ready),
            ("kvsvc_disk_index_seconds", "time the index rebuild took at start", s.index_seconds),
            ("kvsvc_disk_writing", "1 while writes land, 0 while the disk refuses them", d.writing),
            (
                "kvsvc_disk_owed_files",
                "files a Store replaced that the disk refused to remove (out of the index; "
                "removed once it takes writes)",
                len(d.health.owed),
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=float(gauge))
        for name, doc, value in (
            ("kvsvc_disk_evicted_files", "files removed for room (--disk-capacity)", s.evicted),
            (
                "kvsvc_disk_durable_late",
                "--disk-sync Stores that replied at their deadline, before their chunks "
                "were durable",
                s.durable_late,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        skipped = CounterMetricFamily(
            "kvsvc_disk_skipped_writes",
            "chunks not written to disk, by why: full (ENOSPC/EDQUOT), queue (write-behind "
            "full), capacity (larger than --disk-capacity), read_only (EROFS), permission "
            "(EACCES/EPERM), io (any other I/O error; the last three until the disk heals), "
            "replaced (a later Store of the key brought other bytes)",
            labels=["reason"],
        )
        for reason, n in (
            ("full", s.skipped_full),
            ("queue", s.skipped_queue),
            ("capacity", s.skipped_capacity),
            *sorted(dict(d.health.skipped).items()),
            ("replaced", s.replaced),
        ):
            skipped.add_metric([reason], n)
        yield skipped
        unserved = CounterMetricFamily(
            "kvsvc_disk_load_misses",
            "chunks the disk index listed and a Retrieve did not get, by why: file "
            "(gone or refused), no_room (memory), late (past the call's budget)",
            labels=["reason"],
        )
        for reason, n in (("file", s.misses), ("no_room", s.load_refused), ("late", s.load_late)):
            unserved.add_metric([reason], n)
        yield unserved
        refused = CounterMetricFamily(
            "kvsvc_disk_refused_files",
            "chunk files that did not check (at the index rebuild or on load), by kind: "
            "quarantined, or gone (removed under the server)",
            labels=["kind"],
        )
        for kind, n in sorted(dict(s.refused).items()):
            refused.add_metric([kind], n)
        yield refused

    def figures(self) -> TierFigures:
        d, s = self.disk, self.disk.stats
        return TierFigures(
            hits=s.hits,
            read_bytes=s.bytes_read,
            written_chunks=s.writes,
            written_bytes=s.bytes_written,
            queue_bytes=d.queued_bytes,
            used_bytes=d.used_bytes,
            capacity_bytes=d.capacity,
        )


class RemoteCollector:
    """Remote-tier counters and gauges, read from the tier when scraped."""

    def __init__(self, remote: RemoteStats) -> None:
        self.remote = remote

    def collect(self) -> Iterator[Any]:
        r = self.remote
        for name, doc, value in (
            ("kvsvc_remote_misses", "chunks Retrieve asked Redis for and did not get", r.misses),
            (
                "kvsvc_remote_dropped_writes",
                "chunks never written to Redis (queue full, Redis failing, breaker open)",
                r.dropped_writes,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, table in (
            (
                "kvsvc_remote_errors",
                "Redis exchanges that failed or were skipped, by kind",
                r.errors,
            ),
            (
                "kvsvc_remote_rejected_values",
                "Redis values refused (never loaded), by why: header, layout, checksum, part",
                r.rejected,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["kind"])
            for kind, n in sorted(dict(table).items()):
                family.add_metric([kind], n)
            yield family
        yield GaugeMetricFamily(
            "kvsvc_remote_queue_depth", "chunks waiting to be written to Redis", r.queue_depth
        )
        yield GaugeMetricFamily(
            "kvsvc_remote_breaker_state",
            "the Redis circuit breaker: 0 closed, 1 open, 2 half-open (one probe)",
            r.breaker_state,
        )

    def figures(self) -> TierFigures:
        r = self.remote
        return TierFigures(
            hits=r.hits,
            read_bytes=r.bytes_read,
            written_chunks=r.writes,
            written_bytes=r.bytes_written,
            queue_bytes=r.queued_bytes,
        )
