"""RPC handling: a grpc.aio servicer whose every RPC goes through one wrapper
that validates, dispatches and turns any exception into a RemoteError. Handlers
validate, pick each chunk's engine side (kvsvc.server.data.copies), reserve in the store and
hand the copy to the transfer engine. Start, signals and stop: kvsvc.server.lifecycle."""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import contextvars
import functools
import inspect
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from time import monotonic
from typing import Any, TypeVar

import grpc
import torch
from google.protobuf import timestamp_pb2

from kvsvc import __version__
from kvsvc.errors import (
    ENVELOPE_VERSION,
    FINISHED,
    NO_TRANSFER,
    NOT_STARTED,
    UNKNOWN,
    CapacityExhausted,
    DeadlineExceeded,
    FatalServerError,
    InvalidRequest,
    KVServiceError,
    MalformedRequest,
    MappingLost,
    RegionUnavailable,
    Unparsed,
    UnsupportedRequest,
    to_remote_error,
)
from kvsvc.framing import SESSION_BATCH, batched, speaks_batches
from kvsvc.ids import new_request_id
from kvsvc.layout import rank_label, rank_metadata
from kvsvc.limits import MAX_KEY_BYTES, MAX_NAMESPACE_BYTES
from kvsvc.logs import REQUEST_ID
from kvsvc.server import failpoints
from kvsvc.server.auth import DEFAULT_TENANT, Tenant, current_tenant
from kvsvc.server.config import (
    MAPPING_REAP_INTERVAL_S,
    ConfigError,
    ServerConfig,
    shm_owner_uids,
    socket_gid,
)
from kvsvc.server.data import fdbroker
from kvsvc.server.data.copies import Blocks, Digest, Inline, Piece, Side, segment_count, tasks
from kvsvc.server.data.regions import Mapping, RankMapping, open_rank
from kvsvc.server.data.store import INLINE_LAYOUT, Chunk, ChunkStore
from kvsvc.server.data.transfer import Stream, TransferEngine, reply_budget
from kvsvc.server.health import Health
from kvsvc.server.metrics import Metrics
from kvsvc.server.tiers.redis import RemoteTier
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

log = logging.getLogger("kvsvc.server.servicer")
R = TypeVar("R")
MAP_RETRY_S = 0.02
#: A SessionRequest's kind -> the RPC whose wrapper and handler serve it.
#: How long after a Session request's deadline the server stops waiting for it.
SESSION_GRACE_S = 1.0
#: A Session's reader hands the loop to other calls after this many requests of a batch.
SESSION_BATCH_TURN = 64
SESSION_RPCS = {"lookup": "Lookup", "store": "Store", "retrieve": "Retrieve", "fence": "Fence"}


class Call:
    """Per-request state the wrapper reads when it builds an error."""

    __slots__ = ("deadline", "key", "request_id", "started", "tenant", "transfer")

    def __init__(
        self, request_id: str, deadline: float, transfer: bool, tenant: Tenant = DEFAULT_TENANT
    ) -> None:
        self.request_id = request_id
        #: monotonic; the client's, or the default for calls without one
        self.deadline = deadline
        self.transfer = transfer
        self.started = False
        #: who calls (kvsvc.server.auth): every mapping, namespace and transfer id it
        #: names is its own
        self.tenant = tenant
        #: the transfer engine's id of this call: tenants never share one
        self.key = tenant.scoped(request_id)


