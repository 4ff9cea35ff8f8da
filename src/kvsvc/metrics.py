"""Prometheus metrics (prometheus-client), served on --metrics-port when set.

Counters are updated at the few places that see every event (the RPC wrapper,
the transfer engine); gauges read the live server state when scraped, so they
cannot drift from it."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import metrics as _prom_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from kvsvc.server import KVCacheServicer

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


def _use_created() -> bool:
    return bool(getattr(_prom_metrics, "_use_created", True))


class _Count:
    """One series of a :class:`LoopCounter`."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _Buckets:
    """One series of a :class:`LoopHistogram`: a count per bucket, and the sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount
        self.sum += amount


class LoopCounter:
    """A labelled counter for the event loop's hot path: plain numbers, no lock.

    prometheus-client's Counter takes a lock per increment and checks its labels on
    every call; the RPC wrapper counts every call, always on the event loop, so
    these series are written by that one thread and only read (copied) by a scrape.
    Exposed exactly like a Counter (``_total``, ``_created``).
    """

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...]) -> None:
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self._series: dict[tuple[str, ...], _Count] = {}

    def labels(self, *values: str) -> _Count:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _Count()
        return series

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        created = _use_created()
        for values, series in list(self._series.items()):
            family.add_metric(values, series.value, created=series.created if created else None)
        yield family


class LoopHistogram:
    """A labelled histogram for the event loop's hot path (see :class:`LoopCounter`).
    Exposed exactly like a Histogram (``_bucket``, ``_count``, ``_sum``, ``_created``)."""

    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self.bounds = tuple(float(b) for b in buckets)
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self._series: dict[tuple[str, ...], _Buckets] = {}

    def labels(self, *values: str) -> _Buckets:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _Buckets(self.bounds)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        created = _use_created()
        for values, series in list(self._series.items()):
            counts, total = list(series.counts), series.sum  # copies: the loop keeps writing
            cumulative, buckets = 0, []
            for le, n in zip(self._les, counts, strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            family.add_metric(values, buckets, total)
            if created:
                labels = dict(zip(self.labelnames, values, strict=True))
                family.samples.append(Sample(self.name + "_created", labels, series.created))
        yield family


class Metrics:
    """One registry per server, so several servers can live in one test process."""

    def __init__(self, servicer: KVCacheServicer) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        # Updated on every RPC, on the event loop: lock-free series (see LoopCounter).
        self.requests = LoopCounter(
            "kvsvc_requests",
            "RPCs answered, by method and outcome ('result' or the error reason)",
            ("rpc", "outcome"),
        )
        self.request_seconds = LoopHistogram(
            "kvsvc_request_seconds", "RPC handling time", ("rpc",), _LATENCY_BUCKETS
        )
        r.register(self.requests)
        r.register(self.request_seconds)
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
        store, engine, health = servicer.store, servicer.engine, servicer.health

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, registry=r).set_function(fn)

        gauge(
            "kvsvc_inflight_transfers",
            "copies running or queued on transfer workers",
            lambda: len(engine.inflight),
        )
        gauge(
            "kvsvc_unfenced_transfers",
            "copies still running whose client already gave up (server-side leases)",
            lambda: sum(1 for t in engine.inflight.values() if t.abandoned),
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
        gauge("kvsvc_mappings", "mapped engine regions", lambda: len(servicer.mappings))
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

        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def observe_request(self, rpc: str, outcome: str, seconds: float) -> None:
        """Count one answered RPC (label children cached: this runs on every call).
        Called on the event loop only (the RPC wrapper), like every write of
        ``requests`` and ``request_seconds``."""
        key = (rpc, outcome)
        pair = self._children.get(key)
        if pair is None:
            pair = (self.requests.labels(rpc, outcome), self.request_seconds.labels(rpc))
            self._children[key] = pair
        pair[0].inc()
        pair[1].observe(seconds)

    def observe_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(direction).inc(nbytes)
        self.transfer_seconds.labels(direction).observe(seconds)

    def serve_http(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)
