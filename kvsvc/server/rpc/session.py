"""The Session stream's server end: many calls on one stream, each request run
through its unary RPC's wrapper (kvsvc.server.rpc.wrapper) under its own deadline, and
answered as soon as it is ready, in any order, batched when the client speaks
batches (kvsvc.framing holds the framing both ends share)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from kvsvc.errors import NO_TRANSFER, KVServiceError, Unparsed, to_remote_error
from kvsvc.framing import SESSION_BATCH, batched, speaks_batches
from kvsvc.ids import new_request_id
from kvsvc.server.data.budget import InlineBudget
from kvsvc.server.handlers.requests import oneof
from kvsvc.server.rpc.eager import eager
from kvsvc.server.rpc.wrapper import LOGGER
from kvsvc.server.security.auth import TENANT
from kvsvc.server.security.credentials import GRANT
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(LOGGER)
#: A Session's reader hands the loop to other calls after this many requests of a batch.
SESSION_BATCH_TURN = 64
#: A SessionRequest's kind -> the RPC whose wrapper and handler serve it.
SESSION_RPCS = {"lookup": "Lookup", "store": "Store", "retrieve": "Retrieve", "fence": "Fence"}


class Sessions:
    """Every open Session stream of ``servicer``, whose wrapped RPCs (``rpc``'s
    ``serve``) answer the requests; stops them all at shutdown."""

    def __init__(
        self, servicer: object, loop: asyncio.AbstractEventLoop, budget: InlineBudget | None = None
    ) -> None:
        self.servicer = servicer
        self.loop = loop
        #: a large message's bytes stay counted until its requests have ended
        self.budget = budget
        self._stops: set[Callable[[], None]] = set()  # how each Session stops reading
        self._ending = False

    @property
    def open(self) -> int:
        return len(self._stops)

    def end(self) -> None:
        """At shutdown, once copies are drained: every Session stream stops reading,
        answers what it holds and ends (left open, the server's stop would cancel
        it, and grpc logs each cancelled handler as an ERROR)."""
        self._ending = True
        for stop in list(self._stops):
            stop()

    async def serve(
        self, requests: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Each request runs through its unary RPC's wrapper (checks, health, metrics,
        failpoints, errors as on unary); answers go out as they are ready. A request
        that completes without waiting (a Lookup, most errors) is answered by the
        reader itself, with no task. Answers ready while one is being written go out
        together in the next message when the client speaks batches (one message per
        answer is most of a Lookup's cost). When the stream ends, pending requests are
        cancelled as a unary call whose client went away would be (a started copy
        stays tracked for Fence). Under authentication every request is checked
        against the stream's grant when it is read (kvsvc.server.security.credentials): it runs
        as the tenant its token names in the tables in force; once the token is
        revoked or expired the reader stops, and the requests not run are answered
        by the stream's UNAUTHENTICATED status (kvsvc.server.security.auth ends it)."""
        # Sent at once: a client writes no request before it knows the server has
        # this RPC (an older server's UNIMPLEMENTED then never races a write).
        await context.send_initial_metadata(((SESSION_BATCH, "1"),))
        if self._ending:
            return
        batches = speaks_batches(context.invocation_metadata())
        outbox: list[pb.SessionResponse] = []
        writing = [False]  # one writer at a time (gRPC takes one write at a time)
        pending: set[asyncio.Task[None]] = set()
        ended = self.loop.create_future()
        waiting = [False]  # the reader waits for the next request (``stop`` may cut it)
        grant = GRANT.get()

        async def flush() -> None:
            """Whoever finds nobody writing writes everything posted, its own and what
            others post meanwhile; the others return at once."""
            if writing[0]:
                return
            writing[0] = True
            try:
                while outbox:
                    for message in batched(outbox) if batches else list(outbox):
                        del outbox[: 1 + len(message.more)]
                        await context.write(message)
            finally:
                writing[0] = False

        def finished(task: asyncio.Task[None]) -> None:
            pending.discard(task)
            if not task.cancelled() and (exc := task.exception()) is not None:
                # Only a write can fail here (the client went away): its end of the
                # stream then ends every request it still waits for.
                log.info("session answer not delivered: %r", exc)
            if reader.done() and not pending and not ended.done():
                ended.set_result(None)

        async def post(response: pb.SessionResponse) -> None:
            outbox.append(response)
            await flush()

        async def read() -> None:
            iterator = aiter(requests)
            while True:
                waiting[0] = True
                try:
                    message = await anext(iterator)
                except StopAsyncIteration:
                    return
                finally:
                    waiting[0] = False
                held = self.budget is not None and self.budget.pin(message)
                tasks: list[asyncio.Task[None]] = []
                for i, request in enumerate(_unbatched(message), 1):
                    if grant is not None:
                        tenant = grant.check()
                        if tenant is None:
                            break  # revoked: this request and the rest do not run
                        if tenant is not TENANT.get(None):  # the reloaded file's grants
                            TENANT.set(tenant)
                    done, value, ctx = eager(self._request(request, context))
                    if done:
                        outbox.append(value)
                    else:
                        value.then = post  # one task: the request's rest, then its answer
                        task = self.loop.create_task(value, context=ctx)
                        pending.add(task)
                        task.add_done_callback(finished)
                        tasks.append(task)
                    if i % SESSION_BATCH_TURN == 0:  # a big batch lets other calls run
                        await flush()
                        await asyncio.sleep(0)
                if held:
                    self._unpin_after(message, tasks)
                await flush()
                if self._ending or (grant is not None and grant.revoked):
                    return

        def stop() -> None:
            """Shutdown: read no more; what was read is still answered."""
            if waiting[0]:
                reader.cancel()

        reader = self.loop.create_task(read())
        reader.add_done_callback(finished)
        self._stops.add(stop)
        if grant is not None:
            grant.stops.append(stop)
        try:
            await ended
        finally:
            self._stops.discard(stop)
            reader.cancel()
            for task in list(pending):
                task.cancel()

    def _unpin_after(self, message: pb.SessionRequest, tasks: list[asyncio.Task[None]]) -> None:
        """The budget gives a message's bytes back once the requests read from it end."""
        assert self.budget is not None
        budget, left = self.budget, [len(tasks)]
        if not tasks:
            budget.unpin(message)
            return

        def ended(_: asyncio.Task[None]) -> None:
            left[0] -= 1
            if not left[0]:
                budget.unpin(message)

        for task in tasks:
            task.add_done_callback(ended)

    async def _request(
        self, request: pb.SessionRequest | Unparsed, context: grpc.aio.ServicerContext
    ) -> pb.SessionResponse:
        if isinstance(request, Unparsed):  # refused unparsed: its ids if read, else 0
            rid = request.ids[0] if request.ids else 0  # (0: no client uses it)
            envelope = request.envelope(new_request_id(), bool(request.ids))
            return pb.SessionResponse(id=rid, error=envelope)
        kind = request.WhichOneof("request")
        try:
            if kind is None:
                oneof(request, "request")  # raises UnsupportedRequest
            assert kind is not None
            remaining = (
                request.timeout.ToNanoseconds() / 1e9 if request.HasField("timeout") else None
            )
            servicer = self.servicer
            serve = getattr(type(servicer), SESSION_RPCS[kind]).serve
            response = await serve(servicer, getattr(request, kind), context, remaining, True)
            return pb.SessionResponse(id=request.id, **{kind: response})
        except Exception as exc:  # answered, never dropped
            if not isinstance(exc, KVServiceError):
                log.error("session request %d failed", request.id, exc_info=exc)
            envelope = to_remote_error(exc, new_request_id(), NO_TRANSFER)
            return pb.SessionResponse(id=request.id, error=envelope)


def _unbatched(message: pb.SessionRequest | Unparsed) -> list[pb.SessionRequest | Unparsed]:
    """A message's requests, itself first, in the order sent (nested ``more`` too:
    every request a client sent is answered)."""
    if isinstance(message, Unparsed):  # one answer per request id read from its bytes
        return [Unparsed(message.error, [i]) for i in message.ids] or [message]
    if not message.more:
        return [message]
    out: list[pb.SessionRequest | Unparsed] = []
    stack: list[pb.SessionRequest] = [message]
    while stack:
        request = stack.pop()
        out.append(request)
        stack.extend(reversed(request.more))
    return out
