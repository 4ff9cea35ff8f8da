"""The shared remote tier against real redis-server processes: two kvsvc servers
("nodes", separate shm dirs) and one Redis or a three-node Redis Cluster; Redis
killed, restarted, frozen (SIGSTOP); values corrupted or from another layout;
credentials refused."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
import torch
from certs import make_ca, make_cert
from prometheus_client import generate_latest
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_servers import RedisCluster, RedisServer, free_port, require_redis
from support import SERVING, ServerThread, fill_random, health_status, make_cache

from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.server.config import ServerConfig
from kvsvc.server.ops import failpoints
from kvsvc.server.tiers.redis import CLOSED, OPEN, RemoteTier, Resolver, redis_key
from kvsvc.server.tiers.redis import fetch as remote_module

pytestmark = pytest.mark.slow  # starts redis-server and kvsvc servers

# Lookups in these tests may wait this long for Redis: a loaded CI host can take
# far more than the default few ms, and what is checked is the answer.
GENEROUS_BUDGET_S = 5.0


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    r = RedisServer(tmp_path / "redis")
    yield r
    r.kill()


@pytest.fixture
def node(tmp_path: Path) -> Iterator:
    """make(name, remote=URL, **config): a kvsvc server with its own shm dir."""
    started: list[ServerThread] = []

    def make(name: str, remote: str, **changes: object) -> tuple[ServerThread, Path]:
        shm = tmp_path / f"shm-{name}"
        shm.mkdir()
        config = ServerConfig.from_settings(
            listen="127.0.0.1:0",
            store_bytes=64 << 20,
            shm_dir=str(shm),
            remote=remote,
            remote_lookup_budget=GENEROUS_BUDGET_S,
        )
        st = ServerThread(config.replace(**changes))
        started.append(st)
        return st, shm

    yield make
    for st in started:
        st.stop()


def tier(st: ServerThread) -> RemoteTier:
    remote = st.server.servicer.tiers.named("redis")
    assert remote is not None
    return remote


def wait_for(what: str, cond, limit: float = 30.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, f"not within {limit} s: {what}"
        time.sleep(0.02)


def blocks(cache: SharedKVCache, ids: list[int]) -> list[torch.Tensor]:
    return [
        layer.index_select(cache.block_dim, torch.tensor(ids)).clone() for layer in cache.layers
    ]


def chunk_list(n: int) -> list[tuple[bytes, list[int]]]:
    """n chunks of 1 block each over a 12-block cache (block i % 12)."""
    return [(b"chunk-%03d" % i, [i % 12]) for i in range(n)]


# --- two nodes, one Redis -------------------------------------------------------
def test_two_nodes_share_chunks_through_one_redis(node, redis_server) -> None:
    a, shm_a = node("a", redis_server.url)
    b, shm_b = node("b", redis_server.url)
    src = make_cache(shm_a, "src", seed=1)
    dst = make_cache(shm_b, "dst")
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ma = ca.map("llama", [src.rank_region()])
        mb = cb.map("llama", [dst.rank_region()])
        assert ma.layout_fingerprint == mb.layout_fingerprint
        chunks = [(b"k1", [0, 1, 2]), (b"k2", [7, 3]), (b"k3", [11])]
        assert ca.store(ma, chunks).stored_chunks == 3
        ca.put("docs", [(b"inline-1", b"hello from node a")])
        wait_for("node a wrote 4 chunks to Redis", lambda: tier(a).writes == 4)

        # Node B has nothing locally: Lookup finds the chunks in Redis, and the
        # prefix stops at the first key neither tier holds.
        assert cb.server_info().stored_chunks == 0
        assert cb.lookup([b"k1", b"k2", b"k3", b"nope", b"k1"], mapping=mb) == 3
        r = cb.retrieve(mb, [(b"k1", [4, 5, 6]), (b"k2", [8, 9]), (b"k3", [10]), (b"nope", [0])])
        assert r.loaded_chunks == 3
        assert all(
            torch.equal(x, y)
            for x, y in zip(
                blocks(src, [0, 1, 2, 7, 3, 11]), blocks(dst, [4, 5, 6, 8, 9, 10]), strict=True
            )
        )
        assert tier(b).hits == 3 and tier(b).misses == 1
        # They are local on B now: a second Retrieve does not ask Redis.
        assert cb.server_info().stored_chunks == 3
        assert cb.get("docs", b"inline-1") == b"hello from node a"
        assert cb.lookup([b"inline-1"], namespace="docs") == 1
        assert tier(b).hits == 4
        assert health_status(b.address) == SERVING

        text = generate_latest(b.server.servicer.metrics.registry).decode()
        assert 'kvsvc_tier_hits_total{tier="redis"} 4.0' in text
        assert "kvsvc_remote_breaker_state 0.0" in text


def test_namespaces_and_layouts_never_collide(node, redis_server) -> None:
    a, shm_a = node("a", redis_server.url)
    b, shm_b = node("b", redis_server.url)
    src = make_cache(shm_a, "src", seed=2)
    other = make_cache(shm_b, "other", dtype=torch.float16)  # another layout
    same = make_cache(shm_b, "same")
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ca.store(ca.map("llama", [src.rank_region()]), [(b"k", [0])])
        wait_for("written", lambda: tier(a).writes == 1)
        assert cb.lookup([b"k"], mapping=cb.map("llama", [other.rank_region()])) == 0
        assert cb.lookup([b"k"], mapping=cb.map("mistral", [same.rank_region()])) == 0
        assert cb.lookup([b"k"], mapping=cb.map("llama", [same.rank_region()])) == 1


# --- Redis Cluster --------------------------------------------------------------
def test_cluster_round_trip_spreads_keys_over_all_shards(node, tmp_path) -> None:
    require_redis()
    cluster = RedisCluster(tmp_path / "cluster")
    try:
        # 1 MiB values: the 3 MiB inline chunk below is split into parts.
        a, shm_a = node("a", cluster.url, remote_value_bytes=1 << 20)
        b, shm_b = node("b", cluster.url, remote_value_bytes=1 << 20)
        src = make_cache(shm_a, "src", seed=3)
        dst = make_cache(shm_b, "dst")
        big = torch.randint(
            0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)
        )
        with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
            ma = ca.map("llama", [src.rank_region()])
            mb = cb.map("llama", [dst.rank_region()])
            chunks = chunk_list(24)
            assert ca.store(ma, chunks).stored_chunks == 24
            ca.put("docs", [(b"big", big.numpy().tobytes())])
            wait_for("25 chunks written", lambda: tier(a).writes == 25)
            sizes = [int(n.cli("dbsize").strip()) for n in cluster.nodes]
            assert all(s > 0 for s in sizes), f"keys per shard: {sizes}"
            assert sum(sizes) == 24 + 4  # the big chunk is 4 values: header part + 3

            assert cb.lookup([k for k, _ in chunks], mapping=mb) == 24
            # 12 target blocks: retrieve the first 12 chunks into blocks 11..0.
            r = cb.retrieve(mb, [(k, [11 - i]) for i, (k, _) in enumerate(chunks[:12])])
            assert r.loaded_chunks == 12
            assert all(
                torch.equal(x, y)
                for x, y in zip(
                    blocks(src, list(range(12))), blocks(dst, list(range(11, -1, -1))), strict=True
                )
            )
            assert cb.get("docs", b"big") == big.numpy().tobytes()
            assert tier(b).rejected == {} and tier(b).errors == {}
    finally:
        cluster.kill()


# --- Redis down, frozen, back ---------------------------------------------------
def test_redis_killed_then_restarted(node, redis_server) -> None:
    a, shm_a = node("a", redis_server.url, remote_timeout=0.5)
    b, shm_b = node("b", redis_server.url, remote_timeout=0.5)
    src = make_cache(shm_a, "src", seed=5)
    dst = make_cache(shm_b, "dst")
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ma = ca.map("llama", [src.rank_region()])
        mb = cb.map("llama", [dst.rank_region()])
        ca.store(ma, [(b"before", [0])])
        wait_for("written", lambda: tier(a).writes == 1)
        cb.retrieve(mb, [(b"before", [0])])  # now local on B too
        port = redis_server.port
        redis_server.kill()

        # Answers from the local tier, within deadlines far below a hang.
        for _ in range(5):
            t0 = time.monotonic()
            assert cb.lookup([b"before", b"after"], mapping=mb, timeout=10) == 1
            assert cb.retrieve(mb, [(b"before", [1]), (b"x", [2])], timeout=10).loaded_chunks == 1
            assert time.monotonic() - t0 < 8
        # Writes are dropped and counted; Stores still answer.
        for i in range(4):
            assert ca.store(ma, [(b"dead-%d" % i, [i + 1])], timeout=10).stored_chunks == 1
        wait_for("dropped writes counted", lambda: tier(a).dropped_writes >= 4)
        assert tier(a).errors.get("connection", 0) >= 1
        assert tier(b).errors.get("connection", 0) + tier(b).errors.get("breaker_open", 0) >= 1
        assert health_status(a.address) == SERVING and health_status(b.address) == SERVING

        # Back on the same port: the tier resumes by itself (the breaker probes).
        redis_server.start(port)
        i = 0

        def stored_after_restart() -> bool:
            nonlocal i
            i += 1
            ca.store(ma, [(b"after-%d" % i, [i % 12])])
            time.sleep(0.1)
            return tier(a).writes >= 2

        wait_for("a write reached the restarted Redis", stored_after_restart)
        wait_for("breaker closed", lambda: tier(a).breaker.state == CLOSED)
        key = b"after-%d" % i
        wait_for(
            "B reads the new chunk",
            lambda: cb.retrieve(mb, [(key, [5])]).loaded_chunks == 1,
        )


def test_redis_that_never_answers_is_bounded_and_opens_the_breaker(node, redis_server) -> None:
    a, shm_a = node("a", redis_server.url, remote_timeout=0.3, remote_lookup_budget=0.2)
    src = make_cache(shm_a, "src", seed=6)
    with KVCacheClient(a.address) as ca:
        ma = ca.map("llama", [src.rank_region()])
        ca.store(ma, [(b"local", [0])])
        wait_for("written", lambda: tier(a).writes == 1)
        redis_server.stop_process()  # accepts connections, never answers
        try:
            for i in range(6):
                t0 = time.monotonic()
                # Lookup: its budget; Retrieve: the socket timeout, never the deadline.
                assert ca.lookup([b"local", b"missing-%d" % i], mapping=ma, timeout=10) == 1
                r = ca.retrieve(ma, [(b"local", [1]), (b"missing-%d" % i, [2])], timeout=10)
                assert r.loaded_chunks == 1
                assert time.monotonic() - t0 < 8
                stored = ca.store(ma, [(b"frozen-%d" % i, [3 + i])], timeout=10)
                assert stored.stored_chunks == 1
            wait_for("breaker open", lambda: tier(a).breaker.state == OPEN)
            errors = tier(a).errors
            assert errors.get("timeout", 0) + errors.get("budget", 0) >= 1
            # Open: no call reaches Redis, so a Retrieve does not even wait the timeout.
            t0 = time.monotonic()
            assert ca.retrieve(ma, [(b"missing-x", [2])], timeout=10).loaded_chunks == 0
            assert tier(a).errors.get("breaker_open", 0) >= 1
            assert health_status(a.address) == SERVING
            text = generate_latest(a.server.servicer.metrics.registry).decode()
            assert "kvsvc_remote_breaker_state 1.0" in text
        finally:
            redis_server.continue_process()
        # Answering again: the next probe closes the breaker.
        wait_for(
            "breaker closed after SIGCONT",
            lambda: ca.lookup([b"probe"], mapping=ma) >= 0 and tier(a).breaker.state == CLOSED,
        )


def test_lookup_on_a_kept_link_is_bounded_by_its_budget_then_by_the_timeout(
    node, redis_server
) -> None:
    """Lookup's EXISTS on the connection the tier keeps: with Redis frozen, the
    Lookup answers from the local tier at its budget (counted), the exchange goes
    on until --remote-timeout (counted, fed to the breaker) and its connection is
    closed, never reused mid-reply; Redis thawed, Lookups find the keys again."""
    a, shm_a = node("a", redis_server.url)
    b, shm_b = node("b", redis_server.url, remote_timeout=5.0, remote_lookup_budget=0.3)
    src = make_cache(shm_a, "src", seed=9)
    keys = [b"lk-%d" % i for i in range(4)]
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ma = ca.map("llama", [src.rank_region()])
        mb = cb.map("llama", [make_cache(shm_b, "dst").rank_region()])
        ca.store(ma, [(k, [i]) for i, k in enumerate(keys)])
        wait_for("written", lambda: tier(a).writes == 4)
        assert cb.lookup(keys, mapping=mb, timeout=10) == 4  # one round trip, in Redis only
        links = list(tier(b)._links)
        assert len(links) == 1 and not links[0].closed  # kept for the next Lookup
        redis_server.stop_process()
        try:
            t0 = time.monotonic()
            assert cb.lookup(keys, mapping=mb, timeout=10) == 0  # none local
            took = time.monotonic() - t0
            assert took < 4.0, took  # the budget (0.3 s) ended it, not the timeout (5 s)
            assert tier(b).errors.get("budget", 0) == 1
            assert links[0] not in tier(b)._links  # busy: not lent to another Lookup
            wait_for("the exchange timed out", lambda: tier(b).errors.get("timeout", 0) == 1)
            assert links[0].closed and tier(b)._asking == 0
        finally:
            redis_server.continue_process()
        assert cb.lookup(keys, mapping=mb, timeout=10) == 4  # a new link; the old one is gone
        assert health_status(b.address) == SERVING


def test_full_write_queue_drops_and_counts_never_blocks(node, redis_server) -> None:
    # A queue smaller than one chunk: every write-behind is dropped at once.
    a, shm_a = node("a", redis_server.url, remote_queue_bytes=1024)
    src = make_cache(shm_a, "src", seed=7)
    with KVCacheClient(a.address) as ca:
        ma = ca.map("llama", [src.rank_region()])
        assert ca.store(ma, chunk_list(5)).stored_chunks == 5
        assert tier(a).dropped_writes == 5 and tier(a).writes == 0
        assert redis_server.cli("dbsize").strip() == "0"
        text = generate_latest(a.server.servicer.metrics.registry).decode()
        assert "kvsvc_remote_dropped_writes_total 5.0" in text


# --- values that are not the chunk ----------------------------------------------
def test_corrupted_and_foreign_values_are_misses_never_loaded(node, redis_server, tmp_path) -> None:
    a, shm_a = node("a", redis_server.url)
    b, shm_b = node("b", redis_server.url)
    src = make_cache(shm_a, "src", seed=8)
    other = make_cache(shm_a, "other", dtype=torch.float16, seed=9)
    dst = make_cache(shm_b, "dst")
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ma = ca.map("llama", [src.rank_region()])
        mo = ca.map("llama", [other.rank_region()])
        mb = cb.map("llama", [dst.rank_region()])
        ca.store(ma, [(b"good", [0]), (b"bitflip", [1]), (b"garbage", [2])])
        ca.store(mo, [(b"foreign", [3])])
        wait_for("written", lambda: tier(a).writes == 4)

        def rkey(key: bytes, fp: str) -> bytes:
            return redis_key("kvsvc", "llama", fp, key)

        raw = redis.Redis(port=redis_server.port)
        try:
            # One data byte flipped, written back with redis-cli.
            value = bytearray(raw.get(rkey(b"bitflip", ma.layout_fingerprint)) or b"")
            value[-10] ^= 0xFF
            (tmp_path / "v").write_bytes(bytes(value))
            redis_server.cli(
                "-x", "set", rkey(b"bitflip", ma.layout_fingerprint).decode(), stdin=bytes(value)
            )
            redis_server.cli(
                "set", rkey(b"garbage", ma.layout_fingerprint).decode(), "not a kvsvc value"
            )
            # A value of the float16 layout under this layout's key.
            foreign = raw.get(rkey(b"foreign", mo.layout_fingerprint))
            assert foreign is not None
            raw.set(rkey(b"foreign", ma.layout_fingerprint), foreign)
        finally:
            raw.close()

        dst_before = blocks(dst, list(range(12)))
        for key, kind in ((b"bitflip", "checksum"), (b"garbage", "header"), (b"foreign", "layout")):
            assert cb.retrieve(mb, [(key, [5])]).loaded_chunks == 0
            assert tier(b).rejected.get(kind) == 1, tier(b).rejected
        assert all(
            torch.equal(x, y) for x, y in zip(dst_before, blocks(dst, list(range(12))), strict=True)
        )
        assert cb.server_info().stored_chunks == 0  # never loaded into the store
        assert cb.retrieve(mb, [(b"good", [5])]).loaded_chunks == 1
        assert health_status(b.address) == SERVING


# --- grouped fetches -----------------------------------------------------------
def test_grouped_fetch_loads_the_valid_prefix_only(node, redis_server, monkeypatch) -> None:
    """Replies are copied in by groups while the next ones are read; a value of the
    second group that fails its checksum ends the prefix: the chunks before it are
    loaded, it and every later one (valid or not) are not."""
    a, shm_a = node("a", redis_server.url)
    b, shm_b = node("b", redis_server.url)
    src = make_cache(shm_a, "src", seed=11)
    dst = make_cache(shm_b, "dst")
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ma = ca.map("llama", [src.rank_region()])
        mb = cb.map("llama", [dst.rank_region()])
        chunks = [(b"g-%d" % i, [i]) for i in range(6)]
        assert ca.store(ma, chunks).stored_chunks == 6
        wait_for("written", lambda: tier(a).writes == 6)
        size = tier(a).bytes_written // 6  # one chunk
        monkeypatch.setattr(remote_module, "REMOTE_FETCH_GROUP_BYTES", 2 * size)
        groups: list[int] = []
        copy_in = RemoteTier._copy_in

        def counted(self: RemoteTier, pairs: list) -> list[bool]:
            groups.append(len(pairs))
            return copy_in(self, pairs)

        monkeypatch.setattr(RemoteTier, "_copy_in", counted)
        rkey = redis_key("kvsvc", "llama", ma.layout_fingerprint, b"g-3")
        raw = redis.Redis(port=redis_server.port)
        try:
            value = bytearray(raw.get(rkey) or b"")
            value[-1] ^= 0xFF
            raw.set(rkey, bytes(value))
        finally:
            raw.close()

        dst_before = blocks(dst, list(range(12)))
        r = cb.retrieve(mb, [(k, [ids[0] + 6]) for k, ids in chunks])
        assert r.loaded_chunks == 3
        assert groups[:2] == [2, 2], groups  # two groups of two, each copied on its own
        assert tier(b).rejected == {"checksum": 1}
        assert cb.server_info().stored_chunks == 3  # g-4 and g-5 are valid but not loaded
        assert all(
            torch.equal(x, y)
            for x, y in zip(blocks(src, [0, 1, 2]), blocks(dst, [6, 7, 8]), strict=True)
        )
        assert all(  # blocks of the chunks not loaded are untouched
            torch.equal(x, y)
            for x, y in zip(
                blocks(dst, [9, 10, 11]),
                [t.index_select(dst.block_dim, torch.tensor([9, 10, 11])) for t in dst_before],
                strict=True,
            )
        )
        assert tier(b).hits == 3 and tier(b).misses == 3
        assert health_status(b.address) == SERVING


def big_cache(shm: Path, name: str, seed: int | None = None) -> SharedKVCache:
    """16 blocks of 2 MiB (4 layers of 512 KiB): values larger than a socket buffer."""
    cache = SharedKVCache(name, num_layers=4, num_blocks=16, block_size=128, kv_heads=8,
                          head_dim=128, shm_dir=str(shm))  # fmt: skip
    if seed is not None:
        fill_random(cache, seed)
    return cache


@dataclass
class TwoNodes:
    """Node A stored 16 big chunks (written behind to Redis); node B maps an empty cache."""

    b: ServerThread
    cb: KVCacheClient
    mb: Any
    src: SharedKVCache
    dst: SharedKVCache
    chunks: list[tuple[bytes, list[int]]]


@contextlib.contextmanager
def sixteen_in_redis(
    node, redis_server, tag: str, seed: int, remote_timeout: float
) -> Iterator[TwoNodes]:
    a, shm_a = node("a", redis_server.url, store_bytes=128 << 20, remote_timeout=remote_timeout)
    b, shm_b = node("b", redis_server.url, remote_timeout=remote_timeout)
    src, dst = big_cache(shm_a, "src", seed=seed), big_cache(shm_b, "dst")
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        ma = ca.map("llama", [src.rank_region()])
        mb = cb.map("llama", [dst.rank_region()])
        chunks = [(b"%s-%02d" % (tag.encode(), i), [i]) for i in range(16)]
        for half in (chunks[:8], chunks[8:]):  # within A's write queue (a quarter of 128 MiB)
            written = tier(a).writes
            assert ca.store(ma, half).stored_chunks == 8
            wait_for("written", lambda w=written: tier(a).writes == w + 8)
        yield TwoNodes(b, cb, mb, src, dst, chunks)


def after_the_first_group(monkeypatch, action: Callable[[], None]) -> threading.Event:
    """A fetch group per value; ``action`` runs on the reader thread once the first
    group was handed over, before it reads more (the returned event is then set)."""
    monkeypatch.setattr(remote_module, "REMOTE_FETCH_GROUP_BYTES", 1)
    deliver = remote_module._Fetch.deliver
    done = threading.Event()

    def deliver_then_act(self, values: list) -> None:
        deliver(self, values)
        if values and not done.is_set():
            done.set()
            action()

    monkeypatch.setattr(remote_module._Fetch, "deliver", deliver_then_act)
    return done


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_redis_lost_during_a_grouped_fetch_answers_in_time(
    node, redis_server, monkeypatch, how: str
) -> None:
    """Redis killed (or frozen: SIGSTOP) while a Retrieve reads its replies, after the
    first group was handed over: the Retrieve answers within its deadline with a
    bit-exact prefix (at least that group), the failure is counted, the health does
    not change, and the connection is not reused mid-reply."""

    def lose() -> None:
        if how == "killed":
            redis_server.kill()
        else:
            redis_server.stop_process()

    with sixteen_in_redis(node, redis_server, "big", 12, remote_timeout=1.0) as n:
        b, cb, mb, src, dst, chunks = n.b, n.cb, n.mb, n.src, n.dst, n.chunks
        lost = after_the_first_group(monkeypatch, lose)
        try:
            t0 = time.monotonic()
            r = cb.retrieve(mb, [(k, ids) for k, ids in chunks], timeout=10)
            took = time.monotonic() - t0
        finally:
            if how == "frozen":
                redis_server.continue_process()
        assert lost.is_set()
        assert took < 8, took
        # Only what the kernel had buffered can follow the first value: never all 16.
        assert 1 <= r.loaded_chunks < 16, r.loaded_chunks
        n = r.loaded_chunks
        assert all(
            torch.equal(x, y)
            for x, y in zip(blocks(src, list(range(n))), blocks(dst, list(range(n))), strict=True)
        )
        assert cb.server_info().stored_chunks == n
        assert all(  # the blocks of the chunks not loaded were never written
            not x.any() for x in blocks(dst, list(range(n, 16)))
        )
        errors = tier(b).errors
        assert errors.get("connection", 0) + errors.get("timeout", 0) >= 1, errors
        assert health_status(b.address) == SERVING


def test_blocks_are_loaded_group_by_group_while_later_ones_are_read(
    node, redis_server, monkeypatch
) -> None:
    """A Retrieve from Redis starts copying each committed group into the engine's
    blocks while later replies are still to come: with Redis frozen after the first
    group, that group's blocks are already loaded (bit-exact) and the copy is one
    transfer in flight (Fence would wait for it);
    Redis thawed, the Retrieve loads every chunk bit-exact."""
    with sixteen_in_redis(node, redis_server, "grp", 13, remote_timeout=30.0) as n:
        b, cb, mb, src, dst, chunks = n.b, n.cb, n.mb, n.src, n.dst, n.chunks
        frozen = after_the_first_group(monkeypatch, redis_server.stop_process)
        engine = b.server.servicer.engine
        out: list = []
        retrieving = threading.Thread(
            target=lambda: out.append(cb.retrieve(mb, chunks, timeout=60)), daemon=True
        )
        try:
            retrieving.start()
            wait_for("Redis frozen", frozen.is_set)
            # The Retrieve cannot end while Redis is frozen (its budget is 30 s):
            # the first group is in the blocks already.
            wait_for(
                "the first group in the blocks",
                lambda: all(
                    torch.equal(x, y)
                    for x, y in zip(blocks(src, [0]), blocks(dst, [0]), strict=True)
                ),
            )
            assert not out
            running = [t for t in list(engine.inflight.values()) if t.mapping_id == mb.mapping_id]
            assert len(running) == 1 and running[0].started_at > 0
        finally:
            redis_server.continue_process()
        retrieving.join(60)
        assert out and out[0].loaded_chunks == 16, out
        assert all(
            torch.equal(x, y)
            for x, y in zip(blocks(src, list(range(16))), blocks(dst, list(range(16))), strict=True)
        )
        assert not engine.inflight
        assert tier(b).hits == 16 and health_status(b.address) == SERVING


# --- credentials ----------------------------------------------------------------
def serve(shm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`kvsvc serve` that must exit by itself (it is refused at start-up)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsvc",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--shm-dir",
            str(shm),
            "--store-bytes",
            "16M",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_wrong_or_missing_password_is_one_error_at_start_up(tmp_path, node) -> None:
    require_redis()
    r = RedisServer(tmp_path / "redis", password="s3cret-pass")
    try:
        shm = tmp_path / "shm"
        shm.mkdir()
        wrong = tmp_path / "wrong"
        wrong.write_text("not-it\n")
        for extra in (["--remote-password-file", str(wrong)], []):
            done = serve(shm, "--remote", r.url, *extra)
            assert done.returncode == 2, done.stderr
            lines = [ln for ln in done.stderr.splitlines() if ln.startswith("kvsvc serve:")]
            assert len(lines) == 1 and "Redis refused the credentials" in lines[0], done.stderr
            assert "s3cret" not in done.stderr and "not-it" not in done.stderr
        # A password on the command line is refused before anything starts.
        done = serve(shm, "--remote", f"redis://user:s3cret-pass@127.0.0.1:{r.port}")
        assert done.returncode == 2 and "--remote-password-file" in done.stderr
        assert "s3cret" not in done.stderr

        good = tmp_path / "good"
        good.write_text("s3cret-pass\n")
        a, _ = node("a", r.url, remote_password_file=str(good))
        with KVCacheClient(a.address) as ca:
            ca.put("ns", [(b"k", b"v")])
            wait_for("written with the password", lambda: tier(a).writes == 1)
    finally:
        r.kill()


def test_unreachable_redis_at_start_up_still_serves(node) -> None:
    require_redis()

    a, _shm_a = node("a", f"redis://127.0.0.1:{free_port()}", remote_timeout=0.3)
    with KVCacheClient(a.address) as ca:
        ca.put("ns", [(b"k", b"v")])
        assert ca.get("ns", b"k") == b"v"
        assert ca.lookup([b"k", b"other"], namespace="ns") == 1
    assert health_status(a.address) == SERVING
    assert tier(a).errors.get("connection", 0) >= 1


def data_path_settings(remote: RemoteTier) -> list[tuple[int, float | None, float | None]]:
    """(retries, socket timeout, connect timeout) of every connection the tier's clients
    would open: the sync client (reads and writes on threads) and the asyncio one
    (Lookup on the loop), and each cluster node's pool."""
    client = remote._redis()
    if isinstance(client, redis.RedisCluster):
        pools = [n.redis_connection.connection_pool for n in client.get_nodes()]
        out = [(client.retry.get_retries(), None, None)]
    else:
        pools, out = [client.connection_pool], []
    for pool in pools:
        conn = pool.make_connection()
        out.append((conn.retry.get_retries(), conn.socket_timeout, conn.socket_connect_timeout))
        conn.disconnect()
    return out


