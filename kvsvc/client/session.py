"""The client's end of a Session stream: Lookup, Store, Retrieve and Fence
requests multiplexed on one bidirectional gRPC stream, each with its own id and
deadline, answered in any order.

A session only carries requests: what they mean, their leases and their errors
stay in kvsvc.client.calls and the clients, which hand a plan's request in and get the
same unary response message back (or a ``grpc.RpcError`` that the clients map
exactly as a unary call's). Every pending request ends: with its answer, at its
deadline (DEADLINE_EXCEEDED), or at once when the stream breaks (UNAVAILABLE, so
a transfer that may have started becomes TransferUnprovable and keeps its lease).
Closing the client ends them as CANCELLED, as it ends unary calls. A server
without the Session RPC answers UNIMPLEMENTED before it ran anything;
the clients then send the same requests as unary calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from kvsvc.client.plans import SERVICE, Plan
from kvsvc.framing import FIELDS, SESSION_BATCH, batched, speaks_batches
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(__name__)
PATH = f"/{SERVICE.full_name}/Session"


class StreamStatus(grpc.RpcError):
    """A session's failure as the status a unary call would have ended with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


#: What pending requests get when their client closes (as a unary call cut by close).
def _closed() -> StreamStatus:
    return StreamStatus(grpc.StatusCode.CANCELLED, "the client was closed")


def _with_queued(
    first: pb.SessionRequest, out: queue.SimpleQueue[Any] | asyncio.Queue[Any]
) -> tuple[list[pb.SessionRequest], bool]:
    """``first`` and the requests queued behind it, as batches; and whether the
    queue's end (None) came among them."""
    gathered = [first]
    while not out.empty():
        nxt = out.get_nowait()
        if nxt is None:
            return batched(gathered), True
        gathered.append(nxt)
    return batched(gathered), False


def carries(plan: Plan[Any]) -> bool:
    """Large inline Stores go unary (kvsvc.framing.REQUEST_BYTES)."""
    return plan.call.method in FIELDS and not plan.declared


def _request(rid: int, plan: Plan[Any]) -> pb.SessionRequest:
    req = pb.SessionRequest(id=rid, **{FIELDS[plan.call.method]: plan.request})
    req.timeout.FromNanoseconds(int(plan.timeout * 1e9))
    return req


def _response(plan: Plan[Any], response: pb.SessionResponse) -> Any:
    """The unary response inside; a session-level error as that response's error."""
    field = response.WhichOneof("response")
    if field == FIELDS[plan.call.method]:
        return getattr(response, field)
    if field == "error":
        return plan.call.response(error=response.error)
    return plan.call.response()  # neither: kvsvc.client.calls says EMPTY_RESPONSE


def _broken(exc: BaseException) -> StreamStatus:
    """What pending requests get when the stream ends under them."""
    code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return StreamStatus(code, "the server has no Session RPC")
    details = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else ""
    if code is grpc.StatusCode.UNAUTHENTICATED:  # refused before any request ran, as unary
        return StreamStatus(code, details or "")
    what = f"{code.name}: {details}" if code is not None else repr(exc)
    return StreamStatus(grpc.StatusCode.UNAVAILABLE, f"the session stream broke ({what})")


def _expired(plan: Plan[Any]) -> StreamStatus:
    return StreamStatus(
        grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {plan.timeout:g} s (session)"
    )


