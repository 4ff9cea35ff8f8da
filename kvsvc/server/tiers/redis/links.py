"""The connections Lookup keeps (standalone Redis): an exchange is a write and a
callback, the commands packed by redis-py's packer and the replies parsed by
hiredis' reader as the bytes arrive, on the loop. No task, no stream reader, no
await per reply: through redis.asyncio those cost about as much as the round trip
itself (docs/benchmarks.md section 7, session 7). Only the framing of one
exchange is here; packing and parsing are redis-py's and hiredis'."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import hiredis
import redis.exceptions as rx
from redis.connection import HiredisRespSerializer

#: redis-py's packer for Lookup's commands (hiredis packs; keys are small)
_PACKER = HiredisRespSerializer()


class Link(asyncio.Protocol):
    """One connection the tier keeps for Lookup's EXISTS. One exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reader = hiredis.Reader(protocolError=rx.InvalidResponse, replyError=rx.ResponseError)
        self._replies: list[Any] = []
        self._want = 0
        self._on_end: Callable[[list[Any] | BaseException], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(
        self, commands: list[tuple[Any, ...]], on_end: Callable[[list[Any] | BaseException], None]
    ) -> None:
        """Write ``commands``; ``on_end`` gets every reply, or the failure, once."""
        assert self.transport is not None and self._on_end is None
        self._replies, self._want, self._on_end = [], len(commands), on_end
        self.transport.writelines([part for c in commands for part in _PACKER.pack(*c)])

    async def roundtrip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``send`` and wait (a task's exchange; cut off: the link is closed)."""
        done: asyncio.Future[list[Any] | BaseException] = asyncio.get_running_loop().create_future()

        def end(outcome: list[Any] | BaseException) -> None:
            if not done.done():
                done.set_result(outcome)

        self.send(commands, end)
        try:
            outcome = await done
        except BaseException:
            self.close()
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def data_received(self, data: bytes) -> None:
        if self._on_end is None:
            self.fail(rx.InvalidResponse("a reply nobody asked for"))
            return
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                self._replies.append(reply)
        except rx.InvalidResponse as exc:
            self.fail(exc)
            return
        if len(self._replies) >= self._want:
            self._end(self._replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._end(rx.ConnectionError(f"Redis closed the connection ({exc or 'EOF'})"))

    def _end(self, outcome: list[Any] | BaseException) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(outcome)

    def fail(self, exc: BaseException) -> None:
        """End the exchange with ``exc`` and close the link (never reused mid-reply)."""
        self.close()
        self._end(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def checked(outcome: list[Any] | BaseException) -> list[Any]:
    """The replies of an exchange, or its failure (an error reply too) raised as
    redis-py would raise it."""
    if isinstance(outcome, BaseException):
        raise outcome
    for reply in outcome:
        if isinstance(reply, rx.ResponseError):
            message = str(reply)
            if message.startswith(("WRONGPASS", "NOAUTH", "invalid password")):
                raise rx.AuthenticationError(message)
            if message.startswith("NOPERM"):
                raise rx.NoPermissionError(message)
            raise reply
    return outcome
