"""Namespaces as units of the cache (issue 32 item 5, cache salt) on real servers:
a share of the store per namespace that eviction respects (one namespace's burst
evicts its own chunks, not its neighbours'), and DropNamespace, which drops one
namespace's chunks at once from memory, disk and Redis, only for its own tenant,
announced as removed."""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from redis_servers import RedisServer, require_redis
from support import make_cache

from kvsvc.client import KVCacheClient
from kvsvc.errors import PermissionDenied
from kvsvc.limits import MiB
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

ALICE = secrets.token_hex(16)
BOB = secrets.token_hex(16)
WAIT_S = 20.0
SMALL = 128 << 10
BIG = 512 << 10


def tenants(path: Path, **quota: object) -> Path:
    path.write_text(
        json.dumps(
            {
                "tenants": {
                    "alice": {"tokens": [ALICE], "namespaces": ["*"], "quota": quota},
                    "bob": {"tokens": [BOB], "namespaces": ["bob/*"]},
                }
            }
        )
    )
    return path


def burst(c: KVCacheClient, namespace: str, n: int = 40) -> int:
    """``n`` x 512 KiB into ``namespace`` (an 8 MiB store five times over): evicted."""
    evicted = 0
    for i in range(n):
        evicted += c.put(namespace, [(b"b%d" % i, b"B" * BIG)], timeout=10).evicted_chunks
    return evicted


def quiet_keys() -> list[bytes]:
    return [b"q%d" % i for i in range(8)]


def fill_quiet(c: KVCacheClient, namespace: str) -> None:
    c.put(namespace, [(k, b"Q" * SMALL) for k in quiet_keys()], timeout=10)  # 1 MiB


# --- eviction shares per namespace ---------------------------------------------
def test_a_burst_in_one_namespace_evicts_its_own_chunks_not_a_neighbours(make_server) -> None:
    st = make_server(store_bytes=8 * MiB, namespace_share=0.5)
    with KVCacheClient(st.address) as c:
        fill_quiet(c, "user-a")
        assert burst(c, "user-b") > 0
        # Every one of user-a's chunks survived: within its share of the store.
        assert c.lookup(quiet_keys(), namespace="user-a", timeout=10) == 8
        assert c.get("user-a", b"q7", timeout=10) == b"Q" * SMALL
        # user-b keeps its most recent chunks; its own oldest went first.
        assert c.lookup([b"b39"], namespace="user-b", timeout=10) == 1
        assert c.lookup([b"b0"], namespace="user-b", timeout=10) == 0


def test_without_a_namespace_share_the_same_burst_evicts_the_neighbour(make_server) -> None:
    """The control: plain LRU takes user-a's older chunks (so the test above proves
    the share, not a store too large to need evicting)."""
    st = make_server(store_bytes=8 * MiB)
    with KVCacheClient(st.address) as c:
        fill_quiet(c, "user-a")
        assert burst(c, "user-b") > 0
        assert c.lookup(quiet_keys(), namespace="user-a", timeout=10) == 0


def test_a_tenants_namespace_share_quota_applies_within_its_share(make_server, tmp_path) -> None:
    st = make_server(
        store_bytes=8 * MiB,
        auth_token_file=str(tenants(tmp_path / "t.json", namespace_share=0.5)),
    )
    with KVCacheClient(st.address, token=ALICE) as c:
        fill_quiet(c, "salt-1")
        assert burst(c, "salt-2") > 0
        assert c.lookup(quiet_keys(), namespace="salt-1", timeout=10) == 8


@pytest.mark.parametrize("bad", [0, 1.5, "half", True])
def test_a_bad_namespace_share_in_the_tenant_file_is_refused(bad) -> None:
    from kvsvc.server.security.auth import TenantFileError, parse_tables

    with pytest.raises(TenantFileError, match="namespace_share"):
        parse_tables({"tenants": {"t": {"quota": {"namespace_share": bad}}}})


