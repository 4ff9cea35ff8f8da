"""The contract every tier below memory keeps (kvsvc.server.tiers.base.Tier), run
against each real tier the same way: the disk tier on a directory, the Redis tier
on a real redis-server, the S3 tier on a real SeaweedFS. A chunk a Store committed
is written behind to the tier; once memory no longer holds it, Lookup counts it
and Retrieve loads it back bit-exact; a chunk loaded from a tier is not written
back to that tier, but is to the tiers above it; DropNamespace forgets the tier's
copy; a tier whose backend fails is a miss within the call's deadline, never an
error or a health change."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis_servers import RedisServer, require_redis
from s3_servers import SeaweedServer
from support import SERVING, ServerThread, health_status

from kvsvc.client import KVCacheClient
from kvsvc.errors import Miss
from kvsvc.server.config import ServerConfig
from kvsvc.server.tiers.base import Tier

pytestmark = pytest.mark.slow  # starts servers (and redis-server)

NS = "contract"
CHUNK = 192 << 10


class Backend:
    """One tier's backend: the server settings that turn it on, and how to break it."""

    def __init__(self, name: str, tmp: Path) -> None:
        self.name = name
        self.tmp = tmp
        self.redis: RedisServer | None = None
        self.s3: SeaweedServer | None = None
        if name == "redis":
            require_redis()
            self.redis = RedisServer(tmp / "redis")
        if name == "s3":
            self.s3 = SeaweedServer(tmp / "weed")

    def settings(self, node: str) -> dict[str, object]:
        if self.redis is not None:
            return {"remote": self.redis.url, "remote_lookup_budget": 5.0}
        if self.s3 is not None:
            return self.s3.settings(self.tmp, s3_lookup_budget=5.0, s3_timeout=3.0)
        return {"disk_dir": str(self.tmp / f"disk-{node}"), "disk_write": "through"}

    def destroy(self, node: str) -> None:
        """What the tier held is gone under the server (Redis killed; files deleted)."""
        if self.redis is not None:
            self.redis.kill()
        elif self.s3 is not None:
            self.s3.kill()
        else:
            for sub in (self.tmp / f"disk-{node}").iterdir():
                if sub.is_dir() and len(sub.name) == 2:
                    shutil.rmtree(sub)

    def close(self) -> None:
        if self.redis is not None:
            self.redis.kill()
        if self.s3 is not None:
            self.s3.kill()


@pytest.fixture(params=["disk", "redis", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    b = Backend(request.param, tmp_path)
    yield b
    b.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def make(name: str, **settings: object) -> ServerThread:
        shm = tmp_path / f"shm-{name}"
        shm.mkdir()
        config = ServerConfig.from_settings(
            listen="127.0.0.1:0", store_bytes=32 << 20, shm_dir=str(shm), **settings
        )
        st = ServerThread(config)
        started.append(st)
        return st

    yield make
    for st in started:
        st.stop()


def the_tier(st: ServerThread, name: str) -> Tier:
    tier = st.server.servicer.tiers.named(name)
    assert tier is not None
    return tier


def written(st: ServerThread, tier: str) -> float:
    """Chunks the tier wrote, as its metrics say."""
    text = generate_latest(st.server.servicer.metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvsvc_tier_written_chunks_total" and sample.labels == {"tier": tier}:
                return sample.value
    raise AssertionError(f"no kvsvc_tier_written_chunks_total for tier {tier}")


def wait_written(st: ServerThread, tier: str, n: int, limit: float = 30) -> None:
    end = time.monotonic() + limit
    while written(st, tier) < n:
        assert time.monotonic() < end, f"{tier}: fewer than {n} chunks written in {limit} s"
        time.sleep(0.02)


def forget_in_memory(st: ServerThread) -> None:
    """Memory gives up the namespace; the tiers are not told (as when it evicts)."""

    async def drop() -> None:
        st.server.servicer.store.drop_namespace(NS)

    st.run(drop())


def chunks(n: int, tag: bytes) -> list[tuple[bytes, bytes]]:
    return [(tag + b"-%d" % i, os.urandom(CHUNK)) for i in range(n)]


def test_a_stored_chunk_is_written_behind_and_loaded_back_bit_exact(backend, node) -> None:
    st = node("a", **backend.settings("a"))
    items = chunks(4, b"w")
    with KVCacheClient(st.address) as c:
        assert c.put(NS, items).stored_chunks == 4
        wait_written(st, backend.name, 4)
        forget_in_memory(st)
        assert c.lookup([k for k, _ in items], namespace=NS) == 4  # from the tier
        for key, data in items:
            assert c.get(NS, key) == data
    # loaded from the tier: not written back to it
    assert written(st, backend.name) == 4


def test_drop_namespace_forgets_the_tiers_copy(backend, node) -> None:
    st = node("a", **backend.settings("a"))
    items = chunks(3, b"d")
    with KVCacheClient(st.address) as c:
        c.put(NS, items)
        wait_written(st, backend.name, 3)
        c.drop_namespace(NS)
        assert c.lookup([k for k, _ in items], namespace=NS) == 0
        with pytest.raises(Miss):
            c.get(NS, items[0][0])


def test_a_tier_whose_backend_fails_is_a_miss_and_health_stays(backend, node) -> None:
    st = node("a", **backend.settings("a"))
    items = chunks(2, b"f")
    with KVCacheClient(st.address) as c:
        c.put(NS, items)
        wait_written(st, backend.name, 2)
        forget_in_memory(st)
        backend.destroy("a")
        t0 = time.monotonic()
        with pytest.raises(Miss):
            c.get(NS, items[0][0], timeout=10)
        assert time.monotonic() - t0 < 10
        assert c.put(NS, chunks(1, b"after")).stored_chunks == 1  # Stores still succeed
    assert health_status(st.address) == SERVING


def test_a_chunk_from_a_lower_tier_is_written_to_the_tiers_above_it(tmp_path, node) -> None:
    """Disk above Redis: node B loads from Redis what node A stored; B's disk keeps
    it, B writes nothing back to Redis."""
    require_redis()
    redis = RedisServer(tmp_path / "redis")
    try:
        shared = {"remote": redis.url, "remote_lookup_budget": 5.0, "disk_write": "through"}
        a = node("a", disk_dir=str(tmp_path / "disk-a"), **shared)
        b = node("b", disk_dir=str(tmp_path / "disk-b"), **shared)
        items = chunks(3, b"o")
        with KVCacheClient(a.address) as ca:
            ca.put(NS, items)
        wait_written(a, "redis", 3)
        with KVCacheClient(b.address) as cb:
            for key, data in items:
                assert cb.get(NS, key) == data
        wait_written(b, "disk", 3)
        disk_b = the_tier(b, "disk")
        assert all(disk_b.holds(NS, key, None) for key, _ in items)
        assert written(b, "redis") == 0
    finally:
        redis.kill()
