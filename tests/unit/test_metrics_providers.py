"""Metrics read the server through narrow views, at scrape time: plain objects
stand in for the store, health, transfers, mappings and fd socket here, and each
gauge follows them live. (tests/server/test_metrics.py scrapes a real server.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.server.config import ConfigError, ServerConfig, parse_server_config
from kvsvc.server.config.host import metrics_address
from kvsvc.server.ops.health import Health as RealHealth
from kvsvc.server.ops.metrics import MAX_TENANT_SERIES, OTHER_TENANTS, UNOWNED, Metrics


@dataclass
class Store:
    capacity: int = 1 << 20
    used_bytes: int = 0
    evicted_total: int = 0
    checksum_failures: int = 0
    chunks: int = 0
    used_by: dict[str, int] = field(default_factory=dict)
    shares: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.chunks


@dataclass
class Health:
    ready: bool = True
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
    assert first["kvsvc_serving"] == 1
    assert "kvsvc_seconds_since_last_fatal" not in first  # absent, no sentinel, until one

    store.used_bytes, store.chunks, store.evicted_total, store.checksum_failures = 4096, 3, 2, 1
    inflight.update(a=Lease(), b=Lease(abandoned=True), c=Lease(abandoned=True))
    mappings["m-1"] = object()
    fds.tokens.append("t")
    fds.peers = 4
    fds.leases = 2
    health.ready, health.failure_time = False, 1.0
    now = scrape(metrics)
    assert now["kvsvc_store_used_bytes"] == 4096
    assert now["kvsvc_store_chunks"] == 3
    assert now["kvsvc_store_evictions_total"] == 2
    assert now["kvsvc_store_checksum_failures_total"] == 1
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


def families(metrics: Metrics) -> dict[str, str]:
    """Each family's name and type, as a scraper sees them."""
    text = generate_latest(metrics.registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_running_totals_are_counters_and_build_info_is_one() -> None:
    metrics = Metrics(
        store=Store(),
        health=Health(),
        transfers=dict().values,
        mappings={},
        fds=None,
        version="9.9",
    )
    kinds = families(metrics)
    assert kinds["kvsvc_store_evictions"] == "counter"
    assert kinds["kvsvc_store_checksum_failures"] == "counter"
    text = generate_latest(metrics.registry).decode()
    assert 'kvsvc_build_info{python="' in text and 'version="9.9"} 1.0' in text


def tenant_bytes(metrics: Metrics, name: str) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.labels["tenant"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_tenant_series_are_bounded() -> None:
    """A tenant file with many tenants: the largest keep a series, the rest are summed."""
    n = MAX_TENANT_SERIES + 30
    store = Store(used_by={f"t{i:03}": 1000 + i for i in range(n)}, shares={"t000": 5000})
    metrics = Metrics(store=store, health=Health(), transfers=dict().values, mappings={}, fds=None)
    used = tenant_bytes(metrics, "kvsvc_tenant_store_used_bytes")
    assert len(used) == MAX_TENANT_SERIES
    assert sum(used.values()) == sum(store.used_by.values())
    assert used[f"t{n - 1:03}"] == 1000 + n - 1  # the largest keeps its own
    assert used[OTHER_TENANTS] == sum(1000 + i for i in range(31))  # the 31 smallest
    assert tenant_bytes(metrics, "kvsvc_tenant_store_share_bytes") == {}  # t000 is in _other

    store.used_by.clear()
    store.used_by.update({"a": 10, "": 20})
    assert tenant_bytes(metrics, "kvsvc_tenant_store_used_bytes") == {
        "a": 10,
        UNOWNED: 20,
        "t000": 0,
    }
    assert tenant_bytes(metrics, "kvsvc_tenant_store_share_bytes") == {"t000": 5000}


@dataclass
class TenantFile:
    reloads_ok: int = 0
    reloads_failed: int = 0
    reload_failed: bool = False


def test_tenant_file_reload_failure_is_a_gauge_and_reloads_are_counted() -> None:
    source = TenantFile()
    metrics = bare()
    metrics.watch_tenant_file(source)
    assert scrape(metrics)["kvsvc_tenant_file_reload_failed"] == 0
    source.reloads_failed, source.reload_failed = 1, True
    text = generate_latest(metrics.registry).decode()
    assert scrape(metrics)["kvsvc_tenant_file_reload_failed"] == 1
    assert 'kvsvc_tenant_file_reloads_total{result="failed"} 1.0' in text
    source.reloads_ok, source.reload_failed = 1, False
    assert scrape(metrics)["kvsvc_tenant_file_reload_failed"] == 0


def test_host_starvation_of_the_loop_is_a_counter_read_from_the_watchdog() -> None:
    """The watchdog counts starvation episodes (late heartbeats that waited for a
    CPU) without failing; operators see them as a counter that follows it live."""

    @dataclass
    class Loop:
        starved: int = 0

    metrics, loop = bare(), Loop()
    metrics.watch_loop(loop)
    assert scrape(metrics)["kvsvc_event_loop_starved_total"] == 0
    loop.starved = 3
    assert scrape(metrics)["kvsvc_event_loop_starved_total"] == 3
    assert families(metrics)["kvsvc_event_loop_starved"] == "counter"


def test_serving_reads_what_health_answers_for_readiness() -> None:
    """The disk index hold keeps readiness NOT_SERVING (liveness SERVING): so does
    kvsvc_serving; a fatal failure after the release turns it to 0 again."""

    async def run() -> list[float]:
        health = RealHealth()
        metrics = Metrics(
            store=Store(), health=health, transfers=dict().values, mappings={}, fds=None
        )
        seen = [scrape(metrics)["kvsvc_serving"]]  # before start
        health.hold("disk_index")
        await health.start()
        assert health.probe.status("") == health_pb2.HealthCheckResponse.SERVING
        seen.append(scrape(metrics)["kvsvc_serving"])
        health.release("disk_index")
        seen.append(scrape(metrics)["kvsvc_serving"])
        health.fatal_now("TRANSFER_STALLED", "test")
        values = scrape(metrics)
        seen.append(values["kvsvc_serving"])
        assert values["kvsvc_seconds_since_last_fatal"] >= 0
        return seen

    assert asyncio.run(run()) == [0, 0, 1, 0]


@pytest.mark.parametrize(
    ("settings", "address"),
    [
        ({}, None),
        ({"metrics_port": 9400}, ("127.0.0.1", 9400)),
        ({"listen": "0.0.0.0:50051", "metrics_port": 9400}, ("0.0.0.0", 9400)),
        ({"listen": "unix:/tmp/k.sock", "metrics_port": 9400}, ("127.0.0.1", 9400)),
        ({"metrics_listen": "0.0.0.0:9400"}, ("0.0.0.0", 9400)),
        ({"metrics_listen": "[::]:9400"}, ("::", 9400)),
    ],
)
def test_metrics_listen_or_metrics_port(settings: dict[str, object], address: object) -> None:
    assert metrics_address(ServerConfig.from_settings(**settings)) == address


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"metrics_listen": "0.0.0.0:9400", "metrics_port": 9401}, "both set"),
        ({"metrics_listen": "unix:/tmp/m.sock"}, "expected HOST:PORT with a TCP port"),
        ({"metrics_listen": "127.0.0.1:0"}, "expected HOST:PORT with a TCP port"),
    ],
)
def test_metrics_listen_refusals_name_the_flag(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        metrics_address(ServerConfig.from_settings(**settings))
    assert "--metrics-listen" in str(caught.value)


def test_metrics_listen_is_a_flag_and_a_variable() -> None:
    config = parse_server_config(["--metrics-listen", "0.0.0.0:9400"], environ={})
    assert config.observability.metrics_listen == "0.0.0.0:9400"
    config = parse_server_config([], environ={"KVSVC_METRICS_LISTEN": "127.0.0.1:9500"})
    assert metrics_address(config) == ("127.0.0.1", 9500)


@dataclass
class Counts:
    lookup_memory: int = 0
    retrieve_asked: int = 0
    retrieve_hits: int = 0


@dataclass
class Chain:
    lookup_hits: dict[str, int] = field(default_factory=dict)
    retrieve_hits: dict[str, int] = field(default_factory=dict)


def by_tier(metrics: Metrics, name: str) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.labels["tier"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_hits_are_split_by_the_tier_that_held_them() -> None:
    counts, chain = Counts(), Chain()
    metrics = bare()
    metrics.watch_hits(counts, chain, ["disk", "redis"])
    zero = {"memory": 0, "disk": 0, "redis": 0}
    assert by_tier(metrics, "kvsvc_lookup_hit_chunks_total") == zero  # every tier, at 0
    counts.lookup_memory, chain.lookup_hits = 5, {"memory": 1, "disk": 2}
    counts.retrieve_asked, counts.retrieve_hits, chain.retrieve_hits = 10, 6, {"redis": 3}
    assert by_tier(metrics, "kvsvc_lookup_hit_chunks_total") == {**zero, "memory": 6, "disk": 2}
    assert by_tier(metrics, "kvsvc_retrieve_hit_chunks_total") == {**zero, "memory": 6, "redis": 3}
    assert scrape(metrics)["kvsvc_retrieve_asked_chunks_total"] == 10
