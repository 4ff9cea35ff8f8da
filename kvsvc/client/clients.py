"""Python clients: a sync ``KVCacheClient`` and an asyncio ``AsyncKVCacheClient``
with the same methods.

Every call has a deadline; every failure is a ``kvsvc.errors`` exception raised
``from`` the original. Blocks a transfer may touch are leased until its outcome
is proven (a result, NOT_STARTED, FINISHED, or a later successful fence);
``TransferUnprovable`` keeps them leased, and nothing releases them on a timer.

Each method is written once, in kvsvc.client.calls, with the table of calls it uses;
this module only drives those operations: on the caller's thread, as a
``concurrent.futures.Future``, or on the asyncio loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import grpc

from kvsvc.client import calls, session
from kvsvc.client.calls import Core
from kvsvc.client.plans import (
    CALLS,
    DEFAULT,
    BlockChunkList,
    Blocking,
    MappingHandle,
    Parallel,
    Plan,
    Step,
    Steps,
    Timeout,
)
from kvsvc.client.presence import STALE_AFTER_S, AsyncPresenceIndex, BatchCallback, PresenceIndex
from kvsvc.client.session import AsyncSession, StreamStatus, SyncSession
from kvsvc.client.tls import ClientTLS
from kvsvc.errors import NO_TRANSFER, UNKNOWN, Cancelled, KVServiceError
from kvsvc.framing import REQUEST_BYTES
from kvsvc.limits import channel_options

__all__ = [
    "DEFAULT",
    "AsyncKVCacheClient",
    "BlockChunkList",
    "ClientTLS",
    "KVCacheClient",
    "MappingHandle",
    "Timeout",
]

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])
Outcome = tuple[Any, KVServiceError | None]  # a step's result, or its typed error


@dataclass(slots=True)
class _Done(Generic[R]):
    value: R


def _resume(steps: Steps[R], outcome: Outcome) -> Step | _Done[R]:
    """The operation's next step, or its result, given the last step's outcome.

    Neither this frame nor the drivers' keep a typed error once it is thrown in:
    an error raised on carries this frame in its traceback, and a frame that held
    it would make a reference cycle per failed call, left to the cyclic collector
    (whose full passes over a process with torch loaded cost milliseconds: they
    made the error path's p99 several times success's at 32 callers)."""
    value, error = outcome
    del outcome
    try:
        return steps.send(value) if error is None else steps.throw(error)
    except StopIteration as done:
        return _Done(done.value)
    finally:
        error = None


def _outcome(fn: Callable[[], Any]) -> Outcome:
    """Typed errors go back into the operation (it may re-map); others propagate."""
    try:
        return fn(), None
    except KVServiceError as exc:
        return None, exc


def _raise(error: BaseException) -> Any:
    raise error


def _detached(error: KVServiceError) -> KVServiceError:
    """A typed error as a failed future keeps it: without the tracebacks of this
    client's frames (and its causes'). Those frames hold the future, or the error,
    through the callbacks that completed it (a finished frame keeps its caller's):
    a cycle per failed transfer, left to the cyclic collector. ``result()`` raises
    it with the caller's frames; the server's traceback is in the server's log."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error


def _rpcs(channel: grpc.Channel | grpc.aio.Channel) -> dict[str, Any]:
    """A multicallable per RPC of the table, typed by it (what a generated stub holds)."""
    return {
        call.method: channel.unary_unary(
            call.path,
            request_serializer=call.request.SerializeToString,
            response_deserializer=call.response.FromString,
            _registered_method=True,  # what the generated stub passes: grpcio's fast path
        )
        for call in CALLS
    }


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _channel(target: str, tls: ClientTLS | None, aio: bool) -> Any:
    """A plaintext channel, or a TLS one (mTLS with a client certificate)."""
    options: list[tuple[str, int | str]] = [*channel_options()]
    if tls is None:
        return (grpc.aio if aio else grpc).insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key),
        certificate_chain=_read(tls.cert),
    )
    options = [*options, *tls.options()]
    return (grpc.aio if aio else grpc).secure_channel(target, credentials, options=options)


def _call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The bearer token every call carries (None: none). Never logged."""
    if token is None:
        return None
    if not token or any(c in token for c in "\r\n "):
        raise ValueError("token must be a non-empty string without spaces or newlines")
    return (("authorization", f"Bearer {token}"),)


def _unary_metadata(
    metadata: tuple[tuple[str, str], ...] | None, plan: Plan[Any]
) -> tuple[tuple[str, str], ...] | None:
    """A unary call's metadata: the token's, and a large inline Store's size."""
    if not plan.declared:
        return metadata
    return (*(metadata or ()), (REQUEST_BYTES, str(plan.declared)))


