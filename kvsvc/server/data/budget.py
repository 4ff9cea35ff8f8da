"""The memory that large requests (inline bytes) may hold at once. A request's bytes
are counted from its raw size before it is parsed (parsing copies them again), so
that one that can never fit the store, or one that would take the server past
``--inline-budget-bytes``, is refused at once (REQUEST_EXCEEDS_CAPACITY,
INLINE_BUDGET_EXHAUSTED: RESOURCE_EXHAUSTED) without its bytes being parsed or
copied into the store. Eight clients each sending 128 MiB inline then cost the
server one budget of memory, not eight messages parsed and copied around."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from kvsvc.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    KVServiceError,
    MalformedRequest,
    Unparsed,
)
from kvsvc.framing import BATCH_BYTES, REQUEST_BYTES
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: Requests from this size on are counted (a session batch stays under it: a bigger
#: message is one request, inline bytes); smaller ones cost too little to count.
COUNTED_MIN_BYTES = BATCH_BYTES
#: What a Store request carries beside its chunks' bytes and keys (header, namespace,
#: framing) at most, for the "can never fit" test on its raw size: each chunk's
#: framing (~20 bytes) is less than the store's own overhead per chunk (512 bytes).
STORE_FRAMING_BYTES = 8192

#: A message still counted after this long is given back (and logged): a request
#: ends within its deadline, so one held longer is a reference kept by mistake, and
#: must not shrink the budget for good.
HELD_MAX_S = 600.0

log = logging.getLogger(__name__)

# SessionRequest's field numbers (proto/kvsvc/v1/kv_cache_service.proto)
_ID, _STORE, _MORE = 1, 4, 7

Parser = Callable[[bytes], Any]
#: Bytes a unary Store's declared size reserved before its message was read: its
#: parser (run in the handler's task as it reads) takes them over, not counting twice.
_ADMITTED: contextvars.ContextVar[int] = contextvars.ContextVar("kvsvc_admitted", default=0)


@dataclass
class _Held:
    message: Message
    nbytes: int
    since: float  # monotonic time it was counted
    pins: int = 0  # a session frame whose requests still run (``pin``/``unpin``)


class InlineBudget:
    """Bytes of large requests the server holds (parsed messages and their copies).
    A unary request is held while its message lives (the handler keeps it until it
    answers); a session frame while its requests run (``pin``, ``unpin``)."""

    def __init__(self, limit_bytes: int, capacity: Callable[[], int]) -> None:
        self.limit = limit_bytes
        self._capacity = capacity
        self.held_bytes = 0
        self.refused = 0
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()

    def parser(self, parse: Parser, message_cls: type[Message]) -> Parser:
        """``parse`` (kvsvc.errors.request_parser) behind the budget's gate."""
        if not self.limit:
            return parse
        store, session = message_cls is pb.StoreRequest, message_cls is pb.SessionRequest

        def gated(raw: bytes) -> Any:
            n = len(raw)
            if n < COUNTED_MIN_BYTES:
                return parse(raw)
            admitted = _ADMITTED.get()
            refusal = None
            if admitted:
                _ADMITTED.set(0)
                if n <= admitted:
                    n = admitted  # reserved when it was declared
                else:  # more than it said: the declared bytes back, the real size gated
                    self._give_back(admitted)
                    admitted = 0
            if not admitted:
                refusal = self._refusal(raw, store, session)
            if refusal is not None:
                self.refused += 1
                ids = session_ids(raw)[0] if session else []
                return Unparsed(refusal, ids)
            message = parse(raw)
            with self._lock:
                if isinstance(message, Unparsed):
                    self.held_bytes -= n
                else:
                    self._held[id(message)] = _Held(message, n, time.monotonic())
            return message

        return gated

    def declared(
        self, behavior: Callable[[Any, Any], Awaitable[Any]]
    ) -> Callable[[AsyncIterator[Any], Any], Awaitable[Any]]:
        """Store's unary ``behavior`` as a request-streaming one (the wire is the same),
        so that it reads its message only after the size a client declared
        (``kvsvc.framing.REQUEST_BYTES``) is admitted: one refused is answered at
        once, its bytes left with the client by HTTP/2 flow control, where a unary
        handler would have had gRPC receive all of them first. Undeclared requests
        are gated by the parser as before."""

        async def gated(requests: AsyncIterator[Any], context: Any) -> Any:
            n = _declared_bytes(context.invocation_metadata()) if self.limit else 0
            token = None
            if n >= COUNTED_MIN_BYTES:
                refusal = self._admit(n, n)
                if refusal is not None:
                    self.refused += 1
                    return await behavior(Unparsed(refusal), context)
                token = _ADMITTED.set(n)
            try:
                # Read through the context, not ``requests``: grpc's generator keeps
                # the message it yielded (and so its budget) in a reference cycle.
                # Bounded: a client that declares and sends nothing holds the budget
                # no longer than its deadline, or than a held message may.
                remaining = context.time_remaining()
                wait = HELD_MAX_S if remaining is None else min(remaining, HELD_MAX_S)
                try:  # in this task (wait_for would read in another, whose context
                    # the parser's hand-over of _ADMITTED would not reach)
                    async with asyncio.timeout(max(wait, 0.0)):
                        request = await context.read()
                except TimeoutError:
                    request = Unparsed(
                        DeadlineExceeded(f"no Store message came within {wait:.1f} s")
                    )
                if request is grpc.aio.EOF:
                    request = Unparsed(MalformedRequest("a Store call without a request"))
            finally:
                if token is not None:
                    left = _ADMITTED.get()  # not taken over: no message, or a small one
                    _ADMITTED.reset(token)
                    if left:
                        self._give_back(left)
            return await behavior(request, context)

        return gated

    def _give_back(self, n: int) -> None:
        with self._lock:
            self.held_bytes -= n

    def _refusal(self, raw: bytes, store: bool, session: bool) -> KVServiceError | None:
        """Why ``raw`` is refused before it is parsed, or None (its bytes reserved)."""
        n = len(raw)
        return self._admit(n, n if store else session_ids(raw)[1] if session else 0)

    def _admit(self, n: int, stored: int) -> KVServiceError | None:
        """Why a request of ``n`` bytes that stores ``stored`` is refused, or None (``n``
        reserved)."""
        capacity = self._capacity()
        if stored > capacity + STORE_FRAMING_BYTES:
            return CapacityExhausted(
                f"an inline Store of {stored} bytes is larger than the store's capacity of "
                f"{capacity}: it can never fit (refused before it was parsed)",
                reason="REQUEST_EXCEEDS_CAPACITY",
                metadata={"requestBytes": stored, "capacityBytes": capacity},
                retryable=False,
            )
        with self._lock:
            self._sweep()
            if self.held_bytes + n > self.limit and self.held_bytes:
                return CapacityExhausted(
                    f"the server holds {self.held_bytes} bytes of large requests; this one of "
                    f"{n} would pass --inline-budget-bytes ({self.limit}): retry later",
                    reason="INLINE_BUDGET_EXHAUSTED",
                    metadata={"requestBytes": n, "heldBytes": self.held_bytes},
                )
            self.held_bytes += n
        return None

    def _sweep(self) -> None:
        """(Under the lock) Give back the bytes of unpinned messages nobody else holds
        any more (their handler has answered; or a refused call never ran one), and of
        any counted for longer than HELD_MAX_S."""
        old = time.monotonic() - HELD_MAX_S
        gone = [
            key
            for key, held in self._held.items()
            if held.since < old
            or (not held.pins and sys.getrefcount(held.message) <= 2)  # the table's, the arg's
        ]
        for key in gone:
            held = self._held.pop(key)
            self.held_bytes -= held.nbytes
            if held.since < old:
                log.warning(
                    "a request of %d bytes was still counted after %.0f s: given back",
                    held.nbytes,
                    HELD_MAX_S,
                )

    def pin(self, message: object) -> bool:
        """A session frame's requests start: its bytes stay held until ``unpin``
        (its requests hold parts of it, not the frame). False: not counted."""
        with self._lock:
            held = self._held.get(id(message))
            if held is None or held.message is not message:
                return False
            held.pins += 1
            return True

    def unpin(self, message: object) -> None:
        """The frame's requests have all ended: its bytes are given back."""
        with self._lock:
            held = self._held.get(id(message))
            if held is not None and held.message is message:
                held.pins -= 1
                if not held.pins:
                    self.held_bytes -= self._held.pop(id(message)).nbytes


