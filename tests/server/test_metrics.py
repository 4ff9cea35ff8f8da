"""Prometheus metrics scraped over HTTP after a known sequence of calls."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import make_cache

from kvsvc.client import KVCacheClient
from kvsvc.errors import InvalidRequest, Miss

pytestmark = pytest.mark.slow  # starts servers or subprocesses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_show_exact_counts(make_server, shm_dir) -> None:
    port = free_port()
    srv = make_server(metrics_port=port, store_bytes=1 << 20)
    cache = make_cache(shm_dir, "m", seed=1)
    with KVCacheClient(srv.address) as c:
        c.put("ns", [(b"a", b"x" * 1000), (b"b", b"y" * 2000)])  # 3000 bytes stored
        assert c.get("ns", b"a") == b"x" * 1000  # 1000 bytes retrieved
        with pytest.raises(Miss):
            c.get("ns", b"nope")  # a Retrieve with no copy
        m = c.map("ns", [cache.rank_region()])
        with pytest.raises(InvalidRequest):
            c.store(m, [(b"k", [99])])
        c.store(m, [(b"k", [0, 1])])
        for i in range(3):  # 3 x 400 KiB into a 1 MiB store: the third evicts
            c.put("ns", [(b"big%d" % i, b"z" * (400 << 10))])
        info = c.server_info()
    m_ = scrape(port)

    def v(name: str, **labels: str) -> float:
        return m_[(name, tuple(sorted(labels.items())))]

    assert v("kvsvc_requests_total", rpc="Store", outcome="result") == 5
    assert v("kvsvc_requests_total", rpc="Store", outcome="BLOCK_OUT_OF_RANGE") == 1
    assert v("kvsvc_requests_total", rpc="Retrieve", outcome="result") == 2
    assert v("kvsvc_requests_total", rpc="Map", outcome="result") == 1
    assert v("kvsvc_request_seconds_count", rpc="Store") == 6
    block_bytes = 2 * m.block_bytes
    assert v("kvsvc_transfer_bytes_total", direction="store") == 3000 + block_bytes + 3 * (
        400 << 10
    )
    assert v("kvsvc_transfer_bytes_total", direction="retrieve") == 1000
    assert v("kvsvc_transfer_seconds_count", direction="store") == 5
    assert v("kvsvc_store_evictions_total") == info.evicted_chunks >= 1
    assert v("kvsvc_store_chunks") == info.stored_chunks
    assert v("kvsvc_store_used_bytes") == info.used_bytes
    assert v("kvsvc_store_capacity_bytes") == 1 << 20
    assert v("kvsvc_mappings") == 1
    assert v("kvsvc_inflight_transfers") == 0
    assert v("kvsvc_serving") == 1
    assert ("kvsvc_seconds_since_last_fatal", ()) not in m_  # no fatal failure: absent
    assert v("kvsvc_event_loop_starved_total") >= 0  # the watchdog's, exported once started


def test_lookup_counts_hit_and_missed_chunks(make_server) -> None:
    """What an engine's connector asks (kvsvc.integrations.vllm): the prefix hit rate."""
    port = free_port()
    srv = make_server(metrics_port=port)
    with KVCacheClient(srv.address) as c:
        c.put("ns", [(b"a", b"x"), (b"b", b"y")])
        assert c.lookup([b"a", b"b", b"c", b"d"], namespace="ns") == 2
        assert c.lookup([b"z", b"a"], namespace="ns") == 0
    m_ = scrape(port)
    assert m_[("kvsvc_lookup_chunks_total", (("result", "hit"),))] == 2
    assert m_[("kvsvc_lookup_chunks_total", (("result", "miss"),))] == 4