def async_settings(st: ServerThread) -> list[tuple[int, float | None, float | None]]:
    """The same for the asyncio client, made on the server's loop as Lookup makes it."""
    remote = tier(st)

    async def read() -> list[tuple[int, float | None, float | None]]:
        client = remote._aredis()
        out: list[tuple[int, float | None, float | None]]
        if isinstance(client, aredis.RedisCluster):
            await client.initialize()
            out = [(client.retry.get_retries(), None, None)]
            nodes = client.get_nodes()
            conns = [n.acquire_connection() for n in nodes]
            for n, conn in zip(nodes, conns, strict=True):
                n.release(conn)
        else:
            out = [(-1, None, None)]  # no client-level retry: the connections' own
            conns = [client.connection_pool.make_connection()]
        for conn in conns:
            out.append((conn.retry.get_retries(), conn.socket_timeout, conn.socket_connect_timeout))
        return out

    return asyncio.run_coroutine_threadsafe(read(), remote.loop).result(30)


def test_every_redis_connection_has_timeouts_and_no_retries(node, redis_server, tmp_path) -> None:
    # redis-py's default Retry turns a dead Redis into seconds per call.
    a, _ = node("a", redis_server.url, remote_timeout=0.25)
    assert data_path_settings(tier(a)) == [(0, 0.25, 0.25)]
    assert async_settings(a) == [(-1, None, None), (0, 0.25, 0.25)]
    cluster = RedisCluster(tmp_path / "cluster")
    try:
        c, _ = node("c", cluster.url, remote_timeout=0.25)
        settings = data_path_settings(tier(c))
        assert settings[0][0] == 0
        assert settings[1:] == [(0, 0.25, 0.25)] * 3
        settings = async_settings(c)
        assert settings[0][0] == 0
        assert settings[1:] == [(0, 0.25, 0.25)] * 3
    finally:
        cluster.kill()