def rpc(response_cls: type[Any], *, transfer: bool = False) -> Callable[..., Any]:
    """The one wrapper every RPC goes through: no exception leaves it, no request is dropped.

    A handler that never waits may be a plain function: it is called without the
    coroutine an ``async def`` costs on every call."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        name = fn.__name__
        is_async = inspect.iscoroutinefunction(fn)

        async def dispatch(self: KVCacheServicer, request: Any, call: Call) -> Any:
            if failpoints.ENABLED:
                failpoints.hit("loop.stall", name)
                await failpoints.hit_async("handler.enter", name)
            header = request.header
            if header.envelope_version not in (0, ENVELOPE_VERSION):
                raise UnsupportedRequest(
                    f"envelope version {header.envelope_version} is not spoken here "
                    f"(this server speaks {ENVELOPE_VERSION})",
                    reason="UNSUPPORTED_ENVELOPE_VERSION",
                    metadata={
                        "envelopeVersion": header.envelope_version,
                        "supported": ENVELOPE_VERSION,
                    },
                )
            if transfer:
                self.health.check_serving()
                self._admit(call)
            result = (await fn(self, request, call)) if is_async else fn(self, request, call)
            if not is_async and inspect.iscoroutine(result):
                result = await result  # a plain handler that has to wait this time
            # A handler may build its whole response (cheaper than copying a result in).
            return result if type(result) is response_cls else response_cls(result=result)

        async def serve(
            self: KVCacheServicer,
            request: Any,
            context: grpc.aio.ServicerContext,
            remaining: float | None,
            bound: bool,
        ) -> Any:
            """One request, from a unary call or a Session stream (``bound``: nothing
            else ends it at its deadline, so the wrapper does)."""
            request_id = request.header.request_id or new_request_id()
            started = monotonic()  # one clock for the deadline and the latency metric
            call = Call(
                request_id,
                started + (self.config.default_deadline if remaining is None else remaining),
                transfer,
                current_tenant(),
            )
            outcome = "result"
            token = REQUEST_ID.set(request_id)
            try:
                if type(request) is Unparsed:  # its bytes did not parse (logged when parsed)
                    outcome = MalformedRequest.reason
                    return response_cls(error=request.envelope(request_id, transfer))
                if (remaining is None or bound) and (is_async or failpoints.ENABLED):
                    # No client deadline: the default one bounds every wait here. A
                    # Session request's own: its client answers itself at the deadline
                    # (as gRPC does for unary calls), so the server ends a little later.
                    # A plain handler never waits (only a failpoint may): unbounded.
                    grace = SESSION_GRACE_S if remaining is not None else 0.0
                    return await self._bounded(
                        dispatch(self, request, call), name, call, remaining is None, grace
                    )
                return await dispatch(self, request, call)
            except asyncio.CancelledError:
                # The client cancelled or its deadline passed: nobody reads a reply.
                outcome = "CANCELLED"
                log.info("%s %s cancelled by the client", name, call.request_id)
                raise
            except BaseException as exc:  # noqa: BLE001 - the contract: every failure gets a reply
                response = await self._error(name, call, exc, response_cls)
                outcome = response.error.reason
                return response
            finally:
                REQUEST_ID.reset(token)
                self.metrics.observe_request(name, outcome, monotonic() - started)

        @functools.wraps(fn)
        async def handler(
            self: KVCacheServicer, request: Any, context: grpc.aio.ServicerContext
        ) -> Any:
            return await serve(self, request, context, context.time_remaining(), False)

        handler.serve = serve  # type: ignore[attr-defined]  # for Session's requests
        return handler

    return decorate


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    def __init__(self, config: ServerConfig, health: Health) -> None:
        self.config = config
        self.health = health
        self.start_id = uuid.uuid4().hex
        self.start_time = time.time()
        cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        self.device = "cuda" if cuda else "cpu"
        self.store = ChunkStore(config.store_bytes, pin_memory=cuda)
        self.loop = asyncio.get_running_loop()
        #: the shared tier behind the store (None: --remote off); checks its credentials
        self.remote = RemoteTier(config, self.store, self.loop) if config.remote != "off" else None
        if self.remote is not None:
            self.remote.start()
        self.engine = TransferEngine(config.transfer_threads, config.inline_copy_bytes)
        self.engine.on_fatal = self.fatal_threadsafe
        self.mappings: dict[str, Mapping] = {}
        self._sessions: set[Callable[[], None]] = set()  # how each Session stops reading
        self._sessions_ending = False
        self.fds = self._fd_broker(config)
        #: whose files Map opens by name (--shm-uids; regions.open_trusted)
        self.shm_owners = shm_owner_uids(config.shm_uids)
        self._reap_wake = asyncio.Event()
        #: set by stop_reaping: a cancel alone can be lost inside wait_for (Python
        #: 3.11, when the wake-up comes at the same moment) and the stop waits forever
        self._reaping_stopped = False
        if self.fds is not None:
            self.fds.on_lease_end = self._lease_ended
        self.metrics = Metrics(
            store=self.store,
            health=health,
            transfers=lambda: self.engine.inflight.values(),
            mappings=self.mappings,
            fds=self.fds,
            remote=self.remote,
        )

    def _fd_broker(self, config: ServerConfig) -> fdbroker.FdBroker | None:
        """The fd socket; with 'auto' and no socket dir, a place where none can be
        made (read-only shm dir) only turns memfd regions off, loudly; a path or a
        socket dir the operator chose must work."""
        path = fdbroker.socket_path(
            config.fd_socket, config.shm_dir, self.start_id, config.socket_dir
        )
        if path is None:
            return None
        try:
            return fdbroker.FdBroker(path, gid=socket_gid(config))
        except OSError as exc:
            if config.socket_dir and config.fd_socket == "auto":
                raise ConfigError(f"--socket-dir {config.socket_dir}: {exc}") from exc
            if config.fd_socket != "auto":
                raise
            log.warning("no fd socket at %s (%s): sealed memfd regions are off", path, exc)
            return None

    async def _bounded(
        self,
        work: Coroutine[Any, Any, Any],
        name: str,
        call: Call,
        default: bool,
        grace: float = 0.0,
    ) -> Any:
        """Run a call within its deadline (``default``: the server's, the call carried
        none): a handler that hangs or a copy that runs long is answered at the
        deadline all the same (a copy that goes on is tracked, answered UNKNOWN, and
        Fence proves its end). Unary calls with a deadline have gRPC for this."""
        # At the deadline itself: handlers give up a little earlier with a better
        # error (they keep a reply budget); this only catches what does not.
        try:
            return await _Within(work, call.deadline + grace)
        except asyncio.TimeoutError:
            if monotonic() < call.deadline - 0.1:
                raise  # the handler's own TimeoutError, not the deadline's
            state = NO_TRANSFER
            if call.transfer:
                state = self.engine.state_of(call.key) if call.started else NOT_STARTED
            if not default:
                raise DeadlineExceeded(
                    f"{name} did not finish within its deadline", transfer_state=state
                ) from None
            raise DeadlineExceeded(
                f"{name} did not finish within the server's default deadline of "
                f"{self.config.default_deadline:g} s (the call carried no deadline)",
                reason="DEFAULT_DEADLINE_EXCEEDED",
                metadata={"defaultDeadlineS": f"{self.config.default_deadline:g}"},
                transfer_state=state,
            ) from None

    async def _error(
        self, name: str, call: Call, exc: BaseException, response_cls: type[Any]
    ) -> Any:
        if isinstance(exc, KVServiceError) and not exc.fatal:
            log.info("%s %s failed: %s", name, call.request_id, exc)
        else:  # the traceback stays here, found by the request id
            log.error("%s %s failed", name, call.request_id, exc_info=exc)
        # In a transfer RPC the engine has returned or raised by now, so no copy of
        # this call still runs: the state is FINISHED, or NOT_STARTED if none began.
        state = (FINISHED if call.started else NOT_STARTED) if call.transfer else NO_TRANSFER
        envelope = to_remote_error(exc, call.request_id, state)
        if getattr(exc, "fatal", False) or not isinstance(exc, Exception):
            self.fatal(
                exc
                if isinstance(exc, KVServiceError)
                else FatalServerError(envelope.message, reason=envelope.reason)
            )
        return response_cls(error=envelope)

    def fatal(self, exc: KVServiceError) -> None:
        """Stop serving (on the loop): health NOT_SERVING at once, queued copies fail
        fast, callers of running copies get TransferUnprovable now."""
        self.health.fatal_now(exc.reason, exc.message)
        self.engine.fail(exc)

    def fatal_threadsafe(self, exc: KVServiceError) -> None:
        """From any thread: queued copies stop starting at once, the loop does the rest."""
        self.engine.mark_failed(exc)
        self.loop.call_soon_threadsafe(self.fatal, exc)

    # --- helpers ---
    def _mapping(self, mapping_id: str, call: Call) -> Mapping:
        """The caller's mapping; another tenant's is as unknown as one never made."""
        mapping = self.mappings.get(mapping_id)
        if mapping is None or mapping.tenant != call.tenant.name:
            raise MappingLost(
                f"mapping {mapping_id!r} is not known to server start {self.start_id}: "
                "the server restarted or the mapping was unmapped; map again",
                metadata={"mappingId": mapping_id, "serverStartId": self.start_id},
            )
        if mapping.closing:
            raise InvalidRequest(
                f"mapping {mapping_id} is being unmapped",
                reason="MAPPING_CLOSING",
                metadata={"mappingId": mapping_id},
            )
        return mapping

    def _admit(self, call: Call) -> None:
        """A transfer within its tenant's quota (kvsvc.server.auth.Quota), else
        RESOURCE_EXHAUSTED before anything is reserved; keeps the store's view of
        the tenant's share current (a reloaded tenant file takes effect here)."""
        tenant = call.tenant
        quota = tenant.quota
        if quota.store_share < 1:
            self.store.shares[tenant.name] = int(self.store.capacity * quota.store_share)
        else:
            self.store.shares.pop(tenant.name, None)
        if quota.max_inflight:
            prefix = tenant.scoped("")
            running = sum(1 for tid in self.engine.inflight if tid.startswith(prefix))
            if running >= quota.max_inflight:
                raise _quota_exceeded(tenant, "max_inflight", running, quota.max_inflight)

    def _admit_map(self, call: Call, request: pb.MapRequest) -> None:
        """A Map within its tenant's mapping and fd quotas, before anything is opened."""
        tenant, quota = call.tenant, call.tenant.quota
        if not (quota.max_mappings or quota.max_fds):
            return
        mine = [m for m in self.mappings.values() if m.tenant == tenant.name]
        if quota.max_mappings and len(mine) >= quota.max_mappings:
            raise _quota_exceeded(tenant, "max_mappings", len(mine), quota.max_mappings)
        if quota.max_fds:
            held = sum(m.memfds for m in mine)
            asked = len(
                {
                    t.handle.sealed_memfd.token
                    for r in request.ranks
                    for t in r.tensors
                    if t.handle.WhichOneof("kind") == "sealed_memfd"
                }
            )
            if held + asked > quota.max_fds:
                raise _quota_exceeded(tenant, "max_fds", held, quota.max_fds)

    @staticmethod
    def _oneof(request: Any, group: str) -> str:
        which = request.WhichOneof(group)
        if which is None:
            raise UnsupportedRequest(
                f"{type(request).__name__}.{group} is not set (or is a kind this server "
                "does not know)",
                metadata={"field": group},
            )
        return str(which)

    # --- RPCs ---
    @rpc(pb.MapResponse)
    async def Map(self, request: pb.MapRequest, call: Call) -> pb.MapResult:
        namespace = _check_namespace(request.namespace, call)
        if not request.ranks:
            raise InvalidRequest("at least one rank is required", metadata={"field": "ranks"})
        self._admit_map(call, request)
        descriptor = _ranks_descriptor(request)
        for existing in list(self.mappings.values()):
            if existing.closing:
                continue
            current = await asyncio.to_thread(existing.is_current)
            # Idempotent re-map: the same ranks over the same memory, same mapping
            # (and the same tenant: another's Map never learns this mapping's id).
            mine = existing.tenant == call.tenant.name
            if current and mine and existing.descriptor == descriptor:
                return self._map_result(existing)
            # A mapping whose files were deleted or replaced (its client restarted)
            # is stale: release it once no copy uses it.
            if not current and not any(
                t.mapping_id == existing.mapping_id for t in self.engine.inflight.values()
            ):
                await self._release(existing, call.deadline, "released: its memory is gone")
        ranks: list[RankMapping] = []
        try:
            for index, rank in enumerate(request.ranks):
                failpoints.hit("map.rank", index)
                ranks.append(await self._open_rank(rank, index, call))
        except BaseException as exc:
            for opened in ranks:
                opened.close()
            if isinstance(exc, KVServiceError) and "rankIndex" not in exc.metadata:
                index = len(ranks)
                ctx = request.ranks[index].context
                exc.message = f"{rank_label(ctx, index)}: {exc.message}"
                exc.args = (exc.message,)
                exc.metadata.update({k: str(v) for k, v in rank_metadata(ctx, index).items()})
            elif isinstance(exc, Exception) and not isinstance(exc, KVServiceError):
                index = len(ranks)
                ctx = request.ranks[index].context
                raise RegionUnavailable(
                    f"{rank_label(ctx, index)}: map failed: {type(exc).__name__}: {exc}",
                    reason="MAP_FAILED",
                    metadata={**rank_metadata(ctx, index), "error": type(exc).__name__},
                ) from exc
            raise
        try:
            # 128 random bits: a mapping id cannot be guessed from another.
            mapping = Mapping.of(secrets.token_hex(16), namespace, descriptor, ranks)
            mapping.tenant = call.tenant.name
        except BaseException:
            for opened in ranks:
                opened.close()
            raise
        # Make the mapping visible on the device before the reply.
        await asyncio.to_thread(mapping.synchronize)
        self.mappings[mapping.mapping_id] = mapping
        log.info(
            "mapped %s: %d ranks, %d blocks of %d bytes, layout %s",
            mapping.mapping_id,
            len(ranks),
            mapping.num_blocks,
            mapping.block_bytes,
            mapping.fingerprint,
        )
        return self._map_result(mapping)

    def _map_result(self, mapping: Mapping) -> pb.MapResult:
        return pb.MapResult(
            mapping_id=mapping.mapping_id,
            server_start_id=self.start_id,
            num_blocks=mapping.num_blocks,
            block_bytes=mapping.block_bytes,
            layout_fingerprint=mapping.fingerprint,
        )

    async def _open_rank(self, rank: pb.RankRegion, index: int, call: Call) -> RankMapping:
        """Open one rank, retrying a region that is not ready until the deadline."""
        while True:
            attempt = time.monotonic()
            try:
                owners = call.tenant.shm_uids
                return await asyncio.to_thread(
                    open_rank,
                    rank,
                    index,
                    self.config.shm_dir,
                    self.fds,
                    self.shm_owners if owners is None else owners,
                )
            except (FileNotFoundError, RegionUnavailable) as exc:
                last = exc
                if isinstance(exc, RegionUnavailable) and exc.reason == "DEVICE_NOT_FOUND":
                    raise
            # Another attempt must fit too: on a loaded host one can take long
            # enough to push the error reply past the client's deadline.
            if reply_budget(call.deadline) <= MAP_RETRY_S + 2 * (time.monotonic() - attempt):
                cause = last.message if isinstance(last, KVServiceError) else str(last)
                raise DeadlineExceeded(
                    f"region not ready before the deadline; last error: {cause}",
                    reason="REGION_NOT_READY",
                    metadata={"lastError": cause},
                ) from last
            await asyncio.sleep(MAP_RETRY_S)

    @rpc(pb.UnmapResponse)
    async def Unmap(self, request: pb.UnmapRequest, call: Call) -> pb.UnmapResult:
        waited = await self._release(
            self._mapping(request.mapping_id, call), call.deadline, "unmapped"
        )
        return pb.UnmapResult(fenced_transfers=waited, server_start_id=self.start_id)

    def _lease_ended(self, lease: fdbroker.Lease) -> None:
        """From the fd socket's thread: wake the reaper (unless the server is gone)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._reap_wake.set)

    def stop_reaping(self) -> None:
        self._reaping_stopped = True
        self._reap_wake.set()

    async def reap(self) -> None:
        """Release, without waiting for a Map, every mapping whose engine is gone: at
        once when its lease connection ends, else within MAPPING_REAP_INTERVAL_S
        (a one-shot pass's pid exited). Runs until cancelled."""
        while not self._reaping_stopped:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reap_wake.wait(), MAPPING_REAP_INTERVAL_S)
            self._reap_wake.clear()
            if self._reaping_stopped:
                return
            for mapping in list(self.mappings.values()):
                if mapping.closing or not mapping.owner_gone():
                    continue
                deadline = monotonic() + self.config.stall_timeout
                try:
                    await self._release(mapping, deadline, "released: its engine is gone")
                except KVServiceError as exc:  # copies still run: the next round retries
                    log.warning("mapping %s not released yet: %s", mapping.mapping_id, exc)
                except Exception:
                    log.exception("releasing mapping %s failed", mapping.mapping_id)

    async def _release(self, mapping: Mapping, deadline: float, why: str) -> int:
        """Refuse new copies, fence running ones, synchronize, release. If copies are
        still running at the deadline the mapping stays: no copy loses its memory."""
        mapping.closing = True
        waited, _, still = await self.engine.fence(mapping.mapping_id, (), deadline)
        if still:
            mapping.closing = False
            raise DeadlineExceeded(
                f"mapping {mapping.mapping_id}: {len(still)} copies still running at the "
                "deadline; the mapping stays so that no copy loses its memory",
                reason="UNMAP_FENCE_TIMEOUT",
                metadata={"mappingId": mapping.mapping_id, "running": ",".join(still)},
                transfer_state=UNKNOWN,
            )
        del self.mappings[mapping.mapping_id]
        await asyncio.to_thread(mapping.close)  # synchronizes the device first
        log.info("mapping %s %s (%d copies fenced)", mapping.mapping_id, why, waited)
        return waited

    def _sides(
        self, request: Any, group: str, call: Call
    ) -> tuple[str, str, str, list[tuple[bytes, Side]]]:
        """(namespace, layout, mapping id, [(key, engine side)]) of a Store's source or
        a Retrieve's target: the one place that tells blocks from inline bytes."""
        if self._oneof(request, group) == "blocks":  # the same BlockChunks in both
            blocks = request.blocks
            mapping = self._mapping(blocks.mapping_id, call)
            sides: list[tuple[bytes, Side]] = [
                (c.key, Blocks(mapping, list(c.block_ids), i)) for i, c in enumerate(blocks.chunks)
            ]
            _check_keys([k for k, _ in sides])
            return mapping.namespace, mapping.fingerprint, mapping.mapping_id, sides
        inline = request.inline
        namespace = _check_namespace(inline.namespace, call)
        if group == "source":
            sides = [(c.key, Inline(c.data)) for c in inline.chunks]
        else:
            sides = [(key, Inline()) for key in inline.keys]
        _check_keys([k for k, _ in sides])
        return namespace, INLINE_LAYOUT, "", sides

    @rpc(pb.StoreResponse, transfer=True)
    async def Store(self, request: pb.StoreRequest, call: Call) -> pb.StoreResponse:
        namespace, layout, mapping_id, sides = self._sides(request, "source", call)
        if failpoints.ENABLED:
            failpoints.hit("store.put")
        present = 0
        wanted: dict[bytes, Side] = {}  # the first of equal keys wins
        for key, side in sides:
            if key in wanted or self.store.get(namespace, key, layout) is not None:
                present += 1
            else:
                wanted[key] = side
        # All or none: a request that cannot be placed evicts nothing.
        reserved, evicted = (
            self.store.reserve(
                namespace, [(k, s.nbytes) for k, s in wanted.items()], layout, call.tenant.name
            )
            if wanted
            else ([], 0)
        )
        todo = list(zip(reserved, wanted.values(), strict=True))
        stored = 0

        def finalize(results: list[list[Digest]] | None, error: BaseException | None) -> None:
            nonlocal stored
            if results is None:
                for chunk, _ in todo:
                    self.store.abort(chunk)
                return
            digests: list[list[int]] = [[0] * segment_count(c.size) for c, _ in todo]
            for ci, si, digest in (d for group in results for d in group):
                digests[ci][si] = digest
            committed = [
                chunk
                for (chunk, _), chunk_digests in zip(todo, digests, strict=True)
                if self.store.commit(chunk, chunk_digests)
            ]
            stored += len(committed)
            if self.remote is not None and committed:
                self.remote.write_behind(namespace, layout, committed)

        if todo:
            pieces = [
                piece
                for ci, (chunk, side) in enumerate(todo)
                for piece in side.pieces(self.store.buffer(chunk), ci, to_store=True)
            ]
            nbytes = sum(c.size for c, _ in todo)
            loop_safe = all(side.loop_safe for _, side in todo)
            await self._transfer(call, "store", mapping_id, nbytes, pieces, finalize, loop_safe)
        if evicted:  # every Store of a full cache evicts: the reply and metrics count it
            log.debug("store %s evicted %d chunks to make room", call.request_id, evicted)
        response = pb.StoreResponse()
        result = response.result  # filled in place: a result passed in would be copied
        result.stored_chunks = stored
        result.present_chunks = present + len(todo) - stored
        result.evicted_chunks = evicted
        result.stored_bytes = sum(c.size for c, _ in todo)
        result.transfer_id = call.request_id
        result.server_start_id = self.start_id
        return response

    async def _transfer(
        self,
        call: Call,
        direction: str,
        mapping_id: str,
        nbytes: int,
        pieces: list[Piece],
        finalize: Callable[[list[list[Digest]] | None, BaseException | None], None],
        loop_safe: bool,
    ) -> list[list[Digest]]:
        """Run the pieces of one copy on the transfer engine (``loop_safe``: see
        TransferEngine.run)."""
        call.started = True
        t0 = time.perf_counter()
        try:
            result = await self.engine.run(
                call.key,
                mapping_id,
                nbytes,
                call.deadline,
                tasks(pieces, nbytes, self.config.transfer_threads),
                finalize,
                loop_safe=loop_safe,
            )
        except KVServiceError as exc:
            if exc.transfer_state == NOT_STARTED:
                call.started = False
            raise
        self.metrics.observe_transfer(direction, nbytes, time.perf_counter() - t0)
        return result

    @rpc(pb.RetrieveResponse, transfer=True)
    async def Retrieve(self, request: pb.RetrieveRequest, call: Call) -> pb.RetrieveResponse:
        namespace, layout, mapping_id, sides = self._sides(request, "target", call)
        keys = [k for k, _ in sides]
        chunks = self.store.acquire_prefix(namespace, keys, layout)
        if self.remote is not None and len(chunks) < len(keys):
            return await self._retrieve_remote(call, namespace, layout, mapping_id, sides, chunks)
        try:
            for ci, chunk in enumerate(chunks):
                sides[ci][1].check(chunk.size, ci)
        except BaseException:
            self.store.release(chunks)
            raise
        response = pb.RetrieveResponse()
        result = response.result  # filled in place: a result passed in would be copied
        result.transfer_id = call.request_id
        result.server_start_id = self.start_id
        if not chunks:
            return response
        pieces = [
            piece
            for ci, chunk in enumerate(chunks)
            for piece in sides[ci][1].pieces(self.store.buffer(chunk), ci, to_store=False)
        ]
        nbytes = sum(c.size for c in chunks)
        await self._transfer(
            call,
            "retrieve",
            mapping_id,
            nbytes,
            pieces,
            lambda results, error: self.store.release(chunks),
            all(side.loop_safe for _, side in sides[: len(chunks)]),
        )
        result.loaded_chunks = len(chunks)
        result.loaded_bytes = nbytes
        for (key, side), _ in zip(sides, chunks, strict=False):
            if isinstance(side, Inline):
                result.chunks.add(key=key, data=bytes(side.out))
        return response

    async def _retrieve_remote(
        self,
        call: Call,
        namespace: str,
        layout: str,
        mapping_id: str,
        sides: list[tuple[bytes, Side]],
        chunks: list[Chunk],
    ) -> pb.RetrieveResponse:
        """A Retrieve with keys missing here: they come from Redis into the store by
        groups (a miss if not), and the copy of each committed group into the
        engine's side starts at once, in key order, while later groups are read (one
        streamed transfer under the call's id: Fence waits for all of it); the local
        prefix is copied meanwhile. The reply counts the parts that were copied: a
        prefix, since a part that cannot start (the deadline) ends it."""
        assert self.remote is not None
        keys = [k for k, _ in sides]
        stream: Stream | None = None
        loaded: list[Chunk] = []  # handed to the stream, in key order
        failure: BaseException | None = None  # raised once no part runs
        over = False  # no more parts: refused, failed, or the call ended
        t0 = time.perf_counter()

        def extend() -> None:
            """On the loop: copy the chunks committed since the last part."""
            nonlocal stream, failure, over
            if over:
                return
            part = self.store.acquire_prefix(namespace, keys[len(loaded) :], layout)
            if not part:
                return
            try:
                for i, chunk in enumerate(part, len(loaded)):
                    sides[i][1].check(chunk.size, i)
                pieces = [
                    piece
                    for i, chunk in enumerate(part, len(loaded))
                    for piece in sides[i][1].pieces(self.store.buffer(chunk), i, to_store=False)
                ]
            except Exception as exc:  # noqa: BLE001 - raised by the handler, after the copies
                self.store.release(part)
                failure, over = exc, True
                return
            nbytes = sum(c.size for c in part)
            todo = tasks(pieces, nbytes, self.config.transfer_threads)
            done = functools.partial(_release, self.store, part)
            if stream is None:
                call.started = True
                try:
                    stream = self.engine.stream(
                        call.key, mapping_id, call.deadline, nbytes, todo, done
                    )
                except Exception as exc:  # noqa: BLE001 - raised by the handler
                    call.started = getattr(exc, "transfer_state", None) != NOT_STARTED
                    failure, over = exc, True
                    return
            elif not stream.add(nbytes, todo, done):
                over = True
                return
            loaded.extend(part)

        try:
            self.store.release(chunks)  # extend pins them again, checked
            extend()
            if not over:
                await self.remote.fetch(
                    namespace,
                    layout,
                    keys[len(loaded) :],
                    reply_budget(call.deadline) / 2,
                    extend,
                )
                extend()  # keys committed meanwhile by others
        except BaseException:  # cancelled (the deadline, the client): no part starts now
            over = True
            if stream is not None:
                stream.abandon()
            raise
        over = True
        if stream is not None:
            if failure is not None:
                stream.fail(failure)
            await stream.end()
        elif failure is not None:
            raise failure
        response = pb.RetrieveResponse()
        result = response.result  # filled in place: a result passed in would be copied
        result.transfer_id = call.request_id
        result.server_start_id = self.start_id
        if loaded:
            nbytes = sum(c.size for c in loaded)
            self.metrics.observe_transfer("retrieve", nbytes, time.perf_counter() - t0)
            result.loaded_chunks = len(loaded)
            result.loaded_bytes = nbytes
        for key, side in sides[: len(loaded)]:
            if isinstance(side, Inline):
                result.chunks.add(key=key, data=bytes(side.out))
        return response

    @rpc(pb.LookupResponse)
    def Lookup(
        self, request: pb.LookupRequest, call: Call
    ) -> pb.LookupResponse | Coroutine[Any, Any, pb.LookupResponse]:
        scope = request.WhichOneof("scope") or self._oneof(request, "scope")
        keys = list(request.keys)
        if not all(0 < len(k) <= MAX_KEY_BYTES for k in keys):
            _check_keys(keys)  # raises for the first bad key
        if scope == "mapping_id":
            mapping = self._mapping(request.mapping_id, call)
            namespace, layout = mapping.namespace, mapping.fingerprint
            hits = self.store.lookup(namespace, keys, layout)
        else:
            # Redis is asked about inline chunks only: its keys name one layout.
            namespace, layout = _check_namespace(request.namespace, call), INLINE_LAYOUT
            hits = self.store.lookup(namespace, keys, None)
        if self.remote is not None and hits < len(keys):
            return self._lookup_remote(namespace, layout, keys, hits)
        return self._lookup_response(hits, len(keys))

    async def _lookup_remote(
        self, namespace: str, layout: str, keys: list[bytes], hits: int
    ) -> pb.LookupResponse:
        """The local prefix, continued by the keys here or in Redis (within the budget)."""
        assert self.remote is not None
        rest = keys[hits:]
        remote = await self.remote.present(namespace, layout, rest)
        local = None if layout == INLINE_LAYOUT else layout  # as the local Lookup counts
        for i, key in enumerate(rest):
            if not ((i < len(remote) and remote[i]) or self.store.lookup(namespace, [key], local)):
                break
            hits += 1
        return self._lookup_response(hits, len(keys))

    def _lookup_response(self, hits: int, asked: int) -> pb.LookupResponse:
        self.metrics.observe_lookup(hits, asked)
        response = pb.LookupResponse()
        result = response.result  # set in place: a LookupResult passed in would be copied
        result.hit_chunks = hits
        result.server_start_id = self.start_id
        return response

    @rpc(pb.FenceResponse)
    async def Fence(self, request: pb.FenceRequest, call: Call) -> pb.FenceResult:
        owned = self.mappings.get(request.mapping_id)
        if request.mapping_id and (owned is None or owned.tenant != call.tenant.name):
            self._mapping(request.mapping_id, call)  # raises MappingLost: not the caller's
        if not request.mapping_id and not request.transfer_ids:
            raise InvalidRequest("fence needs a mapping_id or transfer_ids")
        # A tenant waits on and bars only its own transfer ids.
        waited, barred, still = await self.engine.fence(
            request.mapping_id, [call.tenant.scoped(t) for t in request.transfer_ids], call.deadline
        )
        if still:
            raise DeadlineExceeded(
                f"{len(still)} copies still running at the fence deadline",
                reason="FENCE_TIMEOUT",
                metadata={"running": ",".join(still)},
                transfer_state=UNKNOWN,
            )
        return pb.FenceResult(
            waited_transfers=waited, barred_transfers=barred, server_start_id=self.start_id
        )

    async def Session(  # type: ignore[override]  # answers by context.write, not by yield
        self, requests: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Each request runs through its unary RPC's wrapper (checks, health, metrics,
        failpoints, errors as on unary); answers go out as they are ready. A request
        that completes without waiting (a Lookup, most errors) is answered by the
        reader itself, with no task. Answers ready while one is being written go out
        together in the next message when the client speaks batches (one message per
        answer is most of a Lookup's cost). When the stream ends, pending requests are
        cancelled as a unary call whose client went away would be (a started copy
        stays tracked for Fence)."""
        # Sent at once: a client writes no request before it knows the server has
        # this RPC (an older server's UNIMPLEMENTED then never races a write).
        await context.send_initial_metadata(((SESSION_BATCH, "1"),))
        if self._sessions_ending:
            return
        batches = speaks_batches(context.invocation_metadata())
        outbox: list[pb.SessionResponse] = []
        writing = [False]  # one writer at a time (gRPC takes one write at a time)
        pending: set[asyncio.Task[None]] = set()
        ended = self.loop.create_future()
        waiting = [False]  # the reader waits for the next request (``stop`` may cut it)

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
                for i, request in enumerate(_unbatched(message), 1):
                    done, value, ctx = eager(self._session_request(request, context))
                    if done:
                        outbox.append(value)
                    else:
                        value.then = post  # one task: the request's rest, then its answer
                        task = self.loop.create_task(value, context=ctx)
                        pending.add(task)
                        task.add_done_callback(finished)
                    if i % SESSION_BATCH_TURN == 0:  # a big batch lets other calls run
                        await flush()
                        await asyncio.sleep(0)
                await flush()
                if self._sessions_ending:
                    return

        def stop() -> None:
            """Shutdown: read no more; what was read is still answered."""
            if waiting[0]:
                reader.cancel()

        reader = self.loop.create_task(read())
        reader.add_done_callback(finished)
        self._sessions.add(stop)
        try:
            await ended
        finally:
            self._sessions.discard(stop)
            reader.cancel()
            for task in list(pending):
                task.cancel()

    @property
    def sessions_open(self) -> int:
        return len(self._sessions)

    def end_sessions(self) -> None:
        """At shutdown, once copies are drained: every Session stream stops reading,
        answers what it holds and ends (left open, the server's stop would cancel
        it, and grpc logs each cancelled handler as an ERROR)."""
        self._sessions_ending = True
        for stop in list(self._sessions):
            stop()

    async def _session_request(
        self, request: pb.SessionRequest | Unparsed, context: grpc.aio.ServicerContext
    ) -> pb.SessionResponse:
        if isinstance(request, Unparsed):  # no id to answer under: id 0, which no client uses
            return pb.SessionResponse(id=0, error=request.envelope(new_request_id(), False))
        kind = request.WhichOneof("request")
        try:
            if kind is None:
                self._oneof(request, "request")  # raises UnsupportedRequest
            assert kind is not None
            remaining = (
                request.timeout.ToNanoseconds() / 1e9 if request.HasField("timeout") else None
            )
            serve = getattr(type(self), SESSION_RPCS[kind]).serve
            response = await serve(self, getattr(request, kind), context, remaining, True)
            return pb.SessionResponse(id=request.id, **{kind: response})
        except Exception as exc:  # answered, never dropped
            if not isinstance(exc, KVServiceError):
                log.error("session request %d failed", request.id, exc_info=exc)
            envelope = to_remote_error(exc, new_request_id(), NO_TRANSFER)
            return pb.SessionResponse(id=request.id, error=envelope)

    @rpc(pb.GetServerInfoResponse)
    def GetServerInfo(self, request: pb.GetServerInfoRequest, call: Call) -> pb.GetServerInfoResult:
        result = pb.GetServerInfoResult(
            version=__version__,
            envelope_version=ENVELOPE_VERSION,
            server_start_id=self.start_id,
            capacity_bytes=self.store.capacity,
            used_bytes=self.store.used_bytes,
            stored_chunks=len(self.store),
            evicted_chunks=self.store.evicted_total,
            mappings=len(self.mappings),
            inflight_transfers=len(self.engine.inflight),
            serving=self.health.serving,
            failure_reason=self.health.failure_reason,
            start_time=_timestamp(self.start_time),
            device=self.device,
            fd_socket=self.fds.path if self.fds is not None else "",
        )
        if self.health.failure_time:
            result.failure_time.CopyFrom(_timestamp(self.health.failure_time))
        return result


def _ranks_descriptor(request: pb.MapRequest) -> bytes:
    key = pb.MapRequest(namespace=request.namespace, ranks=request.ranks)
    return key.SerializeToString(deterministic=True)


def _release(store: ChunkStore, chunks: list[Chunk], *_: object) -> None:
    """A part's finalize: its chunks are no longer read."""
    store.release(chunks)


def _quota_exceeded(tenant: Tenant, quota: str, used: int, limit: int) -> CapacityExhausted:
    return CapacityExhausted(
        f"tenant {tenant.name} is at its {quota} quota ({used} of {limit})",
        reason="TENANT_QUOTA_EXCEEDED",
        metadata={"quota": quota, "used": used, "limit": limit},
        retryable=quota == "max_inflight",
    )


def _check_keys(keys: list[bytes]) -> None:
    for i, key in enumerate(keys):
        if not key:
            raise InvalidRequest(f"key {i} is empty", metadata={"keyIndex": i})
        if len(key) > MAX_KEY_BYTES:
            raise InvalidRequest(
                f"key {i} is {len(key)} bytes, more than the {MAX_KEY_BYTES} allowed",
                reason="KEY_TOO_LONG",
                metadata={"keyIndex": i, "keyBytes": len(key), "maxKeyBytes": MAX_KEY_BYTES},
            )


def _check_namespace(namespace: str, call: Call) -> str:
    """The store's name for the caller's ``namespace``, if valid and granted to it."""
    if not namespace:
        raise InvalidRequest("namespace is required", metadata={"field": "namespace"})
    size = len(namespace.encode())
    if size > MAX_NAMESPACE_BYTES:
        raise InvalidRequest(
            f"namespace is {size} bytes, more than the {MAX_NAMESPACE_BYTES} allowed",
            reason="NAMESPACE_TOO_LONG",
            metadata={"namespaceBytes": size, "maxNamespaceBytes": MAX_NAMESPACE_BYTES},
        )
    call.tenant.check_namespace(namespace)
    return call.tenant.scoped(namespace)


def _timestamp(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


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


class _Within:
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
            raise asyncio.TimeoutError
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


def _unbatched(message: pb.SessionRequest | Unparsed) -> list[pb.SessionRequest | Unparsed]:
    """A message's requests, itself first, in the order sent (nested ``more`` too:
    every request a client sent is answered)."""
    if isinstance(message, Unparsed) or not message.more:
        return [message]
    out: list[pb.SessionRequest | Unparsed] = []
    stack: list[pb.SessionRequest] = [message]
    while stack:
        request = stack.pop()
        out.append(request)
        stack.extend(reversed(request.more))
    return out
