"""Python clients: a sync ``KVCacheClient`` and an asyncio ``AsyncKVCacheClient``
with the same methods.

Every call has a deadline; every failure is a ``kvsvc.errors`` exception raised
``from`` the original. Blocks a transfer may touch are leased until its outcome
is proven (a result, NOT_STARTED, FINISHED, or a later successful fence);
``TransferUnprovable`` keeps them leased, and nothing releases them on a timer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from kvsvc import fdpass
from kvsvc.config import (
    DEFAULT_CONTROL_DEADLINE_S,
    DEFAULT_TRANSFER_DEADLINE_S,
    channel_options,
    validate_deadline,
)
from kvsvc.errors import (
    FINISHED,
    NO_TRANSFER,
    NOT_STARTED,
    UNKNOWN,
    Cancelled,
    KVServiceError,
    MappingLost,
    Miss,
    ServiceUnavailable,
    TransferUnprovable,
    Unimplemented,
    from_grpc_error,
    from_remote_error,
)
from kvsvc.ids import new_request_id
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT",
    "AsyncKVCacheClient",
    "KVCacheClient",
    "MappingHandle",
]

T = TypeVar("T")
#: ``[(key, block_ids), ...]``: the chunks of a block transfer.
BlockChunkList = Sequence[tuple[bytes, Sequence[int]]]


class _Default(enum.Enum):
    DEFAULT = "DEFAULT"


#: Use the client's configured deadline for this kind of call.
DEFAULT = _Default.DEFAULT
Timeout = float | _Default


@dataclass
class MappingHandle:
    """A mapping as the client knows it; re-mapping after a restart updates it in place."""

    mapping_id: str
    namespace: str
    server_start_id: str
    num_blocks: int
    block_bytes: int
    layout_fingerprint: str
    ranks: list[pb.RankRegion] = field(repr=False, default_factory=list)
    #: Stable across re-maps: the leases of this handle live under it.
    lease_key: str = field(repr=False, default_factory=lambda: uuid.uuid4().hex)

    def replace_with(self, fresh: MappingHandle) -> None:
        """Adopt a re-map's identity; leases stay where they are."""
        key = self.lease_key
        self.__dict__.update(fresh.__dict__)
        self.lease_key = key