class SyncSession:
    """For the blocking client: a queue feeds grpc's request iterator, a reader
    thread routes answers, a timer thread ends requests at their deadlines."""

    def __init__(
        self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Plan[Any], Callable[[Any, BaseException | None], None]]] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._wake = threading.Condition(self._lock)
        self._out: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self.failure: StreamStatus | None = None
        stream = channel.stream_stream(
            PATH,
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString,
            _registered_method=True,
        )
        self._opened = threading.Event()
        self._call = stream(self._requests(), metadata=(*(metadata or ()), (SESSION_BATCH, "1")))
        self._opened.set()
        threading.Thread(target=self._read, name="kvsvc-session-read", daemon=True).start()
        threading.Thread(target=self._expire, name="kvsvc-session-timer", daemon=True).start()

    def _requests(self) -> Iterator[pb.SessionRequest]:
        # (grpc's thread) Nothing is written before the server's initial metadata: a
        # server without the RPC then answers UNIMPLEMENTED, never a racing INTERNAL.
        self._opened.wait()
        batches = speaks_batches(self._call.initial_metadata())
        if self._call.done():
            return
        while (req := self._out.get()) is not None:
            if not batches or self._out.empty():
                yield req
                continue
            messages, end = _with_queued(req, self._out)
            yield from messages
            if end:
                return

    def send(self, plan: Plan[Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """``done(response, None)`` or ``done(None, error)``, exactly once, by the
        plan's deadline at the latest (from another thread)."""
        with self._lock:
            failure = self.failure
            if failure is None:
                rid = next(self._ids)
                self._pending[rid] = (plan, done)
                deadline = time.monotonic() + plan.timeout
                heapq.heappush(self._deadlines, (deadline, rid))
                if self._deadlines[0][1] == rid:
                    self._wake.notify()
                self._out.put(_request(rid, plan))
        if failure is not None:
            done(None, failure)

    def _finish(self, rid: int, response: Any, error: BaseException | None) -> None:
        with self._lock:
            entry = self._pending.pop(rid, None)
        if entry is None:
            return  # answered after its deadline, or after the stream broke
        plan, done = entry
        done(None if error else _response(plan, response), error)

    def _read(self) -> None:
        try:
            for message in self._call:
                self._finish(message.id, message, None)
                for response in message.more:
                    self._finish(response.id, response, None)
            failure = StreamStatus(grpc.StatusCode.UNAVAILABLE, "the session stream ended")
        except grpc.RpcError as exc:
            failure = _broken(exc)
        except Exception as exc:  # noqa: BLE001 - every pending request must still end
            failure = _broken(exc)
        self._fail(failure)

    def _fail(self, failure: StreamStatus) -> None:
        with self._lock:
            self.failure = self.failure or failure
            pending, self._pending = self._pending, {}
            self._wake.notify()
        self._out.put(None)
        for _, done in pending.values():
            done(None, failure)

    def _expire(self) -> None:
        with self._lock:
            while self.failure is None or self._pending:
                now = time.monotonic()
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, rid = heapq.heappop(self._deadlines)
                    if (entry := self._pending.pop(rid, None)) is not None:
                        expired.append(entry)
                if expired:
                    self._lock.release()
                    try:
                        for plan, done in expired:
                            done(None, _expired(plan))
                    finally:
                        self._lock.acquire()
                    continue
                wait = self._deadlines[0][0] - now if self._deadlines else None
                if self.failure is not None and not self._pending:
                    return
                self._wake.wait(wait)

    def close(self) -> None:
        self._fail(_closed())  # first: the reader then sees a cancelled stream
        self._call.cancel()


class AsyncSession:
    """For the asyncio client: everything on the loop; a timer per request."""

    def __init__(
        self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Plan[Any], asyncio.Future[Any], asyncio.TimerHandle]] = {}
        self._out: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        self.failure: StreamStatus | None = None
        stream = channel.stream_stream(
            PATH,
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString,
            _registered_method=True,
        )
        self._call = stream(self._requests(), metadata=(*(metadata or ()), (SESSION_BATCH, "1")))
        self._reader = self._loop.create_task(self._read())

    async def _requests(self) -> AsyncIterator[pb.SessionRequest]:
        # Nothing is written before the server's initial metadata: a server without
        # the RPC then answers UNIMPLEMENTED, never a racing INTERNAL.
        batches = speaks_batches(await self._call.initial_metadata())
        if self._call.done():
            return
        while (req := await self._out.get()) is not None:
            if not batches or self._out.empty():
                yield req
                continue
            messages, end = _with_queued(req, self._out)
            for message in messages:
                yield message
            if end:
                return

    async def request(self, plan: Plan[Any]) -> Any:
        """The plan's unary response, or raises its ``grpc.RpcError``."""
        if self.failure is not None:
            raise self.failure
        rid = next(self._ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        timer = self._loop.call_later(plan.timeout, self._expire, rid)
        self._pending[rid] = (plan, fut, timer)
        self._out.put_nowait(_request(rid, plan))
        try:
            return await fut
        finally:
            if self._pending.pop(rid, None) is not None:  # cancelled by its caller
                timer.cancel()

    def _expire(self, rid: int) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None and not entry[1].done():
            entry[1].set_exception(_expired(entry[0]))

    async def _read(self) -> None:
        try:
            async for message in self._call:
                for response in (message, *message.more) if message.more else (message,):
                    entry = self._pending.pop(response.id, None)
                    if entry is None:
                        continue  # answered after its deadline
                    plan, fut, timer = entry
                    timer.cancel()
                    if not fut.done():
                        fut.set_result(_response(plan, response))
            failure = StreamStatus(grpc.StatusCode.UNAVAILABLE, "the session stream ended")
        except asyncio.CancelledError:
            failure = _closed()
        except grpc.RpcError as exc:
            failure = _broken(exc)
        except Exception as exc:  # noqa: BLE001 - every pending request must still end
            failure = _broken(exc)
        self._fail(failure)

    def _fail(self, failure: StreamStatus) -> None:
        self.failure = self.failure or failure
        pending, self._pending = self._pending, {}
        self._out.put_nowait(None)
        for _, fut, timer in pending.values():
            timer.cancel()
            if not fut.done():
                fut.set_exception(failure)

    async def close(self) -> None:
        self._fail(_closed())  # first: the reader then sees a cancelled stream
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # one that never started
            await self._reader
