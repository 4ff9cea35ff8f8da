"""Prometheus metrics (prometheus-client), served on --metrics-listen or --metrics-port.

Counters are updated at the few places that see every event (the RPC wrapper,
the transfer engine); gauges read the live server state when scraped, so they
cannot drift from it. That state comes in through the narrow read-only views
below (structural protocols and callables), never the servicer: metrics import
no other kvsvc module, and a test can drive them with plain objects. The disk
and Redis tiers' own collectors are in kvsvc.server.ops.tier_metrics.

Naming follows Prometheus: what only grows is a counter (``_total``), base units
in the name, no sentinel values (a series that has nothing to say is absent),
and labels of bounded cardinality (``tier``: the tiers configured; ``tenant``: at
most :data:`MAX_TENANT_SERIES`, the rest summed). docs/metrics.md lists every
series; a test keeps it in step with a live scrape."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence, Sized
from typing import Any, NamedTuple, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# A `_created` gauge beside every counter and histogram child doubles a scrape and
# no query here reads one; the server process has no other Prometheus user.
disable_created_metrics()

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

#: Tenants given a series of their own in the per-tenant gauges (the largest by
#: bytes held); the rest are summed under tenant="_other", so a tenant file with
#: thousands of tenants cannot blow up a scrape.
MAX_TENANT_SERIES = 50
OTHER_TENANTS = "_other"
#: the owner of chunks loaded from a tier below memory: no tenant's Store made them
UNOWNED = "_unowned"
#: the tier label of the memory store, above every tier of the chain
MEMORY = "memory"


class StoreStats(Protocol):
    """What the store metrics read (kvsvc.server.data.store.ChunkStore has these)."""

    @property
    def capacity(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def evicted_total(self) -> int: ...
    @property
    def checksum_failures(self) -> int: ...
    @property
    def used_by(self) -> Mapping[str, int]: ...
    @property
    def shares(self) -> Mapping[str, int]: ...
    def __len__(self) -> int: ...


class ServingState(Protocol):
    """What the health gauges read (kvsvc.server.ops.health.Health has these)."""

    @property
    def ready(self) -> bool:
        """Whether grpc.health.v1 answers SERVING for the service name now."""
        ...

    @property
    def failure_time(self) -> float: ...


class TenantFile(Protocol):
    """What the tenant-file metrics read (kvsvc.server.security.auth.Authenticator)."""

    reloads_ok: int
    reloads_failed: int
    #: the last reload failed: the tables in force are older than the file
    reload_failed: bool


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


class TierFigures(NamedTuple):
    """What every tier below memory reports the same way (``kvsvc_tier_*{tier}``);
    None: the tier cannot say (Redis does not tell its memory use)."""

    hits: int
    read_bytes: int
    written_chunks: int
    written_bytes: int
    queue_bytes: int
    used_bytes: int | None = None
    capacity_bytes: int | None = None


class TierView(Protocol):
    """What metrics read of every tier below memory (kvsvc.server.tiers.base.Tier)."""

    @property
    def name(self) -> str: ...

    @property
    def writing(self) -> bool: ...
    def collector(self) -> Any: ...


class TiersCollector:
    """What every tier says the same way, labelled by tier (the tiers configured:
    bounded). ``tiers``: each tier with its own collector, which gives the figures."""

    COUNTERS = (
        ("kvsvc_tier_hits", "hits", "chunks loaded from the tier into memory by Retrieve"),
        ("kvsvc_tier_read_bytes", "read_bytes", "chunk bytes loaded from the tier"),
        ("kvsvc_tier_written_chunks", "written_chunks", "chunks written to the tier"),
        ("kvsvc_tier_written_bytes", "written_bytes", "chunk bytes written to the tier"),
    )
    GAUGES = (
        ("kvsvc_tier_queue_bytes", "queue_bytes", "chunk bytes waiting to be written behind"),
        ("kvsvc_tier_used_bytes", "used_bytes", "bytes the tier holds (tiers that know it)"),
        (
            "kvsvc_tier_capacity_bytes",
            "capacity_bytes",
            "bytes the tier may hold (tiers with a bound: --disk-capacity)",
        ),
    )

    def __init__(self, tiers: Sequence[tuple[TierView, Any]]) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[Any]:
        writing = GaugeMetricFamily(
            "kvsvc_tier_writing",
            "1 while the tier's writes land, 0 while they are skipped (counted) until it heals",
            labels=["tier"],
        )
        figures: list[tuple[str, TierFigures]] = []
        for tier, collector in self.tiers:
            writing.add_metric([tier.name], 1.0 if tier.writing else 0.0)
            if hasattr(collector, "figures"):
                figures.append((tier.name, collector.figures()))
        yield writing
        for name, field, doc in self.COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["tier"])
            for tier_name, f in figures:
                counter.add_metric([tier_name], getattr(f, field))
            yield counter
        for name, field, doc in self.GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier_name, f in figures:
                value = getattr(f, field)
                if value is not None:
                    gauge.add_metric([tier_name], float(value))
            yield gauge


class _StoreCollector:
    """The memory store, and what each tenant holds of it, read when scraped."""

    def __init__(self, store: StoreStats) -> None:
        self.store = store

    def collect(self) -> Iterator[Any]:
        st = self.store
        for name, doc, value in (
            ("kvsvc_store_capacity_bytes", "chunk store capacity (--store-bytes)", st.capacity),
            ("kvsvc_store_used_bytes", "chunk store bytes in use", st.used_bytes),
            ("kvsvc_store_chunks", "chunks stored", len(st)),
        ):
            yield GaugeMetricFamily(name, doc, value=float(value))
        yield CounterMetricFamily(
            "kvsvc_store_evictions",
            "chunks evicted (LRU, by tenant share) from memory",
            st.evicted_total,
        )
        yield CounterMetricFamily(
            "kvsvc_store_checksum_failures",
            "chunks in memory that failed their CRC-32C check (dropped, never served)",
            st.checksum_failures,
        )
        # Copying a plain dict never releases the GIL: a consistent view although the
        # loop keeps changing the store while this runs on the scrape thread.
        used = dict(st.used_by)
        shares = dict(st.shares)
        used_family = GaugeMetricFamily(
            "kvsvc_tenant_store_used_bytes",
            f"store bytes each tenant holds (the {MAX_TENANT_SERIES - 1} largest; the rest "
            f'summed as tenant="{OTHER_TENANTS}")',
            labels=["tenant"],
        )
        share_family = GaugeMetricFamily(
            "kvsvc_tenant_store_share_bytes",
            "store bytes a tenant may hold before eviction takes from it first "
            "(tenants with a store_share quota)",
            labels=["tenant"],
        )
        for tenant, value in bounded_tenants(used, shares.keys()).items():
            used_family.add_metric([tenant or UNOWNED], float(value))
            if tenant in shares:
                share_family.add_metric([tenant or UNOWNED], float(shares[tenant]))
        yield used_family
        yield share_family


def bounded_tenants(used: Mapping[str, int], known: Collection[str]) -> dict[str, int]:
    """Each tenant's bytes (those with a share or bytes), at most MAX_TENANT_SERIES
    entries: the largest keep their own, the rest summed under OTHER_TENANTS."""
    everyone = {t: used.get(t, 0) for t in (*used, *known)}
    if len(everyone) <= MAX_TENANT_SERIES:
        return everyone
    ranked = sorted(everyone.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = dict(ranked[: MAX_TENANT_SERIES - 1])
    kept[OTHER_TENANTS] = sum(v for _, v in ranked[MAX_TENANT_SERIES - 1 :])
    return kept


class _HealthCollector:
    """Readiness as health answers it, and how long ago a fatal failure stopped it."""

    def __init__(self, health: ServingState) -> None:
        self.health = health

    def collect(self) -> Iterator[Any]:
        h = self.health
        yield GaugeMetricFamily(
            "kvsvc_serving",
            "1 while grpc.health.v1 answers SERVING for kvsvc.v1.KVCacheService (readiness); "
            "0 before start, while a tier holds it (disk index rebuild), after a fatal "
            "failure and in shutdown",
            value=1.0 if h.ready else 0.0,
        )
        failed_at = h.failure_time
        if failed_at:  # no sentinel: the family is absent until a fatal failure
            yield GaugeMetricFamily(
                "kvsvc_seconds_since_last_fatal",
                "seconds since the fatal failure that stopped serving (absent while none)",
                value=time.time() - failed_at,
            )


class HitCounts(Protocol):
    """Memory's part of the hits (kvsvc.server.ops.stats.Counts has these)."""

    lookup_memory: int
    retrieve_asked: int
    retrieve_hits: int


