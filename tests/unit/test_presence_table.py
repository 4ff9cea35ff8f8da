"""The presence index's table (native and Python) against a model, and how the
index applies a stream's batches (snapshot built aside, lost, gaps, freshness)."""

from __future__ import annotations

import os
import random

import pytest

from kvsvc.client.native import NATIVE, PyTable, new_table
from kvsvc.client.presence import ProtocolViolation, _State
from kvsvc.v1 import kv_cache_service_pb2 as pb

KINDS = [False, True] if NATIVE else [False]


@pytest.mark.parametrize("native", KINDS, ids=lambda n: "native" if n else "python")
def test_the_table_answers_as_a_model_through_churn(native: bool) -> None:
    """Adds and removes over a few bits, many deletes inside probe runs (the
    backward shift must keep every other key reachable), checked after each step."""
    rng = random.Random(29)
    table = new_table(native)
    universe = [rng.randbytes(rng.choice([8, 13, 32])) for _ in range(3000)]
    model: dict[bytes, set[int]] = {}
    for step in range(300):
        keys = rng.sample(universe, rng.randint(1, 60))
        bit = rng.randrange(4)
        if rng.random() < 0.55:
            table.add(keys, bit)
            for k in keys:
                model.setdefault(k, set()).add(bit)
        else:
            table.remove(keys, bit)
            for k in keys:
                bits = model.get(k)
                if bits is not None:
                    bits.discard(bit)
                    if not bits:
                        del model[k]
        if step % 10 == 0 or step == 299:
            assert len(table) == len(model)
            assert table.hits(universe) == [k in model for k in universe]
        probe = rng.sample(universe, 64)
        expect = next((i for i, k in enumerate(probe) if k not in model), 64)
        assert table.prefix(probe) == expect
    table.clear()
    assert len(table) == 0 and table.hits(universe[:10]) == [False] * 10


@pytest.mark.parametrize("native", KINDS, ids=lambda n: "native" if n else "python")
def test_a_key_stays_while_another_layout_holds_it(native: bool) -> None:
    table = new_table(native)
    table.add([b"a", b"b"], 0)
    table.add([b"a"], 1)
    table.add([b"a"], 1)  # repeated: idempotent
    table.remove([b"a", b"b"], 0)
    assert table.hits([b"a", b"b"]) == [True, False]
    table.remove([b"a"], 1)
    assert table.hits([b"a"]) == [False] and len(table) == 0
    with pytest.raises(ValueError):
        table.add([b"a"], 64)
    with pytest.raises(TypeError):
        table.add(["str"], 0)  # type: ignore[list-item]


@pytest.mark.parametrize("native", KINDS, ids=lambda n: "native" if n else "python")
def test_memory_per_key_is_within_64_bytes(native: bool) -> None:
    """The issue's bound at 1 M keys (the Python table at 100 k: same layout)."""
    n = 1_000_000 if native else 100_000
    table = new_table(native)
    blob = os.urandom(32 * n)
    keys = [blob[i : i + 32] for i in range(0, len(blob), 32)]
    for i in range(0, n, 10_000):
        table.add(keys[i : i + 10_000], 0)
    assert len(table) == n
    per_key = table.nbytes / n
    print(f"{'native' if native else 'python'} table: {per_key:.1f} B/key at {n} keys")
    assert per_key <= 64
    assert table.prefix(keys[:64]) == 64


def test_the_python_table_is_the_fallback_type() -> None:
    assert isinstance(new_table(False), PyTable)


# --- the index's state machine (real protobufs, no stream) ---


def _stored(
    keys: list[bytes], layout: str = "L", tier: pb.Tier.ValueType = pb.TIER_MEMORY
) -> pb.KVEvent:
    return pb.KVEvent(stored=pb.StoredEvent(namespace="ns", keys=keys, layout=layout, tier=tier))


def _removed(
    keys: list[bytes], layout: str = "L", tier: pb.Tier.ValueType = pb.TIER_MEMORY
) -> pb.KVEvent:
    return pb.KVEvent(
        removed=pb.RemovedEvent(
            namespace="ns", keys=keys, layout=layout, tier=tier, reason=pb.REMOVAL_REASON_EVICTED
        )
    )


def _batch(seq: int, *events: pb.KVEvent, inc: str = "i1", **flags: bool) -> pb.WatchEventsResponse:
    return pb.WatchEventsResponse(
        batch=pb.EventBatch(incarnation=inc, sequence=seq, events=list(events), **flags)
    )


def _synced(state: _State, seq: int = 5, inc: str = "i1") -> None:
    state._apply(_batch(seq, inc=inc, lost=True))
    state._apply(_batch(seq, _stored([b"a", b"b"]), inc=inc, snapshot=True, snapshot_done=True))


