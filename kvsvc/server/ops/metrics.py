"""Prometheus metrics (prometheus-client), served on --metrics-port when set.

Counters are updated at the few places that see every event (the RPC wrapper,
the transfer engine); gauges read the live server state when scraped, so they
cannot drift from it. That state comes in through the narrow read-only views
below (structural protocols and callables), never the servicer: metrics import
no other kvsvc module, and a test can drive them with plain objects."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence, Sized
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class StoreStats(Protocol):
    """What the store gauges read (kvsvc.server.data.store.ChunkStore has these)."""

    @property
    def capacity(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def evicted_total(self) -> int: ...
    @property
    def checksum_failures(self) -> int: ...
    def __len__(self) -> int: ...


class ServingState(Protocol):
    """What the health gauges read (kvsvc.server.ops.health.Health has these)."""

    @property
    def serving(self) -> bool: ...
    @property
    def failure_time(self) -> float: ...


class Lease(Protocol):
    """One copy in flight (kvsvc.server.data.ledger.Transfer)."""

    @property
    def abandoned(self) -> bool: ...


class FdStats(Protocol):
    """What the fd-socket gauges read (kvsvc.client.fdpass.FdBroker has these)."""

    @property
    def peers(self) -> int: ...
    @property
    def leases(self) -> int: ...
    def open_fds(self) -> int: ...
    def __len__(self) -> int: ...


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
            ("kvsvc_disk_used_bytes", "bytes of the chunk files held", d.used_bytes),
            ("kvsvc_disk_capacity_bytes", "--disk-capacity", d.capacity),
            ("kvsvc_disk_queue_bytes", "chunk bytes waiting to be written", d.queued_bytes),
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
            ("kvsvc_disk_written_chunks", "chunk files written", s.writes),
            ("kvsvc_disk_written_bytes", "chunk bytes written to disk", s.bytes_written),
            ("kvsvc_disk_evicted_files", "files removed for room (--disk-capacity)", s.evicted),
            ("kvsvc_disk_hits", "chunks loaded back from disk into memory", s.hits),
            ("kvsvc_disk_read_bytes", "chunk bytes loaded back from disk", s.bytes_read),
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


class TierView(Protocol):
    """What metrics read of every tier below memory (kvsvc.server.tiers.base.Tier)."""

    @property
    def name(self) -> str: ...

    @property
    def writing(self) -> bool: ...
    def collector(self) -> Any: ...


class _TiersCollector:
    """What every tier says the same way, labelled by tier."""

    def __init__(self, tiers: Sequence[TierView]) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[Any]:
        writing = GaugeMetricFamily(
            "kvsvc_tier_writing",
            "1 while the tier's writes land, 0 while they are skipped (counted) until it heals",
            labels=["tier"],
        )
        for tier in self.tiers:
            writing.add_metric([tier.name], 1.0 if tier.writing else 0.0)
        yield writing


class EventStats(Protocol):
    """What metrics read of the events stream (kvsvc.server.events.EventLog)."""

    published: int
    resyncs: int
    watching: int


class _EventsCollector:
    """WatchEvents counters and the open watchers, read when scraped."""

    def __init__(self, events: EventStats) -> None:
        self.events = events

    def collect(self) -> Iterator[Any]:
        e = self.events
        yield GaugeMetricFamily("kvsvc_event_watchers", "WatchEvents streams open", e.watching)
        yield CounterMetricFamily(
            "kvsvc_events_published", "events published to the WatchEvents ring", e.published
        )
        yield CounterMetricFamily(
            "kvsvc_event_resyncs",
            "lost batches sent: watchers that resynced from a snapshot (no cursor, an old "
            "or foreign one, or fell behind the ring)",
            e.resyncs,
        )


class RemoteCollector:
    """Remote-tier counters and gauges, read from the tier when scraped."""

    def __init__(self, remote: RemoteStats) -> None:
        self.remote = remote

    def collect(self) -> Iterator[Any]:
        r = self.remote
        for name, doc, value in (
            ("kvsvc_remote_hits", "chunks fetched from Redis into the store", r.hits),
            ("kvsvc_remote_misses", "chunks Retrieve asked Redis for and did not get", r.misses),
            ("kvsvc_remote_read_bytes", "bytes fetched from Redis", r.bytes_read),
            ("kvsvc_remote_written_bytes", "bytes written to Redis", r.bytes_written),
            ("kvsvc_remote_writes", "chunks written to Redis", r.writes),
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
            "kvsvc_remote_queue_bytes", "bytes waiting to be written to Redis", r.queued_bytes
        )
        yield GaugeMetricFamily(
            "kvsvc_remote_breaker_state",
            "the Redis circuit breaker: 0 closed, 1 open, 2 half-open (one probe)",
            r.breaker_state,
        )


class Metrics:
    """One registry per server, so several servers can live in one test process.

    ``transfers`` returns the copies in flight at scrape time; ``mappings`` is the
    live collection of mapped regions; ``fds`` is None when the fd socket is off."""

    def __init__(
        self,
        *,
        store: StoreStats,
        health: ServingState,
        transfers: Callable[[], Collection[Lease]],
        mappings: Sized,
        fds: FdStats | None,
        events: EventStats | None = None,
        tiers: Sequence[TierView] = (),
    ) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvsvc_requests",
            "RPCs answered, by method and outcome ('result' or the error reason)",
            ["rpc", "outcome"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvsvc_request_seconds",
            "RPC handling time",
            ["rpc"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.auth_failures = Counter(
            "kvsvc_auth_failures",
            "calls refused UNAUTHENTICATED, by why (missing, unknown, expired, malformed, "
            "certificate-unlisted); every one is counted, the log is rate-bounded",
            ["reason"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvsvc_transfer_bytes",
            "bytes copied, by direction (store, retrieve)",
            ["direction"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "kvsvc_transfer_seconds",
            "copy time on a transfer worker, by direction",
            ["direction"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

        self.lookup_chunks = Counter(
            "kvsvc_lookup_chunks",
            "chunks asked for by Lookup: 'hit' (in the leading stored run) or 'miss' "
            "(the rest); an engine's prefix hit rate",
            ["result"],
            registry=r,
        )
        self._lookup_hit = self.lookup_chunks.labels("hit")
        self._lookup_miss = self.lookup_chunks.labels("miss")

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, registry=r).set_function(fn)

        gauge(
            "kvsvc_inflight_transfers",
            "copies running or queued on transfer workers",
            lambda: len(transfers()),
        )
        gauge(
            "kvsvc_unfenced_transfers",
            "copies still running whose client already gave up (server-side leases)",
            # A snapshot first: the scrape thread must not iterate a dict the loop changes.
            lambda: sum(1 for t in tuple(transfers()) if t.abandoned),
        )
        gauge("kvsvc_store_capacity_bytes", "chunk store capacity", lambda: store.capacity)
        gauge("kvsvc_store_used_bytes", "chunk store bytes in use", lambda: store.used_bytes)
        gauge("kvsvc_store_chunks", "chunks stored", lambda: len(store))
        gauge(
            "kvsvc_store_evictions", "chunks evicted (LRU) since start", lambda: store.evicted_total
        )
        gauge(
            "kvsvc_store_checksum_failures",
            "chunks that failed their checksum",
            lambda: store.checksum_failures,
        )
        gauge("kvsvc_mappings", "mapped engine regions", lambda: len(mappings))
        gauge(
            "kvsvc_fd_tokens_held",
            "passed memfds the fd socket holds for Maps (bounded, and expire)",
            lambda: len(fds) if fds is not None else 0,
        )
        gauge(
            "kvsvc_fd_socket_peers",
            "connections on the fd socket that have not sent their fd yet",
            lambda: fds.peers if fds is not None else 0,
        )
        gauge(
            "kvsvc_fd_leases",
            "engines' lease connections on the fd socket (their memfds live while open)",
            lambda: fds.leases if fds is not None else 0,
        )
        gauge(
            "kvsvc_fd_socket_open_fds",
            "fds the fd socket holds: passed memfds, their owners' pidfds, connections",
            lambda: fds.open_fds() if fds is not None else 0,
        )
        ProcessCollector(registry=r)  # process_open_fds / process_max_fds: the whole server
        gauge(
            "kvsvc_serving",
            "1 while health is SERVING, 0 after a fatal failure or in shutdown",
            lambda: 1.0 if health.serving else 0.0,
        )
        gauge(
            "kvsvc_seconds_since_last_fatal",
            "seconds since the fatal failure that stopped serving (-1: none)",
            lambda: time.time() - health.failure_time if health.failure_time else -1.0,
        )

        if events is not None:
            r.register(_EventsCollector(events))  # type: ignore[arg-type]
        for tier in tiers:
            r.register(tier.collector())
        if tiers:
            r.register(_TiersCollector(tiers))  # type: ignore[arg-type]
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._transfer_children: dict[str, tuple[Any, Any]] = {}

    def observe_request(self, rpc: str, outcome: str, seconds: float) -> None:
        """Count one answered RPC (label children cached: this runs on every call)."""
        key = (rpc, outcome)
        pair = self._children.get(key)
        if pair is None:
            pair = (self.requests.labels(rpc, outcome), self.request_seconds.labels(rpc))
            self._children[key] = pair
        pair[0].inc()
        pair[1].observe(seconds)

    def observe_auth_failure(self, reason: str) -> None:
        self.auth_failures.labels(reason).inc()

    def observe_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        """Count one copy (label children cached, as in observe_request)."""
        pair = self._transfer_children.get(direction)
        if pair is None:
            pair = (self.transfer_bytes.labels(direction), self.transfer_seconds.labels(direction))
            self._transfer_children[direction] = pair
        pair[0].inc(nbytes)
        pair[1].observe(seconds)

    def observe_lookup(self, hits: int, asked: int) -> None:
        self._lookup_hit.inc(hits)
        self._lookup_miss.inc(asked - hits)

    def serve_http(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)
