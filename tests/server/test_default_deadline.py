"""A call that carries no gRPC deadline (a generated client in another language may
omit it) is bounded by the server's default all the same: a handler that hangs and
a copy that runs long are answered at the deadline, against a real `kvsvc serve`."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from kvsvc.errors import UNKNOWN
from kvsvc.v1 import error_pb2
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts servers or subprocesses

FP = "KVSVC_FAILPOINTS"
# Far beyond the 2 s default below, so a loaded machine cannot confuse the two.
GUARD_S = 60


def test_a_hanging_handler_is_answered_at_the_default_deadline(spawn) -> None:
    srv = spawn("--default-deadline", "2", env={FP: "handler.enter=GetServerInfo@hang"})
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        t0 = time.monotonic()
        fut = stub.GetServerInfo.future(pb.GetServerInfoRequest())  # no deadline
        try:
            reply = fut.result(timeout=GUARD_S)
        finally:
            fut.cancel()
        elapsed = time.monotonic() - t0
        assert reply.WhichOneof("outcome") == "error"
        assert reply.error.reason == "DEFAULT_DEADLINE_EXCEEDED"
        assert reply.error.code == error_pb2.CODE_DEADLINE_EXCEEDED
        assert reply.error.metadata["defaultDeadlineS"] == "2"
        assert 1.5 <= elapsed < GUARD_S
        # Other calls are not held up: Lookup has no failpoint.
        lookup = stub.Lookup(pb.LookupRequest(namespace="ns", keys=[b"k"]), timeout=30)
        assert lookup.result.hit_chunks == 0


def test_a_long_copy_is_answered_unknown_at_the_default_deadline_and_fenced(spawn) -> None:
    srv = spawn(
        "--default-deadline", "2", "--stall-timeout", "60", env={FP: "transfer.copy=sleep(5000)"}
    )
    data = os.urandom(3 << 20)  # 3 segments: transfer.copy fires after the first
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        request = pb.StoreRequest(
            header=pb.RequestHeader(request_id="long-copy-1"),
            inline=pb.InlineChunks(namespace="ns", chunks=[pb.InlineChunk(key=b"k", data=data)]),
        )
        fut = stub.Store.future(request)  # no deadline
        try:
            reply = fut.result(timeout=GUARD_S)
        finally:
            fut.cancel()
        assert reply.WhichOneof("outcome") == "error", reply
        assert reply.error.reason == "DEFAULT_DEADLINE_EXCEEDED"
        # The copy may still be writing: the caller must keep its buffers and fence.
        assert reply.error.transfer_state == UNKNOWN
        fence = stub.Fence(pb.FenceRequest(transfer_ids=["long-copy-1"]), timeout=GUARD_S)
        assert fence.WhichOneof("outcome") == "result", fence
        assert fence.result.barred_transfers == 0  # known: waited for, or already ended
        # Once fenced, the copy has ended and its chunk is whole.
        got = stub.Retrieve(
            pb.RetrieveRequest(inline=pb.InlineKeys(namespace="ns", keys=[b"k"])), timeout=30
        )
        assert got.result.chunks[0].data == data
