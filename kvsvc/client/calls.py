"""The client's calls, declared once (kvsvc.client drives them).

The table of calls (``MAP`` ... ``DROP_NAMESPACE``) and the steps an operation
yields are in kvsvc.client.plans; ``Core`` holds what both clients share. Each
public client method is written once below, as an operation: a generator that
yields the RPCs it needs and receives their typed results (or has their typed
errors thrown in). Nothing here does I/O, so the blocking, future and asyncio
clients run the same operations.

Blocks a transfer may touch are leased until its outcome is proven (a result,
NOT_STARTED, FINISHED, or a later successful fence); ``TransferUnprovable`` keeps
them leased, and nothing releases them on a timer.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvsvc.client import fdpass
from kvsvc.client.plans import (
    CONTROL,
    DEFAULT,
    DROP_NAMESPACE,
    FENCE,
    GET,
    LOOKUP,
    MAP,
    PUT,
    RETRIEVE,
    SERVER_INFO,
    STORE,
    TRANSFER,
    UNMAP,
    BlockChunkList,
    Blocking,
    Call,
    Deadline,
    Lease,
    Leases,
    MappingHandle,
    Parallel,
    Plan,
    R,
    ResT,
    Steps,
    Timeout,
)
from kvsvc.errors import (
    FINISHED,
    NO_TRANSFER,
    NOT_STARTED,
    KVServiceError,
    MappingLost,
    Miss,
    ServiceUnavailable,
    TransferUnprovable,
    Unimplemented,
    from_grpc_error,
    from_remote_error,
)
from kvsvc.framing import BATCH_BYTES
from kvsvc.ids import new_request_id
from kvsvc.limits import DEFAULT_CONTROL_DEADLINE_S, DEFAULT_TRANSFER_DEADLINE_S, validate_deadline
from kvsvc.pidfds import ProcessWatch
from kvsvc.v1 import kv_cache_service_pb2 as pb


class Core:
    """What both clients share: deadlines, leases, and turning replies into results
    or typed errors."""

    def __init__(
        self,
        *,
        transfer_timeout: float = DEFAULT_TRANSFER_DEADLINE_S,
        control_timeout: float = DEFAULT_CONTROL_DEADLINE_S,
        remap_on_restart: bool = False,
        fd_socket: str | None = None,
        session: bool = True,
    ) -> None:
        self.transfer_timeout = validate_deadline(transfer_timeout, "transfer_timeout")
        self.control_timeout = validate_deadline(control_timeout, "control_timeout")
        self.remap_on_restart = remap_on_restart
        # Where this process reaches the server's fd socket, when not where the
        # server says (another container mounts the socket directory elsewhere).
        self.fd_socket = fd_socket
        #: Lookup/Store/Retrieve/Fence over one Session stream (unary where the
        #: server has none); False: every call unary.
        self.use_session = session
        self.leases = Leases()
        self._fd_leases: dict[str, fdpass.FdLease] = {}
        self._fd_leases_lock = threading.Lock()
        self._fd_lease_path: str | None = None  # the fd socket register_memfd last used

    def _fd_lease(self, path: str) -> fdpass.FdLease:
        """This client's lease connection to the fd socket at ``path``."""
        with self._fd_leases_lock:
            lease = self._fd_leases.get(path)
            if lease is None:
                lease = self._fd_leases[path] = fdpass.FdLease(path)
            self._fd_lease_path = path
            return lease

    def fd_server_watch(self, path: str | None = None) -> ProcessWatch | None:
        """A watch of the server process that took this client's fds over its lease
        to the fd socket at ``path`` (the one ``register_memfd`` last used when
        None): once it has exited, none of its copies into or out of that memory
        can still run. None where there is no such lease or the process cannot be
        watched (another pid namespace, no pidfds)."""
        with self._fd_leases_lock:
            lease = self._fd_leases.get(path or self._fd_lease_path or "")
        return None if lease is None else lease.server_watch()

    def _close_fd_leases(self) -> None:
        """Ends the leases: the server releases the mappings of memfds passed here."""
        with self._fd_leases_lock:
            leases, self._fd_leases = list(self._fd_leases.values()), {}
        for lease in leases:
            lease.close()

    def leased_blocks(self, mapping: MappingHandle) -> set[int]:
        """Blocks the engine's allocator must not reuse yet."""
        return self.leases.blocks(mapping.lease_key)

    def unproven_transfers(self, mapping: MappingHandle) -> list[str]:
        """Transfer ids of ``mapping`` whose end no reply or fence has proven yet."""
        return self.leases.transfers(mapping.lease_key)

    def _timeout(self, value: Timeout, deadline: Deadline) -> float:
        if value is DEFAULT:
            return self.transfer_timeout if deadline is TRANSFER else self.control_timeout
        return validate_deadline(value, "timeout")

    def _plan(
        self,
        call: Call[ResT],
        request: Any,
        timeout: Timeout,
        mapping: MappingHandle | None = None,
        blocks: frozenset[int] = frozenset(),
    ) -> Plan[ResT]:
        return Plan(call, request, self._timeout(timeout, call.deadline), mapping, blocks)

    def _before(self, plan: Plan[Any]) -> None:
        if plan.mapping is not None and plan.transfer:
            self.leases.acquire(
                plan.mapping.lease_key, plan.request_id, plan.blocks, plan.mapping.server_start_id
            )

    def _after(self, plan: Plan[ResT], response: Any) -> ResT:
        if plan.mapping is None:  # no lease to settle, no server start to compare
            return _unwrap(response)
        try:
            result: ResT = _unwrap(response)
        except KVServiceError as exc:
            self._settle(plan, exc)
            raise
        mapping = plan.mapping
        key = mapping.lease_key
        if plan.call.lease is Lease.TRANSFER:
            self.leases.release(key, plan.request_id)
        elif plan.call.lease is Lease.FENCE:
            for tid in plan.request.transfer_ids:
                self.leases.release(key, tid)
        elif plan.call.lease is Lease.UNMAP:  # the server fenced every copy of the mapping
            self.leases.release_all(key, mapping.server_start_id)
        start = getattr(result, "server_start_id", "")
        if start and start != mapping.server_start_id:
            raise MappingLost(
                f"server restarted (start id {start}, mapping made under "
                f"{mapping.server_start_id})",
                metadata={"serverStartId": start, "mappingId": mapping.mapping_id},
            )
        return result

    def _transport_error(self, plan: Plan[Any], exc: grpc.RpcError) -> KVServiceError:
        err = from_grpc_error(
            exc,
            request_id=plan.request_id,
            transfer_started=plan.transfer and not _never_sent(exc),
        )
        if plan.transfer and not isinstance(err, TransferUnprovable):
            err.transfer_state = NOT_STARTED
        self._settle(plan, err)
        return err

    def _local_error(self, plan: Plan[Any], exc: Exception) -> KVServiceError:
        """The call failed inside this client (closed channel): nothing was sent."""
        err = ServiceUnavailable(
            f"the request was not sent: {exc}",
            reason="CLIENT_CLOSED",
            retryable=False,
            request_id=plan.request_id,
            transfer_state=NOT_STARTED if plan.transfer else NO_TRANSFER,
        )
        self._settle(plan, err)
        return err

    def _settle(self, plan: Plan[Any], exc: KVServiceError) -> None:
        """Release a failed transfer's blocks only when the server proved it is done."""
        if plan.mapping is None or not plan.transfer:
            return
        if exc.transfer_state in (NOT_STARTED, FINISHED):
            self.leases.release(plan.mapping.lease_key, plan.request_id)
        # otherwise the lease stays until a fence proves the copy ended

    def _fenced(self, mapping: MappingHandle | None, transfer_ids: Sequence[str]) -> list[str]:
        """The transfers a fence covers: the listed ones and every leased one of
        ``mapping`` that ran on its server start."""
        ids = list(transfer_ids)
        if mapping is None:
            return ids
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
        return sorted(set(ids) | set(mine))