class Leases:
    """Which blocks of each mapping handle an unfinished or unprovable transfer may
    touch, and on which server start it ran (only that server can prove it ended)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # lease key -> transfer id -> (blocks, server start id)
        self._by_key: dict[str, dict[str, tuple[frozenset[int], str]]] = {}

    def acquire(self, key: str, transfer_id: str, blocks: Iterable[int], start_id: str) -> None:
        with self._lock:
            self._by_key.setdefault(key, {})[transfer_id] = (frozenset(blocks), start_id)

    def release(self, key: str, transfer_id: str) -> None:
        with self._lock:
            self._by_key.get(key, {}).pop(transfer_id, None)

    def release_all(self, key: str, start_id: str) -> None:
        with self._lock:
            leases = self._by_key.get(key, {})
            for tid in [t for t, (_, s) in leases.items() if s == start_id]:
                del leases[tid]

    def blocks(self, key: str) -> set[int]:
        with self._lock:
            out: set[int] = set()
            for blocks, _ in self._by_key.get(key, {}).values():
                out |= blocks
            return out

    def transfers(self, key: str, start_id: str | None = None) -> list[str]:
        """Leased transfer ids; with ``start_id``, those of that server start only."""
        with self._lock:
            return sorted(
                t
                for t, (_, s) in self._by_key.get(key, {}).items()
                if start_id is None or s == start_id
            )


def _header() -> pb.RequestHeader:
    return pb.RequestHeader(envelope_version=1, request_id=new_request_id())


def _unwrap(response: Any) -> Any:
    outcome = response.WhichOneof("outcome")
    if outcome == "result":
        return response.result
    if outcome == "error":
        raise from_remote_error(response.error)
    raise KVServiceError(
        f"{type(response).__name__} has neither result nor error (newer server?)",
        reason="EMPTY_RESPONSE",
    )


def _chunks(chunks: BlockChunkList) -> list[pb.BlockChunk]:
    return [pb.BlockChunk(key=key, block_ids=list(ids)) for key, ids in chunks]


@dataclass(slots=True)
class _Plan:
    """One prepared call: what to send, how long to wait, how to interpret the reply."""

    method: str
    request: Any
    timeout: float
    mapping: MappingHandle | None = None
    blocks: frozenset[int] = frozenset()
    transfer: bool = False


class _Base:
    """Request building and outcome handling shared by both clients."""

    def __init__(
        self,
        *,
        transfer_timeout: float = DEFAULT_TRANSFER_DEADLINE_S,
        control_timeout: float = DEFAULT_CONTROL_DEADLINE_S,
        remap_on_restart: bool = False,
    ) -> None:
        self.transfer_timeout = validate_deadline(transfer_timeout, "transfer_timeout")
        self.control_timeout = validate_deadline(control_timeout, "control_timeout")
        self.remap_on_restart = remap_on_restart
        self.leases = Leases()

    def leased_blocks(self, mapping: MappingHandle) -> set[int]:
        """Blocks the engine's allocator must not reuse yet."""
        return self.leases.blocks(mapping.lease_key)

    def unproven_transfers(self, mapping: MappingHandle) -> list[str]:
        """Transfer ids of ``mapping`` whose end no reply or fence has proven yet."""
        return self.leases.transfers(mapping.lease_key)

    def _timeout(self, value: Timeout, transfer: bool, name: str) -> float:
        if value is DEFAULT:
            return self.transfer_timeout if transfer else self.control_timeout
        return validate_deadline(value, name)

    # --- plans ---
    def _plan_map(self, namespace: str, ranks: Sequence[pb.RankRegion], timeout: Timeout) -> _Plan:
        req = pb.MapRequest(header=_header(), namespace=namespace, ranks=list(ranks))
        return _Plan("Map", req, self._timeout(timeout, False, "timeout"))

    def _plan_transfer(
        self,
        method: str,
        mapping: MappingHandle,
        chunks: BlockChunkList,
        timeout: Timeout,
    ) -> _Plan:
        blocks = _blocks_of(chunks)
        body = pb.BlockChunks(mapping_id=mapping.mapping_id, chunks=_chunks(chunks))
        cls = pb.StoreRequest if method == "Store" else pb.RetrieveRequest
        req = cls(header=_header(), blocks=body)
        return _Plan(
            method, req, self._timeout(timeout, True, "timeout"), mapping, blocks, transfer=True
        )

    def _plan_fence(
        self, mapping: MappingHandle | None, transfer_ids: Sequence[str], timeout: Timeout
    ) -> _Plan:
        ids = list(transfer_ids)
        if mapping is not None:
            every = self.leases.transfers(mapping.lease_key)
            mine = self.leases.transfers(mapping.lease_key, mapping.server_start_id)
            if len(every) > len(mine):
                # Copies that ran on another server start: this server cannot prove
                # they ended, so their blocks stay leased.
                raise MappingLost(
                    f"{len(every) - len(mine)} leased transfers ran on an earlier server "
                    f"start; server start {mapping.server_start_id} cannot prove they ended",
                    metadata={
                        "mappingId": mapping.mapping_id,
                        "transfers": ",".join(sorted(set(every) - set(mine))),
                    },
                )
            ids = sorted(set(ids) | set(mine))
        req = pb.FenceRequest(
            header=_header(), mapping_id=mapping.mapping_id if mapping else "", transfer_ids=ids
        )
        return _Plan("Fence", req, self._timeout(timeout, True, "timeout"), mapping)

    def _plan_unmap(self, mapping: MappingHandle, timeout: Timeout) -> _Plan:
        req = pb.UnmapRequest(header=_header(), mapping_id=mapping.mapping_id)
        return _Plan("Unmap", req, self._timeout(timeout, True, "timeout"), mapping)

    # --- outcomes ---
    def _before(self, plan: _Plan) -> None:
        if plan.mapping is not None and plan.transfer:
            self.leases.acquire(
                plan.mapping.lease_key,
                plan.request.header.request_id,
                plan.blocks,
                plan.mapping.server_start_id,
            )

    def _after(self, plan: _Plan, response: Any) -> Any:
        if plan.mapping is None:  # no lease to settle, no server start to compare
            return _unwrap(response)
        try:
            result = _unwrap(response)
        except KVServiceError as exc:
            self._settle(plan, exc)
            raise
        mapping = plan.mapping
        key = mapping.lease_key
        if plan.transfer:
            self.leases.release(key, plan.request.header.request_id)
        elif plan.method == "Fence":
            for tid in plan.request.transfer_ids:
                self.leases.release(key, tid)
        elif plan.method == "Unmap":  # the server fenced every copy of the mapping
            self.leases.release_all(key, mapping.server_start_id)
        start = getattr(result, "server_start_id", "")
        if start and start != mapping.server_start_id:
            raise MappingLost(
                f"server restarted (start id {start}, mapping made under "
                f"{mapping.server_start_id})",
                metadata={"serverStartId": start, "mappingId": mapping.mapping_id},
            )
        return result

    def _transport_error(self, plan: _Plan, exc: grpc.RpcError) -> KVServiceError:
        err = from_grpc_error(
            exc,
            request_id=plan.request.header.request_id,
            transfer_started=plan.transfer and not _never_sent(exc),
        )
        if plan.transfer and not isinstance(err, TransferUnprovable):
            err.transfer_state = NOT_STARTED
        self._settle(plan, err)
        return err

    def _settle(self, plan: _Plan, exc: KVServiceError) -> None:
        """Release a failed transfer's blocks only when the server proved it is done."""
        if plan.mapping is None or not plan.transfer:
            return
        if exc.transfer_state in (NOT_STARTED, FINISHED):
            self.leases.release(plan.mapping.lease_key, plan.request.header.request_id)
        # otherwise the lease stays until a fence proves the copy ended

    def _local_error(self, plan: _Plan, exc: Exception) -> KVServiceError:
        """The call failed inside this client (closed channel): nothing was sent."""
        err = ServiceUnavailable(
            f"the request was not sent: {exc}",
            reason="CLIENT_CLOSED",
            retryable=False,
            request_id=plan.request.header.request_id,
            transfer_state=NOT_STARTED if plan.transfer else NO_TRANSFER,
        )
        self._settle(plan, err)
        return err

    def _handle_for(self, ranks: Sequence[pb.RankRegion], namespace: str, r: Any) -> MappingHandle:
        return MappingHandle(
            r.mapping_id,
            namespace,
            r.server_start_id,
            r.num_blocks,
            r.block_bytes,
            r.layout_fingerprint,
            list(ranks),
        )


