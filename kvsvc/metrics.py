"""Prometheus metrics (prometheus-client), served on --metrics-port when set.

Counters are updated at the few places that see every event (the RPC wrapper,
the transfer engine); gauges read the live server state when scraped, so they
cannot drift from it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

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


class Metrics:
    """One registry per server, so several servers can live in one test process."""

    def __init__(self, servicer: KVCacheServicer) -> None:
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
        fds = servicer.fds
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

        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def observe_request(self, rpc: str, outcome: str, seconds: float) -> None:
        """Count one answered RPC (label children cached: this runs on every call)."""
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
