"""Metrics read the server through narrow views, at scrape time: plain objects
stand in for the store, health, transfers, mappings and fd socket here, and each
gauge follows them live. (tests/server/test_metrics.py scrapes a real server.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.server.ops.metrics import Metrics


@dataclass
class Store:
    capacity: int = 1 << 20
    used_bytes: int = 0
    evicted_total: int = 0
    checksum_failures: int = 0
    chunks: int = 0

    def __len__(self) -> int:
        return self.chunks


@dataclass
class Health:
    serving: bool = True
    failure_time: float = 0.0


@dataclass
class Lease:
    abandoned: bool = False


@dataclass
class Fds:
    tokens: list[str] = field(default_factory=list)
    peers: int = 0
    leases: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def open_fds(self) -> int:
        return 2 * len(self.tokens) + self.peers + self.leases + 1


def scrape(metrics: Metrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def test_gauges_follow_the_providers_live() -> None:
    store, health, fds = Store(), Health(), Fds()
    inflight: dict[str, Lease] = {}
    mappings: dict[str, object] = {}
    metrics = Metrics(
        store=store, health=health, transfers=inflight.values, mappings=mappings, fds=fds
    )
    first = scrape(metrics)
    assert first["kvsvc_store_capacity_bytes"] == 1 << 20
    assert first["kvsvc_inflight_transfers"] == 0 and first["kvsvc_mappings"] == 0
    assert first["kvsvc_serving"] == 1 and first["kvsvc_seconds_since_last_fatal"] == -1

    store.used_bytes, store.chunks, store.evicted_total, store.checksum_failures = 4096, 3, 2, 1
    inflight.update(a=Lease(), b=Lease(abandoned=True), c=Lease(abandoned=True))
    mappings["m-1"] = object()
    fds.tokens.append("t")
    fds.peers = 4
    fds.leases = 2
    health.serving, health.failure_time = False, 1.0
    now = scrape(metrics)
    assert now["kvsvc_store_used_bytes"] == 4096
    assert now["kvsvc_store_chunks"] == 3
    assert now["kvsvc_store_evictions"] == 2
    assert now["kvsvc_store_checksum_failures"] == 1
    assert now["kvsvc_inflight_transfers"] == 3
    assert now["kvsvc_unfenced_transfers"] == 2
    assert now["kvsvc_mappings"] == 1
    assert now["kvsvc_fd_tokens_held"] == 1
    assert now["kvsvc_fd_socket_peers"] == 4
    assert now["kvsvc_fd_leases"] == 2
    assert now["kvsvc_fd_socket_open_fds"] == 9
    assert now["kvsvc_serving"] == 0
    assert now["kvsvc_seconds_since_last_fatal"] > 0


def bare() -> Metrics:
    return Metrics(store=Store(), health=Health(), transfers=dict().values, mappings={}, fds=None)


def test_without_an_fd_socket_its_gauges_read_zero() -> None:
    values = scrape(bare())
    names = ("kvsvc_fd_tokens_held", "kvsvc_fd_socket_peers", "kvsvc_fd_leases")
    for name in (*names, "kvsvc_fd_socket_open_fds"):
        assert values[name] == 0


def test_counters_and_two_instances_do_not_share_a_registry() -> None:
    a, b = bare(), bare()
    a.observe_request("Store", "result", 0.01)
    a.observe_request("Store", "result", 0.02)
    a.observe_transfer("store", 100, 0.001)
    text = generate_latest(a.registry).decode()
    assert 'kvsvc_requests_total{outcome="result",rpc="Store"} 2.0' in text
    assert 'kvsvc_transfer_bytes_total{direction="store"} 100.0' in text
    assert "kvsvc_requests_total{" not in generate_latest(b.registry).decode()