def _blocks_of(chunks: BlockChunkList) -> frozenset[int]:
    return frozenset(b for _, ids in chunks for b in ids)


def _never_sent(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE before a connection existed: the request never left the client."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return code is grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower()


class KVCacheClient(_Base):
    """Blocking client; ``*_async`` methods return ``concurrent.futures.Future``s
    that always complete (the deadline bounds them)."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self._channel = grpc.insecure_channel(target, options=channel_options())
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, plan: _Plan) -> Any:
        self._before(plan)
        try:
            response = getattr(self._stub, plan.method)(plan.request, timeout=plan.timeout)
        except grpc.RpcError as exc:
            raise self._transport_error(plan, exc) from exc
        except ValueError as exc:  # "Cannot invoke RPC on closed channel!"
            raise self._local_error(plan, exc) from exc
        return self._after(plan, response)

    def _retrying(self, mapping: MappingHandle, make: Callable[[], _Plan]) -> Any:
        try:
            return self._call(make())
        except MappingLost:
            if not self.remap_on_restart or not mapping.ranks:
                raise
            mapping.replace_with(self.map(mapping.namespace, mapping.ranks))
            return self._call(make())

    def _future(self, plan: _Plan) -> concurrent.futures.Future[Any]:
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._before(plan)
        try:
            call = getattr(self._stub, plan.method).future(plan.request, timeout=plan.timeout)
        except grpc.RpcError as exc:  # pragma: no cover - future() itself rarely raises
            out.set_exception(self._transport_error(plan, exc))
            return out
        except ValueError as exc:  # closed channel
            out.set_exception(self._local_error(plan, exc))
            return out

        def done(f: grpc.Future) -> None:
            try:
                out.set_result(self._after(plan, f.result()))
            except grpc.RpcError as exc:
                err = self._transport_error(plan, exc)
                err.__cause__ = exc
                out.set_exception(err)
            except BaseException as exc:  # noqa: BLE001 - the future must complete
                out.set_exception(exc)

        call.add_done_callback(done)
        return out

    # --- API ---
    def map(
        self, namespace: str, ranks: Sequence[pb.RankRegion], *, timeout: Timeout = DEFAULT
    ) -> MappingHandle:
        r = self._call(self._plan_map(namespace, ranks, timeout))
        return self._handle_for(ranks, namespace, r)

    def unmap(self, mapping: MappingHandle, *, timeout: Timeout = DEFAULT) -> pb.UnmapResult:
        return self._call(self._plan_unmap(mapping, timeout))

    def store(
        self, mapping: MappingHandle, chunks: BlockChunkList, *, timeout: Timeout = DEFAULT
    ) -> pb.StoreResult:
        return self._retrying(
            mapping, lambda: self._plan_transfer("Store", mapping, chunks, timeout)
        )

    def retrieve(
        self, mapping: MappingHandle, chunks: BlockChunkList, *, timeout: Timeout = DEFAULT
    ) -> pb.RetrieveResult:
        return self._retrying(
            mapping, lambda: self._plan_transfer("Retrieve", mapping, chunks, timeout)
        )

    def store_async(
        self, mapping: MappingHandle, chunks: BlockChunkList, *, timeout: Timeout = DEFAULT
    ) -> concurrent.futures.Future[pb.StoreResult]:
        return self._future(self._plan_transfer("Store", mapping, chunks, timeout))

    def retrieve_async(
        self, mapping: MappingHandle, chunks: BlockChunkList, *, timeout: Timeout = DEFAULT
    ) -> concurrent.futures.Future[pb.RetrieveResult]:
        return self._future(self._plan_transfer("Retrieve", mapping, chunks, timeout))

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        mapping: MappingHandle | None = None,
        namespace: str | None = None,
        timeout: Timeout = DEFAULT,
    ) -> int:
        req = _lookup_request(keys, mapping, namespace)
        return int(
            self._call(_Plan("Lookup", req, self._timeout(timeout, False, "timeout"))).hit_chunks
        )

    def fence(
        self,
        mapping: MappingHandle | None = None,
        transfer_ids: Sequence[str] = (),
        *,
        timeout: Timeout = DEFAULT,
    ) -> pb.FenceResult:
        """Prove that no copy of ``mapping`` (or of the listed transfers) still runs,
        and release the blocks their leases held."""
        return self._call(self._plan_fence(mapping, transfer_ids, timeout))

    def server_info(self, *, timeout: Timeout = DEFAULT) -> pb.GetServerInfoResult:
        req = pb.GetServerInfoRequest(header=_header())
        return self._call(_Plan("GetServerInfo", req, self._timeout(timeout, False, "timeout")))

    def register_memfd(self, fd: int, *, timeout: Timeout = DEFAULT) -> str:
        """Pass a sealed memfd (``kvsvc.fdpass.make_sealed_memfd``) to the server, for
        the fast CPU region kind; returns the token a ``SealedMemfdHandle`` names."""
        budget = self._timeout(timeout, False, "timeout")
        return fdpass.send_fd(_fd_socket(self.server_info(timeout=budget)), fd, budget)

    def put(
        self, namespace: str, chunks: Sequence[tuple[bytes, bytes]], *, timeout: Timeout = DEFAULT
    ) -> pb.StoreResult:
        """Store chunks sent inline (no mapped memory)."""
        return self._call(_inline_store(namespace, chunks, self._timeout(timeout, True, "timeout")))

    def get_many(
        self, namespace: str, keys: Sequence[bytes], *, timeout: Timeout = DEFAULT
    ) -> list[bytes]:
        """The leading present chunks, inline; stops at the first miss."""
        plan = _inline_retrieve(namespace, keys, self._timeout(timeout, True, "timeout"))
        return [c.data for c in self._call(plan).chunks]

    def get(self, namespace: str, key: bytes, *, timeout: Timeout = DEFAULT) -> bytes:
        """One chunk, inline; a miss is an error here."""
        plan = _inline_retrieve(namespace, [key], self._timeout(timeout, True, "timeout"))
        return _one_or_miss(self._call(plan), plan, namespace, key)


class AsyncKVCacheClient(_Base):
    """asyncio client with the same methods; create it inside the running loop."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self._channel = grpc.aio.insecure_channel(target, options=channel_options())
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, plan: _Plan) -> Any:
        self._before(plan)
        try:
            response = await getattr(self._stub, plan.method)(plan.request, timeout=plan.timeout)
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
                    request_id=plan.request.header.request_id,
                    transfer_state=UNKNOWN if plan.transfer else NO_TRANSFER,
                ) from exc
            raise
        return self._after(plan, response)

    async def _retrying(self, mapping: MappingHandle, make: Callable[[], _Plan]) -> Any:
        try:
            return await self._call(make())
        except MappingLost:
            if not self.remap_on_restart or not mapping.ranks:
                raise
            mapping.replace_with(await self.map(mapping.namespace, mapping.ranks))
            return await self._call(make())

    async def map(
        self, namespace: str, ranks: Sequence[pb.RankRegion], *, timeout: Timeout = DEFAULT
    ) -> MappingHandle:
        r = await self._call(self._plan_map(namespace, ranks, timeout))
        return self._handle_for(ranks, namespace, r)

    async def unmap(self, mapping: MappingHandle, *, timeout: Timeout = DEFAULT) -> pb.UnmapResult:
        return await self._call(self._plan_unmap(mapping, timeout))

    async def store(
        self, mapping: MappingHandle, chunks: BlockChunkList, *, timeout: Timeout = DEFAULT
    ) -> pb.StoreResult:
        return await self._retrying(
            mapping, lambda: self._plan_transfer("Store", mapping, chunks, timeout)
        )

    async def retrieve(
        self, mapping: MappingHandle, chunks: BlockChunkList, *, timeout: Timeout = DEFAULT
    ) -> pb.RetrieveResult:
        return await self._retrying(
            mapping, lambda: self._plan_transfer("Retrieve", mapping, chunks, timeout)
        )

    def store_async(
        self, mapping: MappingHandle, chunks: BlockChunkList, *, timeout: Timeout = DEFAULT
    ) -> asyncio.Task[pb.StoreResult]:
        return asyncio.ensure_future(
            self._call(self._plan_transfer("Store", mapping, chunks, timeout))
        )

    def retrieve_async(
        self, mapping: MappingHandle, chunks: BlockChunkList, *, timeout: Timeout = DEFAULT
    ) -> asyncio.Task[pb.RetrieveResult]:
        return asyncio.ensure_future(
            self._call(self._plan_transfer("Retrieve", mapping, chunks, timeout))
        )

    async def lookup(
        self,
        keys: Sequence[bytes],
        *,
        mapping: MappingHandle | None = None,
        namespace: str | None = None,
        timeout: Timeout = DEFAULT,
    ) -> int:
        req = _lookup_request(keys, mapping, namespace)
        plan = _Plan("Lookup", req, self._timeout(timeout, False, "timeout"))
        return int((await self._call(plan)).hit_chunks)

    async def fence(
        self,
        mapping: MappingHandle | None = None,
        transfer_ids: Sequence[str] = (),
        *,
        timeout: Timeout = DEFAULT,
    ) -> pb.FenceResult:
        return await self._call(self._plan_fence(mapping, transfer_ids, timeout))

    async def server_info(self, *, timeout: Timeout = DEFAULT) -> pb.GetServerInfoResult:
        req = pb.GetServerInfoRequest(header=_header())
        plan = _Plan("GetServerInfo", req, self._timeout(timeout, False, "timeout"))
        return await self._call(plan)

    async def register_memfd(self, fd: int, *, timeout: Timeout = DEFAULT) -> str:
        """Pass a sealed memfd to the server (see KVCacheClient.register_memfd)."""
        budget = self._timeout(timeout, False, "timeout")
        path = _fd_socket(await self.server_info(timeout=budget))
        return await asyncio.to_thread(fdpass.send_fd, path, fd, budget)

    async def put(
        self, namespace: str, chunks: Sequence[tuple[bytes, bytes]], *, timeout: Timeout = DEFAULT
    ) -> pb.StoreResult:
        plan = _inline_store(namespace, chunks, self._timeout(timeout, True, "timeout"))
        return await self._call(plan)

    async def get_many(
        self, namespace: str, keys: Sequence[bytes], *, timeout: Timeout = DEFAULT
    ) -> list[bytes]:
        plan = _inline_retrieve(namespace, keys, self._timeout(timeout, True, "timeout"))
        return [c.data for c in (await self._call(plan)).chunks]

    async def get(self, namespace: str, key: bytes, *, timeout: Timeout = DEFAULT) -> bytes:
        """One chunk, inline; a miss is an error here."""
        plan = _inline_retrieve(namespace, [key], self._timeout(timeout, True, "timeout"))
        return _one_or_miss(await self._call(plan), plan, namespace, key)


