"""kvsvc.server.rpc.eager.eager: a Session request that never waits is answered in the
reader's own step; one that waits goes on in a task exactly as if it had been a
task from the start (its context, its cancellation, its errors). The wrapper's
deadline (``Within``) keeps to the same rules, and bounds what waits."""

from __future__ import annotations

import asyncio
import contextvars
import time

import pytest

from kvsvc.server.rpc.eager import Within, eager

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="outer")


async def no_wait() -> str:
    VAR.set("inner")
    return "done"


async def waits(gate: asyncio.Event, trace: list[str]) -> str:
    token = VAR.set("inner")
    try:
        trace.append("first step")
        await gate.wait()
        trace.append(f"second step sees {VAR.get()}")
        return "done"
    finally:
        VAR.reset(token)  # raises if the rest ran in another context
        trace.append("finally")


def test_a_coroutine_that_never_waits_ends_in_the_first_step_and_leaves_the_caller_alone() -> None:
    done, value, ctx = eager(no_wait())
    assert (done, value) == (True, "done")
    assert VAR.get() == "outer" and ctx[VAR] == "inner"


def test_one_that_waits_continues_in_its_own_context() -> None:
    async def go() -> list[str]:
        gate, trace = asyncio.Event(), []
        done, rest, ctx = eager(waits(gate, trace))
        assert not done and trace == ["first step"]
        task = asyncio.get_running_loop().create_task(_await(rest), context=ctx)
        await asyncio.sleep(0)
        gate.set()
        assert await asyncio.wait_for(task, 10) == "done"
        assert VAR.get() == "outer"
        return trace

    assert asyncio.run(go()) == ["first step", "second step sees inner", "finally"]


def test_cancelling_the_rest_cancels_the_coroutine_where_it_waits() -> None:
    async def go() -> list[str]:
        gate, trace = asyncio.Event(), []
        _, rest, ctx = eager(waits(gate, trace))
        task = asyncio.get_running_loop().create_task(_await(rest), context=ctx)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        return trace

    assert asyncio.run(go()) == ["first step", "finally"]


def test_an_error_after_the_wait_reaches_whoever_awaits_the_rest() -> None:
    async def fails() -> None:
        await asyncio.sleep(0.001)
        raise KeyError("late")

    async def go() -> None:
        _, rest, ctx = eager(fails())
        with pytest.raises(KeyError, match="late"):
            await asyncio.wait_for(
                asyncio.get_running_loop().create_task(_await(rest), context=ctx), 10
            )

    asyncio.run(go())


async def waits_and_tells(gate: asyncio.Event, trace: list[str]) -> str:
    trace.append("first step")
    try:
        await gate.wait()
    except BaseException as exc:
        trace.append(type(exc).__name__)  # what a handler sees where it waits
        raise
    return "done"


def test_the_rest_run_by_a_task_goes_on_with_then_in_the_same_task() -> None:
    async def go() -> tuple[object, list[str]]:
        gate, trace = asyncio.Event(), []
        _, rest, ctx = eager(waits_and_tells(gate, trace))

        async def post(value: str) -> str:
            trace.append(f"posted {value}")
            return "answered"

        rest.then = post
        task = asyncio.get_running_loop().create_task(rest, context=ctx)
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.wait_for(task, 10), trace

    assert asyncio.run(go()) == ("answered", ["first step", "posted done"])


def test_a_task_cancelled_before_its_first_step_cancels_the_coroutine_where_it_waits() -> None:
    """The Session's pending answers are cancelled when its stream ends, maybe before
    their task ran once: the request must see CancelledError where it waits (its
    handler's cancel path), not a GeneratorExit when it is garbage collected."""

    async def go() -> list[str]:
        gate, trace = asyncio.Event(), []
        _, rest, ctx = eager(waits_and_tells(gate, trace))

        async def post(value: str) -> None:
            trace.append("posted")

        rest.then = post
        task = asyncio.get_running_loop().create_task(rest, context=ctx)
        task.cancel()  # before its first step
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        return trace

    assert asyncio.run(go()) == ["first step", "CancelledError"]


async def _await(rest: object) -> object:
    return await rest  # type: ignore[misc]


def test_within_a_coroutine_that_never_waits_makes_no_task() -> None:
    async def go() -> str:
        before = len(asyncio.all_tasks())
        made: list[int] = []

        async def no_wait_counting() -> str:
            made.append(len(asyncio.all_tasks()))
            return await no_wait()

        value = await Within(no_wait_counting(), time.monotonic() + 10)
        assert made == [before] and VAR.get() == "outer"  # its context was its own
        return value

    assert asyncio.run(go()) == "done"


def test_within_one_that_waits_goes_on_in_its_own_context() -> None:
    async def go() -> list[str]:
        gate, trace = asyncio.Event(), []
        asyncio.get_running_loop().call_later(0.01, gate.set)
        assert await Within(waits(gate, trace), time.monotonic() + 10) == "done"
        assert VAR.get() == "outer"
        return trace

    assert asyncio.run(go()) == ["first step", "second step sees inner", "finally"]


@pytest.mark.parametrize("first_step", ["quick", "past the deadline"])
def test_within_one_that_waits_past_the_deadline_is_cancelled_where_it_waits(
    first_step: str,
) -> None:
    """Also when its first step used up the time: it is told all the same."""

    async def go() -> list[str]:
        gate, trace = asyncio.Event(), []

        async def coro() -> str:
            if first_step != "quick":
                time.sleep(0.06)
            return await waits(gate, trace)

        with pytest.raises(asyncio.TimeoutError):
            await Within(coro(), time.monotonic() + 0.05)
        return trace

    assert asyncio.run(go()) == ["first step", "finally"]


def test_within_cancelling_the_caller_cancels_the_coroutine_where_it_waits() -> None:
    async def go() -> list[str]:
        gate, trace = asyncio.Event(), []

        async def caller() -> object:
            return await Within(waits(gate, trace), time.monotonic() + 10)

        task = asyncio.get_running_loop().create_task(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        return trace

    assert asyncio.run(go()) == ["first step", "finally"]


def test_within_no_time_left_is_a_timeout_before_the_first_step() -> None:
    async def go() -> list[str]:
        gate, trace = asyncio.Event(), []
        with pytest.raises(asyncio.TimeoutError):
            await Within(waits(gate, trace), time.monotonic() - 1)
        return trace

    assert asyncio.run(go()) == []
