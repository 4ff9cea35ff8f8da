"""The transfer engine's promises, checked on the engine itself (no server, no timers
to race): once a fatal failure is decided, no queued copy starts."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvsvc.errors import NOT_STARTED, FatalServerError, KVServiceError, ServiceNotServing
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