# --- operations: one per public client method, with its signature ---
# (``map`` shadows the builtin in this module on purpose: it is the method's name.)


def map(
    c: Core, namespace: str, ranks: Sequence[pb.RankRegion], *, timeout: Timeout = DEFAULT
) -> Steps[MappingHandle]:
    """Map the ranks' KV memory, all or none; the handle names it in later calls."""
    req = pb.MapRequest(header=_header(), namespace=namespace, ranks=list(ranks))
    r = yield from _send(c._plan(MAP, req, timeout))
    return MappingHandle(
        r.mapping_id,
        namespace,
        r.server_start_id,
        r.num_blocks,
        r.block_bytes,
        r.layout_fingerprint,
        list(ranks),
    )


def unmap(c: Core, mapping: MappingHandle, *, timeout: Timeout = DEFAULT) -> Steps[pb.UnmapResult]:
    """Release the mapping once the server fenced its copies."""
    req = pb.UnmapRequest(header=_header(), mapping_id=mapping.mapping_id)
    return (yield from _send(c._plan(UNMAP, req, timeout, mapping)))


def store(
    c: Core,
    mapping: MappingHandle,
    chunks: BlockChunkList,
    *,
    namespace: str | None = None,
    timeout: Timeout = DEFAULT,
) -> Steps[pb.StoreResult]:
    """Copy the chunks' blocks into the store (re-mapped once after a server restart
    with ``remap_on_restart``), under the mapping's namespace or ``namespace``."""
    return (
        yield from _remapping(
            c, mapping, lambda: _transfer(c, STORE, mapping, chunks, timeout, namespace)
        )
    )