def _fd_socket(info: pb.GetServerInfoResult) -> str:
    if not info.fd_socket:
        raise Unimplemented(
            "the server has no fd socket (--fd-socket off, or it could not make one: "
            "see its log), so it takes no memfds; map a file under its shm dir instead",
            reason="FD_PASSING_DISABLED",
        )
    return info.fd_socket


def _one_or_miss(result: pb.RetrieveResult, plan: _Plan, namespace: str, key: bytes) -> bytes:
    if not result.chunks:
        raise Miss(
            f"chunk {key.hex()[:32]} is not stored in namespace {namespace!r}",
            metadata={"key": key.hex(), "namespace": namespace},
            request_id=plan.request.header.request_id,
        )
    return bytes(result.chunks[0].data)


def _lookup_request(
    keys: Sequence[bytes], mapping: MappingHandle | None, namespace: str | None
) -> pb.LookupRequest:
    if (mapping is None) == (namespace is None):
        raise ValueError("lookup needs exactly one of mapping= or namespace=")
    if mapping is not None:
        req = pb.LookupRequest(mapping_id=mapping.mapping_id, keys=keys)
    else:
        req = pb.LookupRequest(namespace=namespace or "", keys=keys)
    # Filled in place: a RequestHeader passed to the constructor would be copied.
    header = req.header
    header.envelope_version = 1
    header.request_id = new_request_id()
    return req


def _inline_store(namespace: str, chunks: Sequence[tuple[bytes, bytes]], timeout: float) -> _Plan:
    body = pb.InlineChunks(
        namespace=namespace, chunks=[pb.InlineChunk(key=k, data=d) for k, d in chunks]
    )
    return _Plan("Store", pb.StoreRequest(header=_header(), inline=body), timeout)


def _inline_retrieve(namespace: str, keys: Sequence[bytes], timeout: float) -> _Plan:
    body = pb.InlineKeys(namespace=namespace, keys=list(keys))
    return _Plan("Retrieve", pb.RetrieveRequest(header=_header(), inline=body), timeout)
