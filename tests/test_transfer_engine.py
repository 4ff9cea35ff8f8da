"""The transfer engine's promises, checked on the engine itself (no server, no timers
to race): once a fatal failure is decided, no queued copy starts; a small copy of
memory that cannot block runs on the loop with the same error rules."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvsvc import failpoints
from kvsvc.errors import (
    FINISHED,
    NOT_STARTED,
    DataLoss,
    FatalServerError,
    InvalidRequest,
    KVServiceError,
    ServiceNotServing,
)
from kvsvc.transfer import TransferEngine


async def test_a_copy_queued_behind_a_fatal_one_never_starts() -> None:
    engine = TransferEngine(threads=1)
    told: list[KVServiceError] = []
    engine.on_fatal = told.append
    release = threading.Event()
    ran: list[str] = []

    def failing() -> None:
        release.wait(30)
        raise RuntimeError("device error")

    def second() -> None:
        ran.append("second")  # would write the engine's blocks

    first_call = asyncio.ensure_future(engine.run("t1", "m", 0, None, [failing], lambda r, e: None))
    await asyncio.sleep(0)  # t1's piece is on the only worker
    finalized: list[BaseException | None] = []
    second_call = asyncio.ensure_future(
        engine.run("t2", "m", 0, None, [second], lambda r, e: finalized.append(e))
    )
    for _ in range(3000):  # t2 is queued behind it (admitted, waiting for the worker)
        if "t2" in engine.inflight:
            break
        await asyncio.sleep(0.01)
    assert "t2" in engine.inflight and not ran
    release.set()
    results = await asyncio.wait_for(
        asyncio.gather(first_call, second_call, return_exceptions=True), 30
    )
    assert isinstance(results[0], FatalServerError)
    assert results[0].reason == "TRANSFER_WORKER_FAILED"
    assert isinstance(results[1], ServiceNotServing)
    assert results[1].transfer_state == NOT_STARTED
    assert ran == []
    assert len(finalized) == 1 and isinstance(finalized[0], ServiceNotServing)
    assert [e.reason for e in told] == ["TRANSFER_WORKER_FAILED"]
    with pytest.raises(ServiceNotServing):
        await engine.run("t3", "m", 0, None, [second], lambda r, e: None)
    assert ran == []
    engine.shutdown()


def _recorder(ran: list[str], result: object = None):
    def task() -> object:
        ran.append(threading.current_thread().name)
        return result

    return task


async def test_a_small_loop_safe_copy_runs_on_the_loop_and_fence_proves_it_ended() -> None:
    engine = TransferEngine(threads=1, inline_max_bytes=1 << 20)
    loop_thread = threading.current_thread().name
    ran: list[str] = []
    finalized: list[tuple[object, BaseException | None]] = []
    results = await engine.run(
        "t1", "m", 4096, None, [_recorder(ran, "a"), _recorder(ran, "b")],
        lambda r, e: finalized.append((r, e)), loop_safe=True,
    )  # fmt: skip
    assert results == ["a", "b"] and ran == [loop_thread, loop_thread]
    assert finalized == [(["a", "b"], None)]
    assert engine.state_of("t1") == FINISHED and "t1" not in engine.inflight
    assert await engine.fence("", ["t1"], None) == (0, 0, [])  # ended, not barred
    with pytest.raises(InvalidRequest) as ei:  # its id stays used
        await engine.run("t1", "m", 4096, None, [_recorder(ran)], lambda r, e: None, loop_safe=True)
    assert ei.value.reason == "DUPLICATE_TRANSFER_ID"
    # Larger than inline_max_bytes, or not loop-safe: a copy thread.
    await engine.run("t2", "m", 2 << 20, None, [_recorder(ran)], lambda r, e: None, loop_safe=True)
    await engine.run("t3", "m", 4096, None, [_recorder(ran)], lambda r, e: None)
    assert ran[-2:] == ["kvsvc-copy-0", "kvsvc-copy-0"]
    engine.shutdown()


async def test_with_failpoints_loaded_every_copy_runs_on_a_copy_thread() -> None:
    """Failpoints simulate faults of copy threads: an inline copy would dodge them."""
    engine = TransferEngine(threads=1, inline_max_bytes=1 << 20)
    ran: list[str] = []
    failpoints.load("transfer.after_copy=sleep(1)")
    try:
        await engine.run("t1", "m", 4096, None, [_recorder(ran)], lambda r, e: None, loop_safe=True)
    finally:
        failpoints.load("")
    assert ran == ["kvsvc-copy-0"]
    engine.shutdown()


async def test_an_inline_copy_that_raises_is_fatal_as_on_a_copy_thread() -> None:
    engine = TransferEngine(threads=1, inline_max_bytes=1 << 20)
    told: list[KVServiceError] = []
    engine.on_fatal = told.append
    finalized: list[tuple[object, BaseException | None]] = []

    def failing() -> None:
        raise RuntimeError("device error")

    with pytest.raises(FatalServerError) as ei:
        await engine.run(
            "t1", "m", 4096, None, [failing], lambda r, e: finalized.append((r, e)), loop_safe=True
        )
    err = ei.value
    assert err.reason == "TRANSFER_WORKER_FAILED" and err.transfer_state == FINISHED
    assert finalized == [(None, err)] and told == [err] and engine.failed is err
    ran: list[str] = []
    with pytest.raises(ServiceNotServing) as refused:
        await engine.run("t2", "m", 4096, None, [_recorder(ran)], lambda r, e: None, loop_safe=True)
    assert refused.value.transfer_state == NOT_STARTED and ran == []
    engine.shutdown()


async def test_data_loss_in_an_inline_copy_is_fatal_and_keeps_its_reason() -> None:
    engine = TransferEngine(threads=1, inline_max_bytes=1 << 20)
    told: list[KVServiceError] = []
    engine.on_fatal = told.append

    def mismatch() -> None:
        raise DataLoss("checksum mismatch on chunk 00 segment 0")

    with pytest.raises(DataLoss) as ei:
        await engine.run("t1", "m", 4096, None, [mismatch], lambda r, e: None, loop_safe=True)
    assert ei.value.transfer_state == FINISHED and told == [ei.value]
    assert engine.failed is ei.value
    engine.shutdown()