def test_ttl_and_prefix_are_applied_to_every_value(node, redis_server) -> None:
    a, _ = node(
        "a", redis_server.url, remote_ttl=300, remote_prefix="team1", remote_value_bytes=1 << 20
    )
    with KVCacheClient(a.address) as ca:
        ca.put("ns", [(b"small", b"x" * 100), (b"split", b"y" * (2 << 20))])
        wait_for("written", lambda: tier(a).writes == 2)
    keys = redis_server.cli("--scan").split()
    assert len(keys) == 1 + 3  # the split chunk is a header part and two more
    assert all(k.startswith("team1:") for k in keys), keys
    ttls = [int(redis_server.cli("ttl", k).strip()) for k in keys]
    assert all(0 < t <= 300 for t in ttls), ttls


# --- TLS (rediss://) and ACL users ------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a Redis server certificate for 127.0.0.1, a client certificate, and a CA
    that signed neither."""
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "ca", "server", "localhost", "DNS:localhost,IP:127.0.0.1")
    make_cert(d, "ca", "client", "kvsvc")
    return d


def tls_files(pki: Path, ca: str = "ca") -> dict[str, str]:
    return {
        "remote_tls_ca": str(pki / f"{ca}.pem"),
        "remote_tls_cert": str(pki / "client.pem"),
        "remote_tls_key": str(pki / "client.key"),
    }


def test_tls_redis_round_trip_with_ca_and_client_certificate(node, pki, tmp_path) -> None:
    require_redis()
    r = RedisServer(tmp_path / "redis", tls=pki)  # TLS only, client certificates required
    try:
        assert r.url.startswith("rediss://")
        with pytest.raises(redis.ConnectionError):  # nothing answers in plaintext
            redis.Redis(port=r.port, socket_timeout=2, retry=Retry(NoBackoff(), 0)).ping()
        a, shm_a = node("a", r.url, **tls_files(pki))
        b, shm_b = node("b", r.url, **tls_files(pki))
        src = make_cache(shm_a, "src", seed=11)
        dst = make_cache(shm_b, "dst")
        with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
            ma = ca.map("llama", [src.rank_region()])
            mb = cb.map("llama", [dst.rank_region()])
            assert ca.store(ma, [(b"t1", [0, 1]), (b"t2", [2])]).stored_chunks == 2
            wait_for("written over TLS", lambda: tier(a).writes == 2)
            # Lookup (asyncio, on the loop) and Retrieve (threads), both over TLS.
            assert cb.lookup([b"t1", b"t2", b"t3"], mapping=mb) == 2
            assert cb.retrieve(mb, [(b"t1", [5, 6]), (b"t2", [7])]).loaded_chunks == 2
            assert all(
                torch.equal(x, y)
                for x, y in zip(blocks(src, [0, 1, 2]), blocks(dst, [5, 6, 7]), strict=True)
            )
            assert tier(a).errors == {} and tier(b).errors == {}
        assert int(r.cli("dbsize").strip()) == 2
    finally:
        r.kill()


def test_tls_certificate_refused_or_missing(node, pki, tmp_path) -> None:
    require_redis()
    r = RedisServer(tmp_path / "redis", tls=pki)
    try:
        shm = tmp_path / "shm"
        shm.mkdir()
        # A CA that did not sign Redis' certificate: one error at start-up, exit 2
        # (it will not heal by itself).
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in tls_files(pki, "other-ca").items()]
        done = serve(shm, "--remote", r.url, *flags)
        assert done.returncode == 2, done.stderr
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("kvsvc serve:")]
        assert len(lines) == 1 and "TLS certificate did not verify" in lines[0], done.stderr
        # TLS files without rediss:// are refused before anything starts.
        done = serve(shm, "--remote", f"redis://127.0.0.1:{r.port}", "--remote-tls-ca",
                     str(pki / "ca.pem"))  # fmt: skip
        assert done.returncode == 2 and "rediss://" in done.stderr, done.stderr

        # No client certificate (Redis asks for one): degraded, counted, still serving.
        a, _ = node("a", r.url, remote_tls_ca=str(pki / "ca.pem"), remote_timeout=1.0)
        with KVCacheClient(a.address) as ca:
            ca.put("ns", [(b"k", b"v")])
            assert ca.lookup([b"k", b"x"], namespace="ns") == 1
            wait_for("write dropped", lambda: tier(a).dropped_writes == 1)
        assert health_status(a.address) == SERVING
        errors = tier(a).errors
        assert errors.get("tls", 0) + errors.get("connection", 0) >= 1, errors
        assert tier(a).writes == 0
    finally:
        r.kill()


def test_acl_user_name_in_the_url_password_from_the_file(node, tmp_path) -> None:
    require_redis()
    # An ACL user; the default user is off, so every call kvsvc makes needs it.
    r = RedisServer(tmp_path / "redis", user="kv-writer", password="acl-pass-1")
    try:
        assert r.url.startswith("redis://kv-writer@")
        shm = tmp_path / "shm"
        shm.mkdir()
        wrong = tmp_path / "wrong"
        wrong.write_text("acl-pass-2\n")
        done = serve(shm, "--remote", r.url, "--remote-password-file", str(wrong))
        assert done.returncode == 2, done.stderr
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("kvsvc serve:")]
        assert len(lines) == 1 and "Redis refused the credentials" in lines[0], done.stderr
        assert "acl-pass" not in done.stderr

        good = tmp_path / "good"
        good.write_text("acl-pass-1\n")
        a, _ = node("a", r.url, remote_password_file=str(good))
        b, _ = node("b", r.url, remote_password_file=str(good))
        with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
            ca.put("ns", [(b"k", b"v")])
            wait_for("written as the ACL user", lambda: tier(a).writes == 1)
            assert cb.lookup([b"k"], namespace="ns") == 1  # asyncio client, same user
            assert cb.get("ns", b"k") == b"v"  # sync client, same user
        users = {
            field.split("=", 1)[1]
            for line in r.cli("client", "list").splitlines()
            for field in line.split()
            if field.startswith("user=")
        }
        assert users <= {"kv-writer"}, users
    finally:
        r.kill()


# --- host names: DNS that fails or never answers ------------------------------------
def test_unresolvable_host_name_is_a_counted_miss(node) -> None:
    a, _ = node("a", "redis://kvsvc-no-such-host.invalid:6379", remote_timeout=0.3)
    with KVCacheClient(a.address) as ca:
        ca.put("ns", [(b"k", b"v")])
        assert ca.lookup([b"k", b"other"], namespace="ns", timeout=10) == 1
        assert ca.get("ns", b"k") == b"v"
        wait_for("write dropped", lambda: tier(a).dropped_writes == 1)
    assert health_status(a.address) == SERVING
    assert tier(a).errors.get("dns", 0) >= 1, tier(a).errors
    text = generate_latest(a.server.servicer.metrics.registry).decode()
    assert 'kvsvc_remote_errors_total{kind="dns"}' in text


def test_dns_that_never_answers_bounds_start_up_and_every_call(node, redis_server) -> None:
    # The lookup of "localhost" takes 30 s (a DNS server that does not answer):
    # start-up, Lookup, Retrieve and Store all answer far sooner, from the local store.
    failpoints.load("remote.resolve=sleep(30000)")
    try:
        t0 = time.monotonic()
        a, shm_a = node("a", f"redis://localhost:{redis_server.port}", remote_timeout=0.3)
        assert time.monotonic() - t0 < 20
        src = make_cache(shm_a, "src", seed=12)
        with KVCacheClient(a.address) as ca:
            ma = ca.map("llama", [src.rank_region()])
            for i in range(3):
                t0 = time.monotonic()
                assert ca.store(ma, [(b"s-%d" % i, [i])], timeout=15).stored_chunks == 1
                assert ca.lookup([b"s-0", b"far-%d" % i], mapping=ma, timeout=15) == 1
                r = ca.retrieve(ma, [(b"s-0", [5]), (b"far-%d" % i, [6])], timeout=15)
                assert r.loaded_chunks == 1
                assert time.monotonic() - t0 < 15
            wait_for("writes dropped", lambda: tier(a).dropped_writes == 3)
        assert tier(a).writes == 0 and tier(a).errors.get("dns", 0) >= 3, tier(a).errors
        assert health_status(a.address) == SERVING
        assert redis_server.cli("dbsize").strip() == "0"
    finally:
        failpoints.load("")


def test_a_late_dns_answer_lets_calls_resume() -> None:
    failpoints.load("remote.resolve=sleep(1000)")
    try:
        resolver = Resolver("redis://localhost:6379", timeout=0.2)
        assert resolver.needed and not resolver.first()  # not within --remote-timeout
        assert not resolver.usable()
        wait_for("the late answer", resolver.usable)
    finally:
        failpoints.load("")
    assert not Resolver("redis://127.0.0.1:6379", timeout=0.2).needed
    assert not Resolver("rediss+cluster://[::1]:7000", timeout=0.2).needed


# --- memory for values read from Redis ------------------------------------------
_FAULTS_SCRIPT = """
import asyncio, resource, sys
from kvsvc.server.config import ServerConfig
from kvsvc.server.tiers.redis import RemoteTier
from kvsvc.server.data.store import ChunkStore

config = ServerConfig.from_settings(remote=sys.argv[1])
tier = RemoteTier(config, ChunkStore(1 << 20), asyncio.new_event_loop())
if sys.argv[2] == "started":
    tier.start()
r = tier._redis()  # the client that carries the tier's values, its settings
size = 33 << 20  # above glibc's largest mmap threshold (32 MiB)
r.set("v", bytes(size))
assert len(r.get("v")) == size  # the first value's memory faults in
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    assert len(r.get("v")) == size
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
if sys.argv[2] == "started":
    tier.close()
"""


@pytest.mark.parametrize("state", ["started", "not started"])
def test_values_read_from_redis_reuse_memory_instead_of_faulting_it_in(redis_server, state) -> None:
    # Each value is a new bytes object; from a fresh mmap every 4 KiB page of it
    # faulted in (8448 per 33 MiB): half the reader's CPU for 32 MiB chunks. A
    # started tier has malloc reuse what the previous value freed.
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_SCRIPT, redis_server.url, state],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    faults = int(out.stdout.split()[-1])
    if state == "started":
        assert faults < 4 * 8448 // 8
    else:  # the control: what glibc does by default
        assert faults > 4 * 8448 // 2