def _declared_bytes(metadata: Any) -> int:
    """The size a client declared (``REQUEST_BYTES``), 0 if none or not a number."""
    for key, value in metadata or ():
        if key == REQUEST_BYTES:
            try:
                return max(0, int(value))
            except (TypeError, ValueError):
                return 0
    return 0


def session_ids(raw: bytes) -> tuple[list[int], int]:
    """(request ids, bytes of its largest Store) of a SessionRequest's wire bytes,
    its ``more`` batch included, read without parsing the requests (only field tags
    and lengths are read); what does not read as one gives what was read."""
    ids: list[int] = []
    largest = 0
    stack = [(0, len(raw))]
    view = memoryview(raw)
    while stack:
        pos, end = stack.pop()
        try:
            while pos < end:
                key, pos = _varint(view, pos)
                field, wire = key >> 3, key & 7
                if wire == 0:
                    value, pos = _varint(view, pos)
                    if field == _ID:
                        ids.append(value)
                elif wire == 2:
                    length, pos = _varint(view, pos)
                    if field == _STORE:
                        largest = max(largest, length)
                    elif field == _MORE:
                        stack.append((pos, min(pos + length, end)))
                    pos += length
                elif wire in (1, 5):
                    pos += 8 if wire == 1 else 4
                else:
                    break
        except IndexError:
            continue
    return ids, largest


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        b = view[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    raise IndexError("varint longer than 10 bytes")