def retrieve(
    c: Core,
    mapping: MappingHandle,
    chunks: BlockChunkList,
    *,
    namespace: str | None = None,
    timeout: Timeout = DEFAULT,
) -> Steps[pb.RetrieveResult]:
    """Copy stored chunks into the blocks (re-mapped once after a server restart
    with ``remap_on_restart``)."""
    return (
        yield from _remapping(
            c, mapping, lambda: _transfer(c, RETRIEVE, mapping, chunks, timeout, namespace)
        )
    )


def store_async(
    c: Core,
    mapping: MappingHandle,
    chunks: BlockChunkList,
    *,
    namespace: str | None = None,
    timeout: Timeout = DEFAULT,
) -> Steps[pb.StoreResult]:
    """``store`` as a future, without re-mapping; its deadline bounds it."""
    return _send(_transfer(c, STORE, mapping, chunks, timeout, namespace))  # checked now


def retrieve_async(
    c: Core,
    mapping: MappingHandle,
    chunks: BlockChunkList,
    *,
    namespace: str | None = None,
    timeout: Timeout = DEFAULT,
) -> Steps[pb.RetrieveResult]:
    """``retrieve`` as a future, without re-mapping; its deadline bounds it."""
    return _send(_transfer(c, RETRIEVE, mapping, chunks, timeout, namespace))


def store_many(
    c: Core,
    mapping: MappingHandle,
    requests: Sequence[BlockChunkList],
    *,
    namespace: str | None = None,
    timeout: Timeout = DEFAULT,
) -> Steps[list[pb.StoreResult | KVServiceError]]:
    """Several Stores at once, each with its own deadline and leases (pipelined
    on the session): each entry is that Store's result or its typed error."""
    plans = [_transfer(c, STORE, mapping, chunks, timeout, namespace) for chunks in requests]
    return (yield from _parallel(plans))


def retrieve_many(
    c: Core,
    mapping: MappingHandle,
    requests: Sequence[BlockChunkList],
    *,
    namespace: str | None = None,
    timeout: Timeout = DEFAULT,
) -> Steps[list[pb.RetrieveResult | KVServiceError]]:
    """Several Retrieves at once, as ``store_many``."""
    plans = [_transfer(c, RETRIEVE, mapping, chunks, timeout, namespace) for chunks in requests]
    return (yield from _parallel(plans))