def _face(method: F, op: Callable[..., Any]) -> F:
    """``method`` with the operation's name, documentation and parameters (without
    ``Steps[...]``, which only the drivers see)."""
    functools.update_wrapper(method, op)
    sig = inspect.signature(op)
    core, *params = sig.parameters.values()
    method.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[core.replace(name="self", annotation=inspect.Parameter.empty), *params],
        return_annotation=inspect.Signature.empty,
    )
    return method


# --- the faces: each operation of kvsvc.client.calls as a method of each client ---
def _sync(
    op: Callable[Concatenate[Core, P], Steps[R]],
) -> Callable[Concatenate[KVCacheClient, P], R]:
    def method(self: KVCacheClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(op(self, *args, **kwargs))

    return _face(method, op)


def _sync_future(
    op: Callable[Concatenate[Core, P], Steps[R]],
) -> Callable[Concatenate[KVCacheClient, P], concurrent.futures.Future[R]]:
    def method(
        self: KVCacheClient, /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[R]:
        return self._future(op(self, *args, **kwargs))

    return _face(method, op)


def _async(
    op: Callable[Concatenate[Core, P], Steps[R]],
) -> Callable[Concatenate[AsyncKVCacheClient, P], Coroutine[Any, Any, R]]:
    async def method(self: AsyncKVCacheClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._run(op(self, *args, **kwargs))

    return _face(method, op)


def _async_task(
    op: Callable[Concatenate[Core, P], Steps[R]],
) -> Callable[Concatenate[AsyncKVCacheClient, P], asyncio.Task[R]]:
    def method(self: AsyncKVCacheClient, /, *args: P.args, **kwargs: P.kwargs) -> asyncio.Task[R]:
        return asyncio.ensure_future(self._run(op(self, *args, **kwargs)))

    return _face(method, op)


class KVCacheClient(Core):
    """Blocking client; ``*_async`` methods return ``concurrent.futures.Future``s
    that always complete (the deadline bounds them). ``token``: the bearer token of
    a server with --auth-token-file; ``tls``: TLS (and mTLS) settings."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: ClientTLS | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.target = target
        self._metadata = _call_metadata(token)
        self._channel = _channel(target, tls, aio=False)
        self._rpcs = _rpcs(self._channel)
        self._session: SyncSession | None = None
        self._session_lock = threading.Lock()
        # Where futures answered over the session complete: one thread, and one
        # more whenever every one is blocked in a caller's callback.
        self._callbacks = concurrent.futures.ThreadPoolExecutor(32, "kvsvc-callbacks")
        self._indexes: weakref.WeakSet[PresenceIndex] = weakref.WeakSet()

    def close(self) -> None:
        for index in list(self._indexes):  # before the channel they follow on
            index.close()
        with self._session_lock:
            self.use_session = False
            if self._session is not None:
                self._session.close()
        self._callbacks.shutdown(wait=False)  # what is queued still runs
        self._close_fd_leases()
        self._channel.close()

    def _session_for(self, plan: Plan[Any]) -> SyncSession | None:
        """The open session (opened again after a break), or None: unary."""
        if not (self.use_session and session.carries(plan)):
            return None
        with self._session_lock:
            s = self._session
            if s is None or s.failure is not None:
                s = self._session = SyncSession(self._channel, self._metadata)
            return s

    def _unsupported(self, error: BaseException | None) -> bool:
        """The server has no Session RPC: this client goes unary from now on."""
        if isinstance(error, StreamStatus) and error.code() is grpc.StatusCode.UNIMPLEMENTED:
            self.use_session = False
            return True
        return False

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- API: kvsvc.client.calls has each method's code and documentation ---
    map = _sync(calls.map)
    unmap = _sync(calls.unmap)
    store = _sync(calls.store)
    retrieve = _sync(calls.retrieve)
    store_async = _sync_future(calls.store_async)
    retrieve_async = _sync_future(calls.retrieve_async)
    store_many = _sync(calls.store_many)
    retrieve_many = _sync(calls.retrieve_many)
    lookup = _sync(calls.lookup)
    fence = _sync(calls.fence)
    server_info = _sync(calls.server_info)
    drop_namespace = _sync(calls.drop_namespace)
    register_memfd = _sync(calls.register_memfd)
    put = _sync(calls.put)
    get_many = _sync(calls.get_many)
    get = _sync(calls.get)

    def presence(
        self,
        namespace: str,
        *,
        stale_after_s: float = STALE_AFTER_S,
        on_batch: BatchCallback | None = None,
    ) -> PresenceIndex:
        """An index of which keys of ``namespace`` the server holds, answered from
        local memory and kept current by the WatchEvents stream on a background
        thread (kvsvc.client.presence); its answers are None (ask ``lookup``)
        whenever it cannot prove them current within ``stale_after_s``.
        ``on_batch`` is called on that thread with each batch once applied.
        Closing the client closes its indexes."""
        index = PresenceIndex(
            self._channel,
            self._metadata,
            namespace,
            stale_after_s=stale_after_s,
            on_batch=on_batch,
        )
        self._indexes.add(index)
        return index

    # --- drivers ---
    def _run(self, steps: Steps[R]) -> R:
        outcome: Outcome = (None, None)
        try:
            while not isinstance(step := _resume(steps, outcome), _Done):
                outcome = _outcome(functools.partial(self._do, step))
            return step.value
        finally:
            outcome = (None, None)  # no cycle through an error's traceback (_resume)

    def _do(self, step: Step) -> Any:
        if isinstance(step, Blocking):
            return step.fn()
        if isinstance(step, Parallel):
            futures = [self._future(calls._send(plan)) for plan in step.plans]
            return [self._settled(f, plan) for f, plan in zip(futures, step.plans, strict=True)]
        return self._call(step)

    def _call(self, plan: Plan[R]) -> R:
        self._before(plan)
        try:
            response = self._send(plan)
        except grpc.RpcError as exc:
            raise self._transport_error(plan, exc) from exc
        except ValueError as exc:  # "Cannot invoke RPC on closed channel!"
            raise self._local_error(plan, exc) from exc
        return self._after(plan, response)

    def _send(self, plan: Plan[Any]) -> Any:
        s = self._session_for(plan)
        if s is not None:
            answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
            s.send(plan, lambda r, e: answer.set_exception(e) if e else answer.set_result(r))
            try:
                # The session ends every request by its deadline; this bound is a backstop.
                return answer.result(plan.timeout + 10)
            except concurrent.futures.TimeoutError:
                raise session.StreamStatus(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no answer from the session"
                ) from None
            except grpc.RpcError as exc:
                if not self._unsupported(exc):
                    raise
        return self._rpcs[plan.call.method](
            plan.request, timeout=plan.timeout, metadata=_unary_metadata(self._metadata, plan)
        )

    def _settled(self, f: concurrent.futures.Future[Any], plan: Plan[Any]) -> Any:
        """A call's result, or its typed error as a value; anything else raises."""
        try:
            # Each call ends by its deadline (gRPC's or the session's); this is a backstop.
            exc = f.exception(plan.timeout + 10)
        except concurrent.futures.TimeoutError:
            status = session.StreamStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")
            return self._transport_error(plan, status)
        if exc is None:
            return f.result()
        if isinstance(exc, KVServiceError):
            return exc
        raise exc

    def _future(self, steps: Steps[R]) -> concurrent.futures.Future[R]:
        out: concurrent.futures.Future[R] = concurrent.futures.Future()
        self._advance(out, steps, (None, None))
        return out

    def _advance(
        self, out: concurrent.futures.Future[R], steps: Steps[R], outcome: Outcome
    ) -> None:
        """Run the operation until an RPC is in flight; its callback resumes it."""
        while True:
            try:
                step = _resume(steps, outcome)
            except KVServiceError as exc:
                out.set_exception(_detached(exc))
                return
            except BaseException as exc:  # noqa: BLE001 - the future must complete
                out.set_exception(exc)
                return
            if isinstance(step, _Done):
                out.set_result(step.value)
                return
            if isinstance(step, Plan):
                break
            # blocking work runs here; no *_async method has any
            outcome = _outcome(functools.partial(self._do, step))
        plan = step
        self._before(plan)

        def done(result: Callable[[], Any]) -> None:
            try:
                outcome: Outcome = (self._after(plan, result()), None)
            except grpc.RpcError as exc:
                err = self._transport_error(plan, exc)
                err.__cause__ = exc
                outcome = (None, err)
            except KVServiceError as exc:
                outcome = (None, exc)
            except BaseException as exc:  # noqa: BLE001 - the future must complete
                out.set_exception(exc)
                return
            self._advance(out, steps, outcome)

        def unary() -> None:
            try:
                call = self._rpcs[plan.call.method].future(
                    plan.request,
                    timeout=plan.timeout,
                    metadata=_unary_metadata(self._metadata, plan),
                )
            except grpc.RpcError as exc:  # pragma: no cover - future() itself rarely raises
                self._advance(out, steps, (None, self._transport_error(plan, exc)))
                return
            except ValueError as exc:  # closed channel
                self._advance(out, steps, (None, self._local_error(plan, exc)))
                return
            call.add_done_callback(lambda f: done(f.result))

        def settle(response: Any, error: BaseException | None) -> None:
            if error is None:
                done(lambda: response)
            elif self._unsupported(error):
                unary()
            else:
                done(functools.partial(_raise, error))

        def answered(response: Any, error: BaseException | None) -> None:
            # (the session's reader or timer thread) Settling completes the caller's
            # future, whose callbacks may call this client and wait for an answer
            # only the reader can deliver: they run on another thread.
            try:
                self._callbacks.submit(settle, response, error)
            except RuntimeError:  # closed: its pending requests end here
                settle(response, error)

        s = self._session_for(plan)
        if s is not None:
            s.send(plan, answered)
        else:
            unary()


class AsyncKVCacheClient(Core):
    """asyncio client with the same methods; create it inside the running loop.
    ``token`` and ``tls`` as for :class:`KVCacheClient`."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: ClientTLS | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.target = target
        self._metadata = _call_metadata(token)
        self._channel = _channel(target, tls, aio=True)
        self._rpcs = _rpcs(self._channel)
        self._session: AsyncSession | None = None
        self._indexes: weakref.WeakSet[AsyncPresenceIndex] = weakref.WeakSet()

    async def close(self) -> None:
        for index in list(self._indexes):  # before the channel they follow on
            await index.aclose()
        self.use_session = False
        if self._session is not None:
            await self._session.close()
        self._close_fd_leases()
        await self._channel.close()

    def _session_for(self, plan: Plan[Any]) -> AsyncSession | None:
        """The open session (opened again after a break), or None: unary."""
        if not (self.use_session and session.carries(plan)):
            return None
        if self._session is None or self._session.failure is not None:
            self._session = AsyncSession(self._channel, self._metadata)
        return self._session

    async def _send(self, plan: Plan[Any]) -> Any:
        s = self._session_for(plan)
        if s is not None:
            try:
                return await s.request(plan)
            except StreamStatus as exc:
                if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self.use_session = False  # the server has no Session RPC: unary from now on
        return await self._rpcs[plan.call.method](
            plan.request, timeout=plan.timeout, metadata=_unary_metadata(self._metadata, plan)
        )

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- API: kvsvc.client.calls has each method's code and documentation ---
    map = _async(calls.map)
    unmap = _async(calls.unmap)
    store = _async(calls.store)
    retrieve = _async(calls.retrieve)
    store_async = _async_task(calls.store_async)
    retrieve_async = _async_task(calls.retrieve_async)
    store_many = _async(calls.store_many)
    retrieve_many = _async(calls.retrieve_many)
    lookup = _async(calls.lookup)
    fence = _async(calls.fence)
    server_info = _async(calls.server_info)
    drop_namespace = _async(calls.drop_namespace)
    register_memfd = _async(calls.register_memfd)
    put = _async(calls.put)
    get_many = _async(calls.get_many)
    get = _async(calls.get)

    def presence(
        self,
        namespace: str,
        *,
        stale_after_s: float = STALE_AFTER_S,
        on_batch: BatchCallback | None = None,
    ) -> AsyncPresenceIndex:
        """As :meth:`KVCacheClient.presence`, followed by tasks on the running loop
        (call it inside the loop; ``async with`` or ``aclose()`` ends them; so does
        closing the client)."""
        index = AsyncPresenceIndex(
            self._channel,
            self._metadata,
            namespace,
            stale_after_s=stale_after_s,
            on_batch=on_batch,
        )
        self._indexes.add(index)
        return index

    # --- drivers ---
    async def _run(self, steps: Steps[R]) -> R:
        outcome: Outcome = (None, None)
        try:
            while not isinstance(step := _resume(steps, outcome), _Done):
                try:
                    outcome = (await self._do(step), None)
                except KVServiceError as exc:
                    outcome = (None, exc)
            return step.value
        finally:
            outcome = (None, None)  # no cycle through an error's traceback (_resume)

    async def _do(self, step: Step) -> Any:
        if isinstance(step, Blocking):
            return await asyncio.to_thread(step.fn)
        if isinstance(step, Parallel):
            out = await asyncio.gather(
                *(self._run(calls._send(plan)) for plan in step.plans), return_exceptions=True
            )
            for item in out:  # typed errors are results here; anything else is raised
                if isinstance(item, BaseException) and not isinstance(item, KVServiceError):
                    raise item
            return out
        return await self._call(step)

    async def _call(self, plan: Plan[R]) -> R:
        self._before(plan)
        try:
            response = await self._send(plan)
        except grpc.RpcError as exc:
            raise self._transport_error(plan, exc) from exc
        except grpc.aio.UsageError as exc:  # closed channel
            raise self._local_error(plan, exc) from exc
        except asyncio.CancelledError as exc:
            # The server may still copy: the lease stays until a fence.
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", lambda: 1)()
            if cancelling == 0:  # nobody cancelled this task: the channel was closed
                raise Cancelled(
                    "the call was cancelled by closing the client",
                    request_id=plan.request_id,
                    transfer_state=UNKNOWN if plan.transfer else NO_TRANSFER,
                ) from exc
            raise
        return self._after(plan, response)