def test_answers_are_unknown_until_the_snapshot_is_swapped_in() -> None:
    state = _State("ns", 1.0, None, None)
    assert state.hits([b"a"]) is None and state.prefix_hits([b"a"]) is None
    state._apply(_batch(5, lost=True))
    state._apply(_batch(5, _stored([b"a"]), snapshot=True))
    assert state.hits([b"a"]) is None and not state.fresh  # page 1 of 2: not yet
    state._apply(_batch(5, _stored([b"b"]), snapshot=True, snapshot_done=True))
    assert state.fresh and state.cursor == ("i1", 5)
    assert state.hits([b"a", b"b", b"c"]) == [True, True, False]
    assert state.prefix_hits([b"a", b"b", b"c", b"a"]) == 2


def test_a_lost_batch_drops_the_old_table_and_the_new_one_replaces_it_whole() -> None:
    state = _State("ns", 1.0, None, None)
    _synced(state)
    state._apply(_batch(9, lost=True, inc="i2"))
    assert state.hits([b"a"]) is None  # known stale: unknown until the snapshot ends
    state._apply(_batch(9, _stored([b"c"]), inc="i2", snapshot=True, snapshot_done=True))
    assert state.hits([b"a", b"c"]) == [False, True] and state.resyncs == 2


def test_live_events_apply_per_layout_and_tier_and_clear_drops_all() -> None:
    state = _State("ns", 1.0, None, None)
    _synced(state)
    state._apply(_batch(7, _stored([b"a"], layout="M"), _removed([b"a", b"b"])))
    assert state.hits([b"a", b"b"]) == [True, False]  # "a" is still held in layout M
    state._apply(_batch(8, _stored([b"b"], tier=pb.TIER_REDIS)))
    state._apply(_batch(9, _removed([b"b"])))  # the memory tier never had it
    assert state.hits([b"b"]) == [True]
    other = pb.KVEvent(stored=pb.StoredEvent(namespace="other", keys=[b"z"], layout="L"))
    state._apply(_batch(12, other))  # another namespace's: not ours (numbers may skip)
    assert state.hits([b"z"]) == [False] and state.cursor == ("i1", 12)
    state._apply(_batch(13, pb.KVEvent(cleared=pb.ClearedEvent(reason=pb.CLEAR_REASON_OPERATOR))))
    assert state.hits([b"a", b"b"]) == [False, False] and state.fresh


@pytest.mark.parametrize(
    "response",
    [
        _batch(5, _stored([b"x"])),  # a duplicate of event 5
        _batch(7, _stored([b"x"]), inc="i2"),  # another incarnation without lost
        _batch(7, _stored([b"x"]), snapshot=True),  # a snapshot page without lost
    ],
    ids=["duplicate", "incarnation", "snapshot-without-lost"],
)
def test_a_batch_against_the_contract_is_a_violation(response: pb.WatchEventsResponse) -> None:
    state = _State("ns", 1.0, None, None)
    _synced(state)
    with pytest.raises(ProtocolViolation):
        state._apply(response)
    state._violation(ProtocolViolation("x"))
    assert state.cursor is None and state.hits([b"a"]) is None


def test_a_live_batch_before_any_snapshot_is_a_violation() -> None:
    state = _State("ns", 1.0, None, None)
    with pytest.raises(ProtocolViolation):
        state._apply(_batch(3, _stored([b"x"])))


def test_an_error_batch_raises_its_typed_error() -> None:
    from kvsvc.errors import KVServiceError

    state = _State("ns", 1.0, None, None)
    err = pb.WatchEventsResponse()
    err.error.code = 14  # type: ignore[assignment]
    err.error.message = "not serving"
    err.error.reason = "NOT_SERVING"
    with pytest.raises(KVServiceError):
        state._apply(err)


def test_freshness_ages_out_and_a_break_is_unknown_at_once() -> None:
    state = _State("ns", 0.5, None, None)
    _synced(state)
    assert state.fresh and state.lag_s < 0.5
    state._proof -= 0.6  # the last proof is older than stale_after_s
    assert not state.fresh and state.hits([b"a"]) is None and state.lag_s >= 0.6
    state._proof += 0.6
    state._broken(None)  # the stream ended
    assert state.hits([b"a"]) is None


def test_on_batch_sees_each_applied_batch_and_its_failure_is_kept() -> None:
    seen: list[int] = []
    state = _State("ns", 1.0, lambda b: seen.append(b.sequence), None)
    _synced(state)
    assert seen == [5, 5]

    def boom(_: pb.EventBatch) -> None:
        raise RuntimeError("caller's bug")

    state._on_batch = boom
    state._apply(_batch(6, _stored([b"c"])))
    assert state.hits([b"c"]) == [True] and state.error is not None