def lookup(
    c: Core,
    scope: str | MappingHandle | Sequence[bytes],
    keys: Sequence[bytes] | None = None,
    /,
    *,
    mapping: MappingHandle | None = None,
    namespace: str | None = None,
    timeout: Timeout = DEFAULT,
) -> Steps[int]:
    """How many of ``keys``, from the first, are stored in a namespace, or in a
    mapping's: ``lookup("ns", keys)``, ``lookup(mapping, keys)``, the namespace or
    mapping first as in ``put``, ``get`` and ``store``. ``lookup(keys,
    namespace="ns")`` and ``lookup(keys, mapping=m)`` mean the same."""
    if keys is None:  # lookup(keys, namespace= or mapping=)
        if isinstance(scope, (str, MappingHandle)):
            raise TypeError("lookup(namespace or mapping, keys): no keys given")
        keys = scope
    elif mapping is not None or namespace is not None:
        raise TypeError("lookup(namespace or mapping, keys): namespace= or mapping= given too")
    elif isinstance(scope, MappingHandle):
        mapping = scope
    elif isinstance(scope, str):
        namespace = scope
    else:
        raise TypeError(f"lookup(namespace or mapping, keys): not a namespace: {scope!r}")
    r = yield from _send(c._plan(LOOKUP, _lookup_request(keys, mapping, namespace), timeout))
    return int(r.hit_chunks)


def fence(
    c: Core,
    mapping: MappingHandle | None = None,
    transfer_ids: Sequence[str] = (),
    *,
    timeout: Timeout = DEFAULT,
) -> Steps[pb.FenceResult]:
    """Prove that no copy of ``mapping`` (or of the listed transfers) still runs,
    and release the blocks their leases held."""
    ids = c._fenced(mapping, transfer_ids)
    req = pb.FenceRequest(
        header=_header(), mapping_id=mapping.mapping_id if mapping else "", transfer_ids=ids
    )
    return (yield from _send(c._plan(FENCE, req, timeout, mapping)))


def server_info(
    c: Core, *, stats: bool = False, timeout: Timeout = DEFAULT
) -> Steps[pb.GetServerInfoResult]:
    """The server's identity, limits and fd socket; with ``stats``, its FULL view
    too (``result.stats``: what ``kvsvc stats`` shows)."""
    view = pb.SERVER_INFO_VIEW_FULL if stats else pb.SERVER_INFO_VIEW_BASIC
    request = pb.GetServerInfoRequest(header=_header(), view=view)
    return (yield from _send(c._plan(SERVER_INFO, request, timeout)))


def drop_namespace(
    c: Core, namespace: str, *, timeout: Timeout = DEFAULT
) -> Steps[pb.DropNamespaceResult]:
    """Drop every chunk of one of the caller's namespaces, in every tier the server
    has (``redis_complete`` / ``s3_complete`` / ``mooncake_complete`` False:
    Redis / S3 / Mooncake did not finish within the deadline)."""
    req = pb.DropNamespaceRequest(header=_header(), namespace=namespace)
    return (yield from _send(c._plan(DROP_NAMESPACE, req, timeout)))


def register_memfd(
    c: Core, fd: int, *, shared_file: bool = False, timeout: Timeout = DEFAULT
) -> Steps[str]:
    """Pass a sealed memfd (``kvsvc.client.fdpass.make_sealed_memfd``) to the server, for
    the fast CPU region kind; returns the token a ``SealedMemfdHandle`` names.
    ``shared_file``: ``fd`` is a plain shared-memory file opened read-write that its
    owner cannot seal (vLLM's offload file); the server copies it with positional
    I/O instead of mapping it.

    The fd goes over this client's lease connection: the server keeps mappings of
    it while this client is open, and releases them when it closes or this
    process dies (in any container). The socket is the client's ``fd_socket``,
    else the one the server reports."""
    budget = c._timeout(timeout, CONTROL)
    path = c.fd_socket or _fd_socket((yield from server_info(c, timeout=budget)))
    lease = c._fd_lease(path)
    send = functools.partial(lease.send, fd, budget, shared_file=shared_file)
    return (yield from _blocking(send))