# --- DropNamespace --------------------------------------------------------------
class Removed:
    """A WatchEvents stream read on a thread: the removed events, as
    (namespace, key, reason, tier)."""

    def __init__(self, address: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = pb_grpc.KVCacheServiceStub(self.channel).WatchEvents(
            pb.WatchEventsRequest(), timeout=120, metadata=metadata
        )
        self.seen: queue.Queue[tuple[str, bytes, int, int]] = queue.Queue()
        self.live = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.live.wait(WAIT_S), "no snapshot_done"

    def _read(self) -> None:
        try:
            for response in self.call:
                batch = response.batch
                if batch.snapshot_done:
                    self.live.set()
                for e in batch.events:
                    if e.WhichOneof("kind") == "removed":
                        r = e.removed
                        for k in r.keys:
                            self.seen.put((r.namespace, k, r.reason, r.tier))
        except grpc.RpcError:
            pass

    def until(self, want: set[tuple[str, bytes, int, int]]) -> set[tuple[str, bytes, int, int]]:
        """Every removal seen until ``want`` is (those, and any others)."""
        got: set[tuple[str, bytes, int, int]] = set()
        end = time.monotonic() + WAIT_S
        while not want <= got:
            got.add(self.seen.get(timeout=max(0.01, end - time.monotonic())))
        return got

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
        self.thread.join(10)


def test_drop_namespace_removes_exactly_that_namespace_and_announces_it(server) -> None:
    with KVCacheClient(server.address) as c:
        c.put("a", [(b"k%d" % i, b"A" * 1000) for i in range(5)], timeout=10)
        c.put("b", [(b"k%d" % i, b"B" * 1000) for i in range(3)], timeout=10)
        c.put("a/sub", [(b"k0", b"S" * 1000)], timeout=10)  # a longer name is another
        watch = Removed(server.address)
        try:
            r = c.drop_namespace("a", timeout=10)
            assert (r.dropped_chunks, r.dropped_bytes) == (5, 5000)
            assert (r.disk_chunks, r.redis_keys, r.redis_complete) == (0, 0, True)
            assert r.server_start_id
            gone = {("a", b"k%d" % i, pb.REMOVAL_REASON_DROPPED, pb.TIER_MEMORY) for i in range(5)}
            assert watch.until(gone) == gone
        finally:
            watch.close()
        assert c.lookup([b"k0"], namespace="a", timeout=10) == 0
        assert c.lookup([b"k0", b"k1", b"k2"], namespace="b", timeout=10) == 3
        assert c.get("b", b"k2", timeout=10) == b"B" * 1000
        assert c.get("a/sub", b"k0", timeout=10) == b"S" * 1000
        # Dropping it again (or a namespace never used) drops nothing, and is no error.
        assert c.drop_namespace("a", timeout=10).dropped_chunks == 0
        # Its chunks' memory is free again.
        assert c.server_info(timeout=10).stored_chunks == 4


def test_a_tenant_drops_only_its_own_namespaces(make_server, tmp_path) -> None:
    st = make_server(auth_token_file=str(tenants(tmp_path / "t.json")))
    with (
        KVCacheClient(st.address, token=ALICE) as alice,
        KVCacheClient(st.address, token=BOB) as bob,
    ):
        alice.put("bob/x", [(b"k", b"alice's")], timeout=10)  # alice's own "bob/x"
        bob.put("bob/x", [(b"k", b"bob's")], timeout=10)
        bob.put("bob/y", [(b"k", b"bob's")], timeout=10)
        # Bob is not granted alice's names: refused, nothing dropped.
        with pytest.raises(PermissionDenied) as ei:
            bob.drop_namespace("alice-ns", timeout=10)
        assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
        # The same name in two tenants is two namespaces: bob's drop leaves alice's.
        assert bob.drop_namespace("bob/x", timeout=10).dropped_chunks == 1
        assert bob.lookup([b"k"], namespace="bob/x", timeout=10) == 0
        assert bob.get("bob/y", b"k", timeout=10) == b"bob's"
        assert alice.get("bob/x", b"k", timeout=10) == b"alice's"


def test_a_chunk_being_read_is_freed_by_its_reader_not_under_it(server) -> None:
    """White-box: a Retrieve's read-pin outlives the drop; the bytes stay reserved
    until it releases them, and no new reader finds the chunk meanwhile."""
    store = server.server.servicer.store
    with KVCacheClient(server.address) as c:
        c.put("a", [(b"k", b"A" * 4096)], timeout=10)
        used = c.server_info(timeout=10).used_bytes

        async def pin_drop_release() -> tuple[int, int, int]:
            pinned = store.acquire_prefix("a", [b"k"], "inline")
            assert len(pinned) == 1
            dropped, _ = store.drop_namespace("a")
            held = store.used_bytes
            found = store.lookup("a", [b"k"], None)
            store.release(pinned)
            return dropped, held, found

        dropped, held, found = server.run(pin_drop_release())
        assert (dropped, held, found) == (1, used, 0)
        assert c.server_info(timeout=10).used_bytes == 0


def test_drop_namespace_reaches_the_disk_tier(make_server, tmp_path) -> None:
    root = tmp_path / "disk"
    st = make_server(disk_dir=str(root), disk_write="through")
    disk = st.server.servicer.tiers.named("disk")
    with KVCacheClient(st.address) as c:
        c.put("a", [(b"k%d" % i, b"A" * 8192) for i in range(4)], timeout=10)
        c.put("b", [(b"k0", b"B" * 8192)], timeout=10)
        end = time.monotonic() + WAIT_S
        while disk.files < 5:
            assert time.monotonic() < end, disk.files
            time.sleep(0.02)
        watch = Removed(st.address)
        try:
            r = c.drop_namespace("a", timeout=10)
            assert (r.dropped_chunks, r.disk_chunks, r.disk_bytes) == (4, 4, 4 * 8192)
            gone = {
                ("a", b"k%d" % i, pb.REMOVAL_REASON_DROPPED, tier)
                for i in range(4)
                for tier in (pb.TIER_MEMORY, pb.TIER_DISK)
            }
            assert watch.until(gone) == gone
        finally:
            watch.close()
        assert c.lookup([b"k0"], namespace="a", timeout=10) == 0  # not from disk either
        assert c.lookup([b"k0"], namespace="b", timeout=10) == 1
        end = time.monotonic() + WAIT_S
        while len([p for p in root.glob("??/*") if p.is_file()]) > 1:  # removed behind
            assert time.monotonic() < end
            time.sleep(0.02)


@pytest.mark.slow
def test_drop_namespace_reaches_the_redis_tier(make_server, tmp_path) -> None:
    require_redis()
    redis = RedisServer(tmp_path / "redis")
    try:
        st = make_server(remote=redis.url, remote_lookup_budget=5.0)
        remote = st.server.servicer.tiers.named("redis")
        with KVCacheClient(st.address) as c:
            c.put("a", [(b"k%d" % i, b"A" * 8192) for i in range(3)], timeout=10)
            c.put("b", [(b"k0", b"B" * 8192)], timeout=10)
            end = time.monotonic() + WAIT_S
            while remote.writes < 4:
                assert time.monotonic() < end, remote.writes
                time.sleep(0.02)
            # Announced in the Redis tier (what the events stream says it holds).
            events = st.server.servicer.events

            async def announced() -> int:  # read on the loop, which changes it
                return sum(1 for k in events.remote if k[0] == "a")

            while st.run(announced()) < 3:
                assert time.monotonic() < end
                time.sleep(0.02)
            watch = Removed(st.address)
            try:
                r = c.drop_namespace("a", timeout=10)
                assert (r.dropped_chunks, r.redis_keys, r.redis_complete) == (3, 3, True)
                gone = {
                    ("a", b"k%d" % i, pb.REMOVAL_REASON_DROPPED, tier)
                    for i in range(3)
                    for tier in (pb.TIER_MEMORY, pb.TIER_REDIS)
                }
                assert watch.until(gone) == gone
            finally:
                watch.close()
            assert c.lookup([b"k0"], namespace="a", timeout=10) == 0  # not from Redis
            assert c.get("b", b"k0", timeout=10) == b"B" * 8192
            assert redis.cli("dbsize").strip() == "1"  # b's
    finally:
        redis.kill()


# --- block transfers into another namespace than the mapping's -------------------
def test_a_mappings_blocks_go_to_the_namespace_a_call_names(make_server, tmp_path, shm_dir):
    """An engine maps its KV once (namespace "base") and stores a salted request's
    blocks under "base/salt-1": its own namespace, with the mapping's layout."""
    st = make_server(auth_token_file=str(tenants(tmp_path / "t.json")))
    src = make_cache(shm_dir, "src", seed=1)
    dst = make_cache(shm_dir, "dst")
    with KVCacheClient(st.address, token=BOB) as bob:
        m = bob.map("bob/base", [src.rank_region()], timeout=10)
        r = bob.store(m, [(b"k", [0, 1])], namespace="bob/base/salt-1", timeout=10)
        assert r.stored_chunks == 1
        assert bob.lookup("bob/base/salt-1", [b"k"], timeout=10) == 1
        assert bob.lookup("bob/base", [b"k"], timeout=10) == 0
        assert bob.lookup(m, [b"k"], timeout=10) == 0  # the mapping's own
        m2 = bob.map("bob/base", [dst.rank_region()], timeout=10)
        assert bob.retrieve(m2, [(b"k", [0, 1])], timeout=10).loaded_chunks == 0
        got = bob.retrieve(m2, [(b"k", [0, 1])], namespace="bob/base/salt-1", timeout=10)
        assert got.loaded_chunks == 1
        for a, b in zip(src.layers, dst.layers, strict=True):
            assert torch.equal(a.index_select(src.block_dim, torch.tensor([0, 1])),
                               b.index_select(dst.block_dim, torch.tensor([0, 1])))  # fmt: skip
        # A namespace the tenant is not granted is refused, as in any call.
        with pytest.raises(PermissionDenied):
            bob.store(m, [(b"k2", [2])], namespace="alice-ns", timeout=10)
        assert bob.drop_namespace("bob/base/salt-1", timeout=10).dropped_chunks == 1
        assert bob.lookup([b"k"], namespace="bob/base/salt-1", timeout=10) == 0


def test_the_cli_drops_a_namespace_and_says_what(make_server, tmp_path, capsys) -> None:
    from kvsvc.cli.main import main

    st = make_server(auth_token_file=str(tenants(tmp_path / "t.json")))
    token = tmp_path / "token"
    token.write_text(BOB + "\n")
    token.chmod(0o600)
    with KVCacheClient(st.address, token=BOB) as bob:
        bob.put("bob/x", [(b"k%d" % i, b"x" * 100) for i in range(3)], timeout=10)
    args = ["drop-namespace", "--target", st.address, "--token-file", str(token)]
    assert main([*args, "bob/x"]) == 0
    out = capsys.readouterr().out
    # Only what was dropped: this server has neither a disk nor a Redis tier.
    assert out == "kvsvc drop-namespace: bob/x: dropped 3 chunks (300 bytes) from memory\n"
    assert main([*args, "alice-ns"]) == 1  # not bob's
    assert "PermissionDenied" in capsys.readouterr().err
