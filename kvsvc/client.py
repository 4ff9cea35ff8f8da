"""Python clients: a sync ``KVCacheClient`` and an asyncio ``AsyncKVCacheClient``
with the same methods.

Every call has a deadline; every failure is a ``kvsvc.errors`` exception raised
``from`` the original. Blocks a transfer may touch are leased until its outcome
is proven (a result, NOT_STARTED, FINISHED, or a later successful fence);
``TransferUnprovable`` keeps them leased, and nothing releases them on a timer.

Each method is written once, in kvsvc.calls, with the table of calls it uses;
this module only drives those operations: on the caller's thread, as a
``concurrent.futures.Future``, or on the asyncio loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import grpc

from kvsvc import calls
from kvsvc.calls import (
    CALLS,
    DEFAULT,
    BlockChunkList,
    Blocking,
    Core,
    MappingHandle,
    Plan,
    Step,
    Steps,
    Timeout,
)
from kvsvc.config import ClientTLS, channel_options
from kvsvc.errors import NO_TRANSFER, UNKNOWN, Cancelled, KVServiceError

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
    """The operation's next step, or its result, given the last step's outcome."""
    value, error = outcome
    try:
        return steps.send(value) if error is None else steps.throw(error)
    except StopIteration as done:
        return _Done(done.value)


def _outcome(fn: Callable[[], Any]) -> Outcome:
    """Typed errors go back into the operation (it may re-map); others propagate."""
    try:
        return fn(), None
    except KVServiceError as exc:
        return None, exc


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


# --- the faces: each operation of kvsvc.calls as a method of each client ---
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

    def close(self) -> None:
        self._close_fd_leases()
        self._channel.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- API: kvsvc.calls has each method's code and documentation ---
    map = _sync(calls.map)
    unmap = _sync(calls.unmap)
    store = _sync(calls.store)
    retrieve = _sync(calls.retrieve)
    store_async = _sync_future(calls.store_async)
    retrieve_async = _sync_future(calls.retrieve_async)
    lookup = _sync(calls.lookup)
    fence = _sync(calls.fence)
    server_info = _sync(calls.server_info)
    register_memfd = _sync(calls.register_memfd)
    put = _sync(calls.put)
    get_many = _sync(calls.get_many)
    get = _sync(calls.get)

    # --- drivers ---
    def _run(self, steps: Steps[R]) -> R:
        outcome: Outcome = (None, None)
        while not isinstance(step := _resume(steps, outcome), _Done):
            outcome = _outcome(functools.partial(self._do, step))
        return step.value

    def _do(self, step: Step) -> Any:
        if isinstance(step, Blocking):
            return step.fn()
        return self._call(step)

    def _call(self, plan: Plan[R]) -> R:
        self._before(plan)
        try:
            response = self._rpcs[plan.call.method](
                plan.request, timeout=plan.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise self._transport_error(plan, exc) from exc
        except ValueError as exc:  # "Cannot invoke RPC on closed channel!"
            raise self._local_error(plan, exc) from exc
        return self._after(plan, response)

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
            except BaseException as exc:  # noqa: BLE001 - the future must complete
                out.set_exception(exc)
                return
            if isinstance(step, _Done):
                out.set_result(step.value)
                return
            if isinstance(step, Plan):
                break
            outcome = _outcome(step.fn)  # blocking work runs here; no *_async method has any
        plan = step
        self._before(plan)
        try:
            call = self._rpcs[plan.call.method].future(
                plan.request, timeout=plan.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:  # pragma: no cover - future() itself rarely raises
            self._advance(out, steps, (None, self._transport_error(plan, exc)))
            return
        except ValueError as exc:  # closed channel
            self._advance(out, steps, (None, self._local_error(plan, exc)))
            return

        def done(f: grpc.Future) -> None:
            try:
                outcome: Outcome = (self._after(plan, f.result()), None)
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

        call.add_done_callback(done)


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

    async def close(self) -> None:
        self._close_fd_leases()
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- API: kvsvc.calls has each method's code and documentation ---
    map = _async(calls.map)
    unmap = _async(calls.unmap)
    store = _async(calls.store)
    retrieve = _async(calls.retrieve)
    store_async = _async_task(calls.store_async)
    retrieve_async = _async_task(calls.retrieve_async)
    lookup = _async(calls.lookup)
    fence = _async(calls.fence)
    server_info = _async(calls.server_info)
    register_memfd = _async(calls.register_memfd)
    put = _async(calls.put)
    get_many = _async(calls.get_many)
    get = _async(calls.get)

    # --- drivers ---
    async def _run(self, steps: Steps[R]) -> R:
        outcome: Outcome = (None, None)
        while not isinstance(step := _resume(steps, outcome), _Done):
            try:
                outcome = (await self._do(step), None)
            except KVServiceError as exc:
                outcome = (None, exc)
        return step.value

    async def _do(self, step: Step) -> Any:
        if isinstance(step, Blocking):
            return await asyncio.to_thread(step.fn)
        return await self._call(step)

    async def _call(self, plan: Plan[R]) -> R:
        self._before(plan)
        try:
            response = await self._rpcs[plan.call.method](
                plan.request, timeout=plan.timeout, metadata=self._metadata
            )
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