def put(
    c: Core, namespace: str, chunks: Sequence[tuple[bytes, bytes]], *, timeout: Timeout = DEFAULT
) -> Steps[pb.StoreResult]:
    """Store chunks sent inline (no mapped memory)."""
    body = pb.InlineChunks(
        namespace=namespace, chunks=[pb.InlineChunk(key=k, data=d) for k, d in chunks]
    )
    plan = c._plan(PUT, pb.StoreRequest(header=_header(), inline=body), timeout)
    if (size := plan.request.ByteSize()) >= BATCH_BYTES:
        plan.declared = size  # unary, its size declared: refused before it is read
    return (yield from _send(plan))


def get_many(
    c: Core, namespace: str, keys: Sequence[bytes], *, timeout: Timeout = DEFAULT
) -> Steps[list[bytes]]:
    """The leading present chunks, inline; stops at the first miss."""
    r = yield from _send(_inline_get(c, namespace, keys, timeout))
    return [chunk.data for chunk in r.chunks]


def get(c: Core, namespace: str, key: bytes, *, timeout: Timeout = DEFAULT) -> Steps[bytes]:
    """One chunk, inline; a miss is an error here."""
    plan = _inline_get(c, namespace, [key], timeout)
    r = yield from _send(plan)
    if not r.chunks:
        raise Miss(
            f"chunk {key.hex()[:32]} is not stored in namespace {namespace!r}",
            metadata={"key": key.hex(), "namespace": namespace},
            request_id=plan.request_id,
        )
    return bytes(r.chunks[0].data)


# --- building blocks ---
def _send(plan: Plan[ResT]) -> Steps[ResT]:
    """One RPC: the driver sends back its typed result or throws in its typed error."""
    result: ResT = yield plan
    return result


def _parallel(plans: list[Plan[Any]]) -> Steps[list[Any]]:
    results: list[Any] = yield Parallel(plans)
    return results


def _blocking(fn: Callable[[], R]) -> Steps[R]:
    result: R = yield Blocking(fn)
    return result


def _remapping(c: Core, mapping: MappingHandle, make: Callable[[], Plan[ResT]]) -> Steps[ResT]:
    """``make``'s call; after a server restart, with ``remap_on_restart``, re-map and
    make it once more."""
    try:
        return (yield from _send(make()))
    except MappingLost:
        if not c.remap_on_restart or not mapping.ranks:
            raise
        mapping.replace_with((yield from map(c, mapping.namespace, mapping.ranks)))
        return (yield from _send(make()))


def _transfer(
    c: Core,
    call: Call[ResT],
    mapping: MappingHandle,
    chunks: BlockChunkList,
    timeout: Timeout,
    namespace: str | None = None,
) -> Plan[ResT]:
    """A block Store or Retrieve (``namespace``: another of the caller's namespaces
    than the mapping's, e.g. a cache salt's; the chunks keep the mapping's layout)."""
    body = pb.BlockChunks(
        mapping_id=mapping.mapping_id,
        chunks=[pb.BlockChunk(key=key, block_ids=list(ids)) for key, ids in chunks],
        namespace=namespace or "",
    )
    blocks = frozenset(b for _, ids in chunks for b in ids)
    return c._plan(call, call.request(header=_header(), blocks=body), timeout, mapping, blocks)


def _inline_get(
    c: Core, namespace: str, keys: Sequence[bytes], timeout: Timeout
) -> Plan[pb.RetrieveResult]:
    body = pb.InlineKeys(namespace=namespace, keys=list(keys))
    return c._plan(GET, pb.RetrieveRequest(header=_header(), inline=body), timeout)


def _header() -> pb.RequestHeader:
    return pb.RequestHeader(envelope_version=1, request_id=new_request_id())


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


def _never_sent(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE before a connection existed: the request never left the client."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return code is grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower()


def _fd_socket(info: pb.GetServerInfoResult) -> str:
    if not info.fd_socket:
        raise Unimplemented(
            "the server has no fd socket (--fd-socket off, or it could not make one: "
            "see its log), so it takes no memfds; map a file under its shm dir instead",
            reason="FD_PASSING_DISABLED",
        )
    return info.fd_socket
