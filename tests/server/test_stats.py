"""`kvsvc stats` and GetServerInfo's FULL view against live servers: every figure the
command shows is checked against what the test made the server do (chunks stored,
read back, evicted, dropped, skipped; a tenant over its share and refused by its
quota; a watcher behind); the command's table, --json and --watch; and a bad
target, token or flag is one line and exit 2."""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from certs import make_ca, make_cert
from redis_servers import RedisServer, require_redis
from support import make_cache

from kvsvc.client import KVCacheClient
from kvsvc.errors import CapacityExhausted
from kvsvc.limits import MiB
from kvsvc.server.config import ServerConfig
from kvsvc.server.data import copies
from kvsvc.server.ops.stats import settings_in_force
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts servers, redis-server and `kvsvc stats` processes

KiB = 1024
CHUNK = 512 * KiB
TOKEN = secrets.token_hex(16)
OTHER = secrets.token_hex(16)


def stats_of(client: KVCacheClient) -> pb.GetServerInfoResult:
    return client.server_info(stats=True, timeout=10)


def tier(info: pb.GetServerInfoResult, name: str) -> pb.TierStats:
    (found,) = [t for t in info.stats.tiers if t.name == name]
    return found


def wait_for(what: str, cond: Callable[[], bool], limit: float = 30.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, f"not within {limit} s: {what}"
        time.sleep(0.05)


def kvsvc_stats(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    env["COLUMNS"] = "120"
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", "stats", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    r = RedisServer(tmp_path / "redis")
    yield r
    r.kill()


# --- the tiers ------------------------------------------------------------------
def test_each_tiers_figures_are_what_the_server_did(make_server, tmp_path, redis_server):
    st = make_server(  # write-behind queues of a quarter of the store: 4 MiB
        store_bytes=16 * MiB,
        disk_dir=str(tmp_path / "disk"),
        disk_capacity=2 * MiB,
        remote=redis_server.url,
        remote_lookup_budget=5.0,
    )
    keys = [b"a%02d" % i for i in range(6)]
    with KVCacheClient(st.address) as c:
        before = stats_of(c)
        assert [t.name for t in before.stats.tiers] == ["memory", "disk", "redis"]
        # 6 chunks of 512 KiB, disk capacity 2 MiB: the disk keeps what fits, evicting
        # (each Store once the last landed: room is made among the files written).
        for i, k in enumerate(keys):
            c.put("a", [(k, bytes([i]) * CHUNK)], timeout=10)
            wait_for("on disk", lambda n=i + 1: tier(stats_of(c), "disk").written_chunks == n)
        wait_for("in Redis", lambda: tier(stats_of(c), "redis").written_chunks == 6)
        info = stats_of(c)
        memory, disk = tier(info, "memory"), tier(info, "disk")
        assert (memory.chunks, memory.written_chunks, memory.written_bytes) == (6, 6, 6 * CHUNK)
        assert memory.capacity_bytes == 16 * MiB and memory.used_bytes >= 6 * CHUNK
        assert disk.capacity_bytes == 2 * MiB
        assert disk.written_bytes == 6 * CHUNK
        assert disk.removed_chunks["evicted"] >= 2
        assert disk.chunks + disk.removed_chunks["evicted"] == 6  # what it holds + evicted
        assert disk.chunks * CHUNK < disk.used_bytes < disk.chunks * (CHUNK + 64 * KiB)
        assert disk.writing and disk.ready

        # A chunk larger than the disk: memory takes it, the disk skips it for capacity.
        c.put("a", [(b"big", b"B" * 3 * MiB)], timeout=10)
        wait_for(
            "the disk skipped it",
            lambda: tier(stats_of(c), "disk").skipped_writes["capacity"] == 1,
        )

        # Lookup: 6 + 1 in memory, then one nobody has.
        hit = c.lookup("a", [*keys, b"big", b"none"], timeout=10)
        assert hit == 7
        info = stats_of(c)
        assert (info.stats.lookups.requests, info.stats.lookups.asked_chunks) == (1, 8)
        assert info.stats.lookups.hit_chunks == 7
        assert tier(info, "memory").lookup_hit_chunks == 7

        # Retrieve from memory: asked 1, found 1, its bytes read.
        assert c.get("a", keys[0], timeout=10) == bytes([0]) * CHUNK
        memory = tier(stats_of(c), "memory")
        assert (memory.retrieve_asked_chunks, memory.retrieve_hit_chunks) == (1, 1)
        assert memory.read_bytes == CHUNK

        # Drop the namespace: every memory chunk of it removed as "dropped".
        dropped = c.drop_namespace("a", timeout=30)
        assert dropped.dropped_chunks == 7
        info = stats_of(c)
        memory = tier(info, "memory")
        assert memory.chunks == 0 and memory.removed_chunks["dropped"] == 7
        assert memory.removed_chunks.get("evicted", 0) == 0


def test_evictions_and_lower_tier_hits_by_tier(make_server, tmp_path, redis_server):
    """Memory evicts, the disk gives back what it holds; a second server that shares
    only Redis finds there what the first wrote."""
    st = make_server(
        store_bytes=4 * MiB,
        disk_dir=str(tmp_path / "disk"),
        remote=redis_server.url,
        remote_lookup_budget=5.0,
    )
    keys = [b"e%02d" % i for i in range(10)]
    with KVCacheClient(st.address) as c:
        evicted = 0
        for i, k in enumerate(keys):  # one at a time: each Store evicts what it must
            evicted += c.put("e", [(k, bytes([i]) * CHUNK)], timeout=10).evicted_chunks

            def landed(n: int = i + 1) -> bool:  # write-behind queues hold 2 chunks here
                info = stats_of(c)
                return tier(info, "disk").written_chunks == tier(info, "redis").written_chunks == n

            wait_for("written behind", landed)
        assert evicted > 0
        info = stats_of(c)
        memory = tier(info, "memory")
        assert memory.removed_chunks["evicted"] == evicted
        assert memory.chunks == 10 - evicted

        # keys[0] was evicted first: memory misses it, the disk gives it back.
        assert c.lookup("e", [keys[0]], timeout=10) == 1
        assert tier(stats_of(c), "disk").lookup_hit_chunks == 1
        assert c.get("e", keys[0], timeout=10) == bytes([0]) * CHUNK
        info = stats_of(c)
        memory, disk = tier(info, "memory"), tier(info, "disk")
        assert (memory.retrieve_asked_chunks, memory.retrieve_hit_chunks) == (1, 0)
        assert (disk.retrieve_asked_chunks, disk.retrieve_hit_chunks) == (1, 1)
        assert disk.read_bytes == CHUNK
        assert tier(info, "redis").retrieve_asked_chunks == 0  # the disk had it

    other = make_server(store_bytes=8 * MiB, remote=redis_server.url, remote_lookup_budget=5.0)
    with KVCacheClient(other.address) as c:
        assert c.lookup("e", keys[:3], timeout=10) == 3
        assert c.get("e", keys[1], timeout=10) == bytes([1]) * CHUNK
        info = stats_of(c)
        assert [t.name for t in info.stats.tiers] == ["memory", "redis"]
        redis = tier(info, "redis")
        assert redis.lookup_hit_chunks == 3
        assert (redis.retrieve_asked_chunks, redis.retrieve_hit_chunks) == (1, 1)
        assert redis.read_bytes == CHUNK
        assert redis.written_chunks == 0  # nothing was stored here


def test_redis_writes_skipped_by_a_full_queue_are_counted_as_queue(make_server, redis_server):
    st = make_server(store_bytes=16 * MiB, remote=redis_server.url, remote_queue_bytes=1 * MiB)
    with KVCacheClient(st.address) as c:
        c.put("q", [(b"q%02d" % i, b"Q" * CHUNK) for i in range(12)], timeout=10)

        def settled() -> bool:
            r = tier(stats_of(c), "redis")
            return r.queued_bytes == 0 and r.written_chunks + sum(r.skipped_writes.values()) == 12

        wait_for("the queue drained", settled)
        redis = tier(stats_of(c), "redis")
        assert set(redis.skipped_writes) == {"queue"}  # never more than 1 MiB queued
        assert redis.skipped_writes["queue"] >= 12 - 2 * (MiB // CHUNK)


# --- the tenant -----------------------------------------------------------------
def tenant_file(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "tenants": {
                    "small": {
                        "tokens": [TOKEN],
                        "namespaces": ["*"],
                        "quota": {"store_share": 0.25, "max_mappings": 1, "max_inflight": 4},
                    },
                    "other": {"tokens": [OTHER], "namespaces": ["*"]},
                }
            }
        )
    )
    return path


def test_a_tenant_sees_its_own_usage_against_its_quota_and_no_other_tenant(
    make_server, tmp_path, shm_dir
):
    st = make_server(auth_token_file=str(tenant_file(tmp_path / "t.json")), store_bytes=8 * MiB)
    with KVCacheClient(st.address, token=OTHER) as other:
        other.put("o", [(b"o1", b"O" * CHUNK)], timeout=10)
    with KVCacheClient(st.address, token=TOKEN) as c:
        # 6 chunks: 3 MiB of an 8 MiB store whose quarter is this tenant's share.
        c.put("n1", [(b"k%d" % i, b"S" * CHUNK) for i in range(4)], timeout=10)
        c.put("n2", [(b"k%d" % i, b"S" * CHUNK) for i in range(2)], timeout=10)
        c.map("ns", [make_cache(shm_dir, "one").rank_region()], timeout=10)
        with pytest.raises(CapacityExhausted):
            c.map("ns", [make_cache(shm_dir, "two").rank_region()], timeout=10)
        info = stats_of(c)
    (mine,) = info.stats.tenants  # only the caller's row
    assert mine.tenant == "small"
    assert mine.share_bytes == 2 * MiB
    assert 6 * CHUNK <= mine.used_bytes < 6 * CHUNK + 64 * KiB  # chunks and their keys
    assert mine.used_bytes > mine.share_bytes  # over its share: evicted from first
    assert mine.namespaces == 2
    assert (mine.mappings, mine.max_mappings) == (1, 1)
    assert (mine.inflight_transfers, mine.max_inflight) == (0, 4)
    assert dict(mine.quota_refusals) == {"max_mappings": 1}
    assert tier(info, "memory").chunks == 7  # the server's totals count every tenant

    result = kvsvc_stats("--target", st.address, "--token-file", str(token_file(tmp_path)))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "small" in out and "other" not in out
    assert f"{mine.used_bytes / mine.share_bytes:.1%}" in out  # 150.x%: over its share
    assert "1 / 1" in out and "max_mappings 1" in out


def token_file(tmp_path: Path, token: str = TOKEN) -> Path:
    path = tmp_path / f"token-{token[:6]}"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


# --- the event stream ------------------------------------------------------------
class Watcher:
    """One WatchEvents stream read on a thread (every read has a timeout)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = pb_grpc.KVCacheServiceStub(self.channel).WatchEvents(
            pb.WatchEventsRequest(), timeout=120
        )
        self.batches: queue.Queue[pb.EventBatch] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.batches.put(response.batch)
        except grpc.RpcError:
            pass  # cancelled by close()

    def snapshot_point(self) -> int:
        while True:
            batch = self.batches.get(timeout=30)
            if batch.snapshot_done:
                return batch.sequence

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
        self.thread.join(10)


def test_watchers_and_how_far_behind_the_furthest_is(make_server):
    # Each stream waits a minute after a batch before it sends the next: what is
    # published meanwhile is exactly its lag.
    st = make_server(events_linger_ms=60_000)
    with KVCacheClient(st.address) as c:
        assert stats_of(c).stats.events.watchers == 0
        watcher = Watcher(st.address)
        try:
            point = watcher.snapshot_point()
            for i in range(3):
                c.put("w", [(b"w%d" % i, b"W" * 1024)], timeout=10)
            wait_for("the watcher is counted", lambda: stats_of(c).stats.events.watchers == 1)
            events = stats_of(c).stats.events
            assert events.last_sequence == events.published_events >= point + 3
            assert events.max_lag_events == events.last_sequence - point
            assert events.resyncing_watchers == 0
            assert events.resyncs == 1  # its first snapshot
            assert events.ring_events == events.published_events  # nothing fell off yet
        finally:
            watcher.close()
        wait_for("the watcher left", lambda: stats_of(c).stats.events.watchers == 0)
        assert stats_of(c).stats.events.max_lag_events == 0


# --- the copy loop and the settings ---------------------------------------------
def test_copy_loop_and_settings_in_force(make_server):
    st = make_server(store_bytes=8 * MiB, transfer_threads=3)
    with KVCacheClient(st.address) as c:
        info = stats_of(c)
        basic = c.server_info(timeout=10)
    assert not basic.HasField("stats")  # the probe clients send stays cheap
    kind, why = copies.copy_loop()
    loop = info.stats.copy_loop
    assert (
        loop.kind == {"native": pb.COPY_LOOP_KIND_NATIVE, "python": pb.COPY_LOOP_KIND_PYTHON}[kind]
    )
    assert loop.reason == why and why
    settings = {s.name: s for s in info.stats.settings}
    assert settings["store_bytes"].value == "8M" and not settings["store_bytes"].is_default
    assert settings["transfer_threads"].value == "3"
    assert settings["log_format"].value == "text" and settings["log_format"].is_default
    assert list(settings) == [s.name for s in settings_in_force(ServerConfig())]


def test_a_password_in_the_remote_url_is_never_shown():
    config = ServerConfig.from_settings(remote="redis://user:hunter2@cache:6379/0")
    (remote,) = [s for s in settings_in_force(config) if s.name == "remote"]
    assert remote.value == "redis://user:***@cache:6379/0"


# --- the command --------------------------------------------------------------------
def test_the_table_and_json_show_the_servers_figures(make_server):
    st = make_server(store_bytes=8 * MiB)
    with KVCacheClient(st.address) as c:
        c.put("t", [(b"t%d" % i, b"T" * CHUNK) for i in range(3)], timeout=10)
        c.lookup("t", [b"t0", b"t1", b"x"], timeout=10)
    result = kvsvc_stats("--target", st.address)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"at {st.address}: serving" in out
    assert "hit rate 66.7% of 3 keys asked" in out
    assert "8.0 MiB" in out and "3 (1.5 MiB)" in out  # capacity; chunks written
    assert "copy loop: " + ("native" if copies.NATIVE is not None else "Python") in out
    assert "--store-bytes" in out and "8M" in out
    as_json = kvsvc_stats("--target", st.address, "--json")
    assert as_json.returncode == 0, as_json.stderr
    reply = json.loads(as_json.stdout)
    memory = reply["stats"]["tiers"][0]
    assert memory["name"] == "memory" and memory["chunks"] == "3"  # uint64 in JSON: a string


def test_watch_refreshes_then_ends_cleanly(make_server):
    st = make_server(store_bytes=8 * MiB)
    result = kvsvc_stats("--target", st.address, "--watch", "--interval", "0.2", "--count", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"at {st.address}: serving") == 2
    assert "lookups/s" in result.stdout  # the second refresh has rates
    assert "Settings in force" not in result.stdout  # unchanging: left out of --watch
    assert result.stderr == ""


def test_watch_ends_cleanly_on_ctrl_c(make_server):
    st = make_server(store_bytes=8 * MiB)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", "stats", "--target", st.address, "--watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the first refresh is out: it is watching
        assert f"at {st.address}" in first
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert proc.stderr is not None and proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--target", "localhost"), "--target localhost: give HOST:PORT"),
        (("--target", "unix:"), "--target unix: needs a path"),
        (("--interval", "0", "--watch"), "--interval 0: must be a positive number"),
        (("--timeout", "nan"), "--timeout nan: must be a positive number"),
        (("--token-file", "/nonexistent/token"), "--token-file /nonexistent/token: cannot read"),
        (("--tls-cert", "/etc/hostname"), "--tls-cert and --tls-key go together"),
        (("--tls-ca", "/nonexistent/ca.pem"), "--tls-ca /nonexistent/ca.pem: cannot read it"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(args, says):
    result = kvsvc_stats(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("kvsvc stats: ") and says in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def test_no_server_or_a_refused_token_is_one_line_and_exit_2(make_server, tmp_path):
    nobody = kvsvc_stats("--target", "127.0.0.1:1", "--timeout", "2")
    assert nobody.returncode == 2
    assert nobody.stderr.startswith("kvsvc stats: 127.0.0.1:1: ServiceUnavailable")
    assert nobody.stderr.count("\n") == 1

    st = make_server(auth_token_file=str(tenant_file(tmp_path / "t.json")))
    for args in ((), ("--token-file", str(token_file(tmp_path, secrets.token_hex(16))))):
        refused = kvsvc_stats("--target", st.address, *args)
        assert refused.returncode == 2
        assert refused.stderr.startswith(f"kvsvc stats: {st.address}: Unauthenticated")
        assert refused.stderr.count("\n") == 1 and refused.stdout == ""


def test_over_mtls_with_a_client_certificate_and_refused_without(make_server, tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    make_ca(pki, "ca")
    make_cert(pki, "ca", "server", "localhost", "DNS:localhost,IP:127.0.0.1")
    make_cert(pki, "ca", "engine", "engine")
    tenants = tmp_path / "t.json"
    tenants.write_text(json.dumps({"tenants": {"small": {"cert_names": ["engine"]}}}))
    st = make_server(
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem"),
        auth_token_file=str(tenants),
    )
    ca = ("--tls-ca", str(pki / "ca.pem"), "--tls-server-name", "localhost")
    cert = ("--tls-cert", str(pki / "engine.pem"), "--tls-key", str(pki / "engine.key"))
    ok = kvsvc_stats("--target", st.address, *ca, *cert, "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["stats"]["tenants"][0]["tenant"] == "small"  # by its cert
    for args in (ca, ()):  # no client certificate; plaintext to a TLS port
        refused = kvsvc_stats("--target", st.address, *args, "--timeout", "3")
        assert refused.returncode == 2
        assert refused.stderr.startswith(f"kvsvc stats: {st.address}: ServiceUnavailable")
        assert refused.stderr.count("\n") == 1 and refused.stdout == ""
