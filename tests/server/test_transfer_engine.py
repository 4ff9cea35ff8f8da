"""The transfer engine's promises, checked on the engine itself (no server, no timers
to race): once a fatal failure is decided, no queued copy starts; a small copy of
memory that cannot block runs on the loop with the same error rules."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvsvc.errors import (
    FINISHED,
    NOT_STARTED,
    DataLoss,
    FatalServerError,
    InvalidRequest,
    KVServiceError,
    ServiceNotServing,
)
from kvsvc.server.data.engine import LOOP_SHARE_MAX_BYTES, TransferEngine
from kvsvc.server.ops import failpoints


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


async def test_a_large_loop_safe_copy_is_shared_with_the_loops_thread() -> None:
    """The loop's thread copies the first task itself while a copy thread copies the
    other; the copy is tracked, finalized once and remembered as any other."""
    engine = TransferEngine(threads=2, inline_max_bytes=1 << 20)
    loop_thread = threading.current_thread().name
    ran: list[str] = []
    finalized: list[tuple[object, BaseException | None]] = []
    results = await engine.run(
        "t1", "m", 8 << 20, None, [_recorder(ran, "a"), _recorder(ran, "b")],
        lambda r, e: finalized.append((r, e)), loop_safe=True,
    )  # fmt: skip
    assert results == ["a", "b"]
    assert sorted(ran) == sorted([loop_thread, ran[1]]) and ran[1].startswith("kvsvc-copy-")
    assert finalized == [(["a", "b"], None)]
    assert engine.state_of("t1") == FINISHED and not engine.inflight
    # Not loop-safe, or shares above LOOP_SHARE_MAX_BYTES: the copy threads alone.
    ran.clear()
    await engine.run("t2", "m", 8 << 20, None, [_recorder(ran)] * 2, lambda r, e: None)
    big = 2 * LOOP_SHARE_MAX_BYTES + 2
    await engine.run("t3", "m", big, None, [_recorder(ran)] * 2, lambda r, e: None, loop_safe=True)
    assert len(ran) == 4 and all(n.startswith("kvsvc-copy-") for n in ran)
    engine.shutdown()


async def test_a_fence_waits_for_the_copy_threads_share_after_the_loop_did_its_own() -> None:
    engine = TransferEngine(threads=2, inline_max_bytes=1 << 20)
    loop_thread = threading.current_thread().name
    release = threading.Event()
    ran: list[str] = []

    def slow() -> str:
        release.wait(30)  # longer than the loop waits for it: the loop runs on
        ran.append("copy thread's share ended")
        return "b"

    finalized: list[BaseException | None] = []
    call = asyncio.ensure_future(
        engine.run(
            "t1",
            "m",
            8 << 20,
            None,
            [_recorder(ran, "a"), slow],
            lambda r, e: finalized.append(e),
            loop_safe=True,
        )
    )
    for _ in range(3000):
        if ran:
            break
        await asyncio.sleep(0.01)
    assert ran == [loop_thread] and not call.done()
    fence = asyncio.ensure_future(engine.fence("m", [], None))
    await asyncio.sleep(0.2)
    assert not fence.done() and engine.state_of("t1") != FINISHED
    release.set()
    assert await asyncio.wait_for(fence, 30) == (1, 0, [])
    assert ran[-1] == "copy thread's share ended" and finalized == [None]
    assert await asyncio.wait_for(call, 30) == ["a", "b"]
    engine.shutdown()


@pytest.mark.parametrize("failing", ["loop's share", "copy thread's share"])
async def test_a_failed_share_is_fatal_alike_on_the_loop_and_on_a_copy_thread(failing: str) -> None:
    """The same typed error, state and health change wherever the failing piece ran,
    and the copy is answered only once the other share has ended."""
    engine = TransferEngine(threads=2, inline_max_bytes=1 << 20)
    told: list[KVServiceError] = []
    engine.on_fatal = told.append
    ran: list[str] = []
    finalized: list[tuple[object, BaseException | None]] = []

    other_started = threading.Event()

    def failing_task() -> None:
        assert other_started.wait(30)  # a share that has begun runs to its end
        raise RuntimeError("device error")

    def other() -> None:
        other_started.set()
        time.sleep(0.3)
        ran.append("other share ended")

    tasks = [failing_task, other] if failing == "loop's share" else [other, failing_task]
    with pytest.raises(FatalServerError) as ei:
        await engine.run(
            "t1", "m", 8 << 20, None, tasks, lambda r, e: finalized.append((r, e)), loop_safe=True
        )
    err = ei.value
    assert err.reason == "TRANSFER_WORKER_FAILED" and err.transfer_state == FINISHED
    assert ran == ["other share ended"] and finalized == [(None, err)]
    assert engine.failed is err and told == [err]
    assert engine.state_of("t1") == FINISHED and not engine.inflight
    with pytest.raises(ServiceNotServing) as refused:
        await engine.run("t2", "m", 8 << 20, None, [other] * 2, lambda r, e: None, loop_safe=True)
    assert refused.value.transfer_state == NOT_STARTED and len(ran) == 1
    engine.shutdown()


async def test_a_raise_failpoint_fires_on_the_loops_share_a_blocking_one_never_does() -> None:
    engine = TransferEngine(threads=2, inline_max_bytes=1 << 20)
    loop_thread = threading.current_thread().name
    told: list[KVServiceError] = []
    engine.on_fatal = told.append
    ran: list[str] = []
    failpoints.load("transfer.after_copy=sleep(1)")  # would stall the loop: not there
    try:
        await engine.run("t1", "m", 8 << 20, None, [_recorder(ran)] * 2, lambda r, e: None,
                         loop_safe=True)  # fmt: skip
        assert all(n.startswith("kvsvc-copy-") for n in ran)
        failpoints.load("transfer.after_copy=raise")  # fires after task 0: the loop's
        ran.clear()
        with pytest.raises(FatalServerError) as ei:
            await engine.run("t2", "m", 8 << 20, None, [_recorder(ran)] * 2, lambda r, e: None,
                             loop_safe=True)  # fmt: skip
    finally:
        failpoints.load("")
    assert loop_thread in ran
    assert ei.value.reason == "TRANSFER_WORKER_FAILED" and ei.value.transfer_state == FINISHED
    assert "failpoint transfer.after_copy fired" in ei.value.message and told == [ei.value]
    engine.shutdown()


async def test_a_stream_is_one_transfer_until_closed_and_fence_waits_for_all_its_parts() -> None:
    """A Retrieve from Redis copies group by group: each part starts on the copy
    threads as it is added, the transfer id stays in flight (Fence waits, an id
    fenced earlier is refused) until the stream is closed and its last piece ended."""
    engine = TransferEngine(threads=2)
    with pytest.raises(InvalidRequest) as ei:  # fenced before it arrived: never starts
        await engine.fence("", ["early"], None)
        engine.stream("early", "m", None, 4096, [_recorder([])], lambda r, e: None)
    assert ei.value.reason == "TRANSFER_BARRED"
    ran: list[str] = []
    gate = threading.Event()
    finalized: list[tuple[object, BaseException | None]] = []

    def gated() -> str:
        gate.wait(30)
        ran.append("first")
        return "first"

    stream = engine.stream("t1", "m", None, 4096, [gated], lambda r, e: finalized.append((r, e)))
    assert stream.add(4096, [_recorder(ran, "second")], lambda r, e: finalized.append((r, e)))
    fence = asyncio.ensure_future(engine.fence("m", [], time.monotonic() + 30))
    await asyncio.sleep(0.05)
    assert not fence.done() and "t1" in engine.inflight
    gate.set()
    for _ in range(3000):  # both parts end; the stream stays open: Fence still waits
        if len(finalized) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(finalized) == [(["first"], None), (["second"], None)]
    assert not fence.done() and engine.state_of("t1") != FINISHED
    await asyncio.wait_for(stream.end(), 30)
    assert await asyncio.wait_for(fence, 30) == (1, 0, [])
    assert engine.state_of("t1") == FINISHED and "t1" not in engine.inflight
    assert not stream.add(4096, [_recorder(ran)], lambda r, e: finalized.append((r, e)))
    assert finalized[-1] == (None, None) and len(ran) == 2  # closed: never started
    engine.shutdown()


async def test_a_part_the_deadline_cannot_fit_ends_the_stream_and_a_failed_one_is_raised() -> None:
    engine = TransferEngine(threads=1)
    ran: list[str] = []
    deadline = time.monotonic() + 30
    stream = engine.stream("t1", "m", deadline, 4096, [_recorder(ran, "a")], lambda r, e: None)
    refused: list[BaseException | None] = []
    too_big = int(engine.rate.bytes_per_s * 3600)  # an hour of copying: cannot fit
    assert not stream.add(too_big, [_recorder(ran, "x")], lambda r, e: refused.append(e))
    assert isinstance(stream.refused, KVServiceError) and refused == [stream.refused]
    assert stream.refused.transfer_state == NOT_STARTED
    # No later part starts either, even one that would fit: what ran is a prefix.
    assert not stream.add(4096, [_recorder(ran, "y")], lambda r, e: refused.append(e))
    await asyncio.wait_for(stream.end(), 30)  # a refused part is not an error
    assert ran == ["kvsvc-copy-0"]

    def failing() -> None:
        raise DataLoss("stored chunk no longer matches its checksum", reason="CHECKSUM_MISMATCH")

    told: list[KVServiceError] = []
    engine.on_fatal = told.append
    stream = engine.stream("t2", "m", None, 4096, [_recorder(ran)], lambda r, e: None)
    assert stream.add(4096, [failing], lambda r, e: None)
    with pytest.raises(DataLoss) as ei:
        await asyncio.wait_for(stream.end(), 30)
    assert ei.value.transfer_state == FINISHED
    # The copy thread tells the fatal mark right after it hands the answer to the
    # loop (as run does), so it may land just after end() returned.
    for _ in range(3000):
        if told:
            break
        await asyncio.sleep(0.01)
    assert [e.reason for e in told] == ["CHECKSUM_MISMATCH"]
    engine.shutdown()


async def test_a_part_that_cannot_finish_after_the_parts_queued_ahead_is_refused() -> None:
    """A part is admitted by the time the copy needs to reach its end: its own bytes
    and those of the parts queued ahead that have not been copied yet. One that fits
    alone but not behind them is refused, and no later part starts (a prefix); once
    the parts ahead have ended, they no longer count."""
    engine = TransferEngine(threads=1)
    engine.rate.bytes_per_s = 10_000.0  # parts below 1 MiB never change the estimate
    deadline = time.monotonic() + 100  # room for ~1_000_000 bytes
    ran: list[str] = []
    gate = threading.Event()
    finalized: list[BaseException | None] = []

    def gated() -> str:
        gate.wait(30)
        ran.append("first")
        return "first"

    def part(name: str):
        def task() -> str:
            ran.append(name)
            return name

        return task

    def done(r: object, e: BaseException | None) -> None:
        finalized.append(e)

    stream = engine.stream("t1", "m", deadline, 400_000, [gated], done)  # 40 s
    assert stream.add(300_000, [part("second")], done)  # 70 s with the first: fits
    # 40 s alone fits in 100 s, but not after the 70 s queued ahead of it.
    assert not stream.add(400_000, [part("third")], done)
    assert isinstance(stream.refused, KVServiceError)
    assert stream.refused.reason == "DEADLINE_TOO_SHORT"
    assert stream.refused.transfer_state == NOT_STARTED
    assert not stream.add(4096, [part("fourth")], done)  # the prefix has ended
    gate.set()
    await asyncio.wait_for(stream.end(), 30)  # a refused part is not an error
    assert ran == ["first", "second"]
    assert finalized[:2] == [stream.refused, stream.refused] and finalized[2:] == [None, None]

    stream = engine.stream("t2", "m", deadline, 400_000, [part("a")], done)
    for _ in range(3000):  # the first part ends: its bytes no longer count
        if len(finalized) == 5:
            break
        await asyncio.sleep(0.01)
    assert finalized[4] is None
    assert stream.add(500_000, [part("b")], done)  # 50 s: fits once nothing is ahead
    await asyncio.wait_for(stream.end(), 30)
    assert ran[2:] == ["a", "b"]
    engine.shutdown()


async def test_a_part_that_no_longer_fits_when_it_comes_up_is_not_started_nor_any_after() -> None:
    """A part admitted at add is checked again when its first piece starts (it may have
    waited behind other copies): one the deadline cannot fit then is finalized with
    the refusal and ends the prefix; a later part that would fit alone does not start
    either; the stream itself ends without error (its first part ran)."""
    engine = TransferEngine(threads=1)
    engine.rate.bytes_per_s = 10_000.0  # parts below 1 MiB never change the estimate
    deadline = time.monotonic() + 30
    gate = threading.Event()
    ran: list[str] = []
    finalized: dict[str, BaseException | None] = {}

    def task(name: str, wait: bool = False):
        def run() -> str:
            if wait:
                gate.wait(30)
            ran.append(name)
            return name

        return run

    def done(name: str):
        return lambda r, e: finalized.__setitem__(name, e)

    stream = engine.stream("t1", "m", deadline, 1000, [task("a", wait=True)], done("a"))
    assert stream.add(200_000, [task("b")], done("b"))  # 20 s behind 0.1 s: fits now
    assert stream.add(1000, [task("c")], done("c"))
    engine.rate.bytes_per_s = 1000.0  # copies got slower: b needs 200 s now, c 1 s
    gate.set()
    await asyncio.wait_for(stream.end(), 30)  # a refused part is not an error
    assert ran == ["a"]
    refused = stream.refused
    assert isinstance(refused, KVServiceError) and refused.reason == "DEADLINE_TOO_SHORT"
    assert refused.transfer_state == NOT_STARTED
    assert finalized == {"a": None, "b": refused, "c": refused}
    assert not stream.add(1000, [task("d")], done("d"))  # the prefix has ended
    assert engine.state_of("t1") == FINISHED and "t1" not in engine.inflight
    assert engine.workers.queued() == 0

    # The first part itself, refused as it comes up, fails the stream as a copy would.
    gate.clear()
    blocker = asyncio.ensure_future(
        engine.run("busy", "m", 0, None, [task("busy", wait=True)], lambda r, e: None)
    )
    stream = engine.stream("t2", "m", time.monotonic() + 30, 1000, [task("e")], done("e"))
    engine.rate.bytes_per_s = 10.0  # 100 s for its 1000 bytes
    gate.set()
    with pytest.raises(KVServiceError) as ei:
        await asyncio.wait_for(stream.end(), 30)
    assert ei.value.reason == "DEADLINE_TOO_SHORT" and ei.value.transfer_state == NOT_STARTED
    await asyncio.wait_for(blocker, 30)
    assert "e" not in ran
    engine.shutdown()


async def test_a_copy_is_admitted_against_the_work_queued_on_the_copy_threads() -> None:
    """A copy that fits its deadline alone but not behind the pieces already queued on
    the copy threads is refused at once (NOT_STARTED, nothing finalized as run);
    once the queue has drained, the same copy is admitted. Running pieces are not
    queued work; a copy on the loop's thread waits for none."""
    engine = TransferEngine(threads=1)
    engine.rate.bytes_per_s = 10_000.0
    gate = threading.Event()
    ran: list[str] = []

    def task(name: str, wait: bool = False):
        def run() -> str:
            if wait:
                gate.wait(30)
            ran.append(name)
            return name

        return run

    busy = asyncio.ensure_future(
        engine.run("busy", "m", 100, None, [task("busy", wait=True)], lambda r, e: None)
    )
    queued = asyncio.ensure_future(
        engine.run("queued", "m", 500_000, None, [task("queued")], lambda r, e: None)
    )
    for _ in range(3000):  # "busy" runs (not queued work), "queued" waits: 50 s
        if engine.workers.queued() == 500_000 and "busy" in engine.inflight:
            break
        await asyncio.sleep(0.01)
    assert engine.workers.queued() == 500_000
    finalized: list[BaseException | None] = []
    with pytest.raises(KVServiceError) as ei:  # 40 s alone fits 60 s; after 50 s, no
        await engine.run(
            "late", "m", 400_000, time.monotonic() + 60, [task("late")],
            lambda r, e: finalized.append(e),
        )  # fmt: skip
    assert ei.value.reason == "DEADLINE_TOO_SHORT" and ei.value.transfer_state == NOT_STARTED
    assert ei.value.metadata["queuedBytes"] == "500000" and finalized == [ei.value]
    gate.set()
    await asyncio.wait_for(asyncio.gather(busy, queued), 30)
    assert engine.workers.queued() == 0
    await engine.run(
        "late2", "m", 400_000, time.monotonic() + 60, [task("late")], lambda r, e: None
    )
    assert ran == ["busy", "queued", "late"]
    engine.shutdown()
