"""Per-tenant quotas (issue 15, item 4) on real servers: a share of the store that
eviction respects, and limits on mappings, in-flight transfers and passed fds."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import grpc
import pytest
from support import make_cache

from kvsvc.client import KVCacheClient
from kvsvc.errors import CapacityExhausted
from kvsvc.ids import new_request_id
from kvsvc.limits import MiB
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

FILLER = secrets.token_hex(16)
QUIET = secrets.token_hex(16)
LIMITED = secrets.token_hex(16)


def quota_file(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "tenants": {
                    "filler": {
                        "tokens": [FILLER],
                        "namespaces": ["*"],
                        "quota": {"store_share": 0.5},
                    },
                    "quiet": {
                        "tokens": [QUIET],
                        "namespaces": ["*"],
                        "quota": {"store_share": 0.5},
                    },
                    "limited": {
                        "tokens": [LIMITED],
                        "namespaces": ["*"],
                        "quota": {"max_mappings": 1, "max_inflight": 1, "max_fds": 1},
                    },
                }
            }
        )
    )
    return path


def test_one_tenant_filling_the_store_evicts_its_own_chunks_not_anothers(make_server, tmp_path):
    st = make_server(auth_token_file=str(quota_file(tmp_path / "t.json")), store_bytes=8 * MiB)
    quiet_keys = [b"q%d" % i for i in range(8)]
    with KVCacheClient(st.address, token=QUIET) as quiet:
        quiet.put("ns", [(k, b"Q" * (128 << 10)) for k in quiet_keys], timeout=10)  # 1 MiB
    evicted = 0
    with KVCacheClient(st.address, token=FILLER) as filler:
        for i in range(40):  # 40 x 512 KiB: the store five times over
            r = filler.put("ns", [(b"f%d" % i, b"F" * (512 << 10))], timeout=10)
            evicted += r.evicted_chunks
    assert evicted > 0
    with KVCacheClient(st.address, token=QUIET) as quiet:
        # Every one of quiet's chunks survived, within its share.
        assert quiet.lookup(quiet_keys, namespace="ns", timeout=10) == len(quiet_keys)
        assert quiet.get("ns", b"q7", timeout=10) == b"Q" * (128 << 10)
    with KVCacheClient(st.address, token=FILLER) as filler:
        # The filler still holds its most recent chunks (its own oldest went first).
        assert filler.lookup([b"f39"], namespace="ns", timeout=10) == 1
        assert filler.lookup([b"f0"], namespace="ns", timeout=10) == 0


def test_mapping_and_fd_quotas_are_resource_exhausted_with_a_reason(make_server, tmp_path, shm_dir):
    st = make_server(auth_token_file=str(quota_file(tmp_path / "t.json")))
    with KVCacheClient(st.address, token=LIMITED) as c:
        m = c.map("ns", [make_cache(shm_dir, "one").rank_region()], timeout=10)
        with pytest.raises(CapacityExhausted) as ei:
            c.map("ns", [make_cache(shm_dir, "two").rank_region()], timeout=10)
        assert ei.value.reason == "TENANT_QUOTA_EXCEEDED"
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ei.value.metadata == {"quota": "max_mappings", "used": "1", "limit": "1"}
        c.unmap(m, timeout=10)
        # Two memfds in one Map: more than the one fd the tenant may hold.
        a = make_cache(shm_dir, "fd-a", memfd=True)
        b = make_cache(shm_dir, "fd-b", memfd=True)
        ra, rb = (
            a.rank_region(token=c.register_memfd(a.fd)),
            b.rank_region(token=c.register_memfd(b.fd)),
        )
        with pytest.raises(CapacityExhausted) as fd:
            c.map("ns", [ra, rb], timeout=10)
        assert fd.value.metadata["quota"] == "max_fds"
        c.map("ns", [ra], timeout=10)  # one is within it
    with KVCacheClient(st.address, token=QUIET) as other:  # other tenants are not limited
        other.map("ns", [make_cache(shm_dir, "three").rank_region()], timeout=10)
        other.map("ns", [make_cache(shm_dir, "four").rank_region()], timeout=10)


def test_in_flight_transfers_quota(spawn, tmp_path):
    proc = spawn(
        "--auth-token-file",
        str(quota_file(tmp_path / "t.json")),
        env={"KVSVC_FAILPOINTS": "transfer.before_copy=sleep(3000)"},
    )
    meta = [("authorization", f"Bearer {LIMITED}")]

    def put(key: bytes) -> pb.StoreRequest:
        return pb.StoreRequest(
            header=pb.RequestHeader(envelope_version=1, request_id=new_request_id()),
            inline=pb.InlineChunks(namespace="ns", chunks=[pb.InlineChunk(key=key, data=b"x")]),
        )

    with grpc.insecure_channel(proc.address) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        slow = stub.Store.future(put(b"slow"), metadata=meta, timeout=60)
        deadline = time.monotonic() + 30
        while True:  # until the slow copy runs
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=meta, timeout=10)
            if info.result.inflight_transfers >= 1:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        second = stub.Store(put(b"second"), metadata=meta, timeout=30)
        assert second.error.reason == "TENANT_QUOTA_EXCEEDED"
        assert second.error.metadata["quota"] == "max_inflight"
        assert second.error.retryable
        assert slow.result().WhichOneof("outcome") == "result"
        again = stub.Store(put(b"again"), metadata=meta, timeout=30)
        assert again.WhichOneof("outcome") == "result", again.error
