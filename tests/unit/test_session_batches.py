"""kvsvc.client.session.batched: what queued behind a Session write goes out in as few
messages as fit under BATCH_BYTES, in order, each request exactly once; a request
bigger than that goes alone (gRPC's message limit is far above it)."""

from __future__ import annotations

from kvsvc.framing import BATCH_BYTES, batched
from kvsvc.v1 import kv_cache_service_pb2 as pb


def _put(rid: int, nbytes: int) -> pb.SessionRequest:
    chunk = pb.InlineChunk(key=b"k%d" % rid, data=b"x" * nbytes)
    return pb.SessionRequest(
        id=rid, store=pb.StoreRequest(inline=pb.InlineChunks(namespace="ns", chunks=[chunk]))
    )


def _ids(messages: list[pb.SessionRequest]) -> list[int]:
    return [r.id for m in messages for r in (m, *m.more)]


def test_small_requests_share_one_message_in_order() -> None:
    requests = [
        pb.SessionRequest(id=i, lookup=pb.LookupRequest(keys=[b"k"])) for i in range(1, 301)
    ]
    messages = batched(requests)
    assert len(messages) == 1 and _ids(messages) == list(range(1, 301))


def test_batches_stay_under_the_bound_and_a_big_request_goes_alone() -> None:
    quarter = BATCH_BYTES // 4
    requests = [_put(i, quarter) for i in range(1, 10)] + [_put(10, 3 * BATCH_BYTES), _put(11, 10)]
    messages = batched(requests)
    assert _ids(messages) == list(range(1, 12))
    for m in messages:
        assert m.ByteSize() <= BATCH_BYTES or not m.more, (m.id, m.ByteSize())
    big = next(m for m in messages if m.id == 10)
    assert not big.more  # alone
    assert len(messages) >= 4