class ChainHits(Protocol):
    """Who held each hit past memory's leading run (kvsvc.server.tiers.chain.TierChain)."""

    @property
    def lookup_hits(self) -> Mapping[str, int]: ...
    @property
    def retrieve_hits(self) -> Mapping[str, int]: ...


class _HitsCollector:
    """Lookup and Retrieve hits by the tier that held each chunk: memory, then the
    tiers below it (every tier configured has its series, zero until it hits)."""

    def __init__(self, counts: HitCounts, chain: ChainHits, tiers: Sequence[str]) -> None:
        self.counts, self.chain = counts, chain
        self.names = [MEMORY, *tiers]

    def collect(self) -> Iterator[Any]:
        c = self.counts
        held = dict(self.chain.lookup_hits)  # a plain dict's copy: atomic (see above)
        held[MEMORY] = held.get(MEMORY, 0) + c.lookup_memory
        loaded = dict(self.chain.retrieve_hits)
        loaded[MEMORY] = c.retrieve_hits
        for name, doc, table in (
            (
                "kvsvc_lookup_hit_chunks",
                "Lookup hits (chunks of the leading stored run) by the tier that held each",
                held,
            ),
            (
                "kvsvc_retrieve_hit_chunks",
                "chunks Retrieve served, by the tier it found each in (memory, or the tier "
                "that loaded it)",
                loaded,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier in self.names:
                family.add_metric([tier], table.get(tier, 0))
            yield family
        yield CounterMetricFamily(
            "kvsvc_retrieve_asked_chunks",
            "chunks Retrieve was asked for (the denominator of its hit rate)",
            c.retrieve_asked,
        )


class _TenantFileCollector:
    """Whether the tenant file in force is the one on disk (SIGHUP reloads)."""

    def __init__(self, source: TenantFile) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        t = self.source
        reloads = CounterMetricFamily(
            "kvsvc_tenant_file_reloads",
            "tenant file reloads (SIGHUP), by result: ok, or failed (the previous tables "
            "stay in force)",
            labels=["result"],
        )
        reloads.add_metric(["ok"], t.reloads_ok)
        reloads.add_metric(["failed"], t.reloads_failed)
        yield reloads
        yield GaugeMetricFamily(
            "kvsvc_tenant_file_reload_failed",
            "1 while the last reload of the tenant file failed (the tables in force are "
            "older than the file); 0 once one succeeds",
            value=1.0 if t.reload_failed else 0.0,
        )


class LoopStats(Protocol):
    """What metrics read of the event-loop watchdog (kvsvc.server.ops.watchdog.Watchdog)."""

    starved: int


class _LoopCollector:
    """Host starvation of the event loop: late heartbeats that were mostly waiting for
    a CPU, which the watchdog logs and counts but never turns into a fatal failure."""

    def __init__(self, source: LoopStats) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily(
            "kvsvc_event_loop_starved",
            "episodes of the event loop's heartbeat running late mostly waiting for a CPU "
            "(the host starving the server, not kvsvc blocking its loop); health untouched",
            value=self.source.starved,
        )


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
        version: str = "",
    ) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        Gauge(
            "kvsvc_build_info",
            "1, labelled with the kvsvc version and the Python that runs it",
            ["version", "python"],
            registry=r,
        ).labels(version or "unknown", platform.python_version()).set(1)
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
        r.register(_StoreCollector(store))  # type: ignore[arg-type]
        r.register(_HealthCollector(health))  # type: ignore[arg-type]
        if events is not None:
            r.register(_EventsCollector(events))  # type: ignore[arg-type]
        collectors = [(tier, tier.collector()) for tier in tiers]
        for _, collector in collectors:
            r.register(collector)
        if tiers:
            r.register(TiersCollector(collectors))  # type: ignore[arg-type]
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

    def watch_hits(self, counts: HitCounts, chain: ChainHits, tiers: Sequence[str]) -> None:
        """Export hits by tier (``tiers``: the names of the chain's tiers, in order)."""
        self.registry.register(_HitsCollector(counts, chain, tiers))  # type: ignore[arg-type]

    def watch_tenant_file(self, source: TenantFile) -> None:
        """Export the tenant file's reloads (servers with --auth-token-file)."""
        self.registry.register(_TenantFileCollector(source))  # type: ignore[arg-type]

    def watch_loop(self, source: LoopStats) -> None:
        """Export the watchdog's count of host-starvation episodes."""
        self.registry.register(_LoopCollector(source))  # type: ignore[arg-type]

    def serve_http(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)
