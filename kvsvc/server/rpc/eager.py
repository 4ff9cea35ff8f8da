"""Running a coroutine's first step now, without a task: a Session request that
never waits is answered in the reader's own step (``eager``), and the wrapper's
deadline costs wait_for's task and timer only for a handler that waits
(``Within``). What waits goes on in a task exactly as if it had been one from the
start: its context, its cancellation, its errors (tests/unit/test_eager.py)."""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
from collections.abc import Callable, Coroutine
from time import monotonic
from typing import Any, TypeVar

R = TypeVar("R")


def eager(coro: Coroutine[Any, Any, R]) -> tuple[bool, Any, contextvars.Context]:
    """Runs a coroutine's first step now, in a context of its own, as Python 3.12's
    eager tasks do: ``(True, result, ctx)`` when it finished without waiting (no
    task, no trip through the loop), else ``(False, rest, ctx)``: a ``_Resumed``
    that continues it (awaited, or run by a task), to be run in ``ctx``."""
    ctx = contextvars.copy_context()
    try:
        first = ctx.run(coro.send, None)
    except StopIteration as stop:
        return True, stop.value, ctx
    return False, _Resumed(coro, first), ctx


class _Rest:
    """The rest of a coroutine whose first step yielded ``first`` (what ``yield from``
    would do, from the second step on)."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self.coro, self.first = coro, first

    def __await__(self) -> Any:
        coro, yielded = self.coro, self.first
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the coroutine, as await does
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


class Within:
    """Awaits a coroutine until a monotonic ``deadline`` (then TimeoutError), as
    ``asyncio.wait_for`` does, but pays for wait_for's task, timer and two loop turns
    only when the coroutine has to wait: its first step runs here (in a context of
    its own, as in a task), so a Store whose copy ended on the loop's thread never
    makes one. If it waits, the rest runs in a task under ``wait_for`` with what is
    left of the time. (``asyncio.timeout`` cannot do this: it would cancel the task
    that runs this step, which under ``eager`` is the Session's reader.)"""

    __slots__ = ("coro", "deadline")

    def __init__(self, coro: Coroutine[Any, Any, Any], deadline: float) -> None:
        self.coro, self.deadline = coro, deadline

    def __await__(self) -> Any:
        if self.deadline <= monotonic():  # as wait_for: no time, no start
            self.coro.close()
            raise TimeoutError
        ctx = contextvars.copy_context()
        try:
            first = ctx.run(self.coro.send, None)
        except StopIteration as stop:
            return stop.value
        task = asyncio.get_running_loop().create_task(_Resumed(self.coro, first), context=ctx)
        # At least a microsecond: wait_for cancels a task it gave no time before
        # the task's first step (the cancel still reaches ``coro``: see _Resumed).
        limit = max(1e-6, self.deadline - monotonic())
        return (yield from asyncio.wait_for(task, limit).__await__())


class _Resumed(collections.abc.Coroutine[Any, Any, Any]):
    """The rest of ``coro``, whose first step yielded ``first``, as a coroutine a task
    runs: the task's first step hands it ``first``; whatever is thrown in (a cancel,
    even one before that step) reaches ``coro`` where it waits. Run by a task, it
    goes on with ``then(result)``'s coroutine when ``coro`` returns (one task for
    both: a cancel before the task's first step still reaches ``coro``, which an
    ``async def`` wrapper awaiting it would never have started to await)."""

    __slots__ = ("coro", "first", "then")
    _SENT = object()

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self.coro, self.first = coro, first
        self.then: Callable[[Any], Coroutine[Any, Any, Any]] | None = None

    def send(self, value: Any) -> Any:
        if self.first is not self._SENT:
            first, self.first = self.first, self._SENT
            return first
        return self._step(self.coro.send, value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self.first = self._SENT
        if val is None and tb is None:
            return self._step(self.coro.throw, typ)
        return self._step(lambda _: self.coro.throw(typ, val, tb), None)

    def _step(self, step: Callable[[Any], Any], arg: Any) -> Any:
        try:
            return step(arg)
        except StopIteration as stop:
            if self.then is None:
                raise
            self.coro, self.then = self.then(stop.value), None
            return self.coro.send(None)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Any:
        if self.first is self._SENT:
            raise RuntimeError("_Resumed is run by a task, once")
        first, self.first = self.first, self._SENT
        return (yield from _Rest(self.coro, first).__await__())
