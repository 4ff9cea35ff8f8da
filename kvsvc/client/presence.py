"""The presence index: which keys of one namespace the server holds, answered from
local memory, kept current by the server's WatchEvents stream.

``KVCacheClient.presence(ns)`` follows the stream on a background thread,
``AsyncKVCacheClient.presence(ns)`` on a task; both return an index whose
``hits(keys)`` / ``prefix_hits(keys)`` are a hash probe (~2 us for 64 keys with the
native table) instead of a Lookup RPC (~400 us). It is a hint: Retrieve stays the
authority, and a key removed between the hint and the Retrieve is a miss.

It never answers from state it knows may be stale: the answers are ``None``
(unknown; ask Lookup) before the first snapshot is applied, while a ``lost`` resync
is being rebuilt (aside, then swapped in whole), as soon as the stream breaks, and
once ``stale_after_s`` passed without proof that the stream is live and current.
Proof is a batch of the stream, or -- while nothing happens -- a GetServerInfo
probe answered on the same channel by the same incarnation (a server kill closes
the stream at once; a hung server stops answering probes). After a reconnect, the
index waits for the new stream's first batch before it answers again; a stream
resumed from the cursor that stays silent for ``stale_after_s / 2`` is reopened
without it (``lost`` + a snapshot), since a quiet server sends nothing to prove it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvsvc.client.calls import _header, _unwrap
from kvsvc.client.native import KeyTable, new_table
from kvsvc.client.plans import SERVICE
from kvsvc.errors import (
    KVServiceError,
    ProtocolViolation,
    ServiceUnavailable,
    from_grpc_error,
    from_remote_error,
)
from kvsvc.v1 import kv_cache_service_pb2 as pb

__all__ = ["STALE_AFTER_S", "AsyncPresenceIndex", "PresenceIndex", "ProtocolViolation"]

log = logging.getLogger(__name__)

#: Default of ``presence(..., stale_after_s=)``: how long the index keeps answering
#: without fresh proof that its stream is live (a batch or an answered probe).
STALE_AFTER_S = 1.0
#: Reconnect backoff after a broken stream: first wait, and most.
_BACKOFF_S = (0.05, 1.0)
_WATCH = f"/{SERVICE.full_name}/WatchEvents"
_INFO = f"/{SERVICE.full_name}/GetServerInfo"
#: What ``on_batch`` is called with, after the batch was applied.
BatchCallback = Callable[[pb.EventBatch], None]


class _State:
    """The table and what is known of its freshness; applying batches, no I/O.

    The follower (thread or task) is the only writer; readers see either the old
    table or the new one, whole (a resync builds the new one aside)."""

    def __init__(
        self,
        namespace: str,
        stale_after_s: float,
        on_batch: BatchCallback | None,
        native: bool | None,
    ) -> None:
        if not (0 < stale_after_s < math.inf):
            raise ValueError("stale_after_s must be a positive number of seconds")
        self.namespace = namespace
        self.stale_after_s = stale_after_s
        self._on_batch = on_batch
        self._native = native
        self._table: KeyTable = new_table(native)
        self._pending: KeyTable | None = None
        self._bits: dict[tuple[str, int], int] = {}
        #: (incarnation, sequence of the last event applied); None: resync
        self.cursor: tuple[str, int] | None = None
        self._synced = False  # a snapshot was applied and nothing was lost since
        self._open = False  # the current stream has delivered a batch and not ended
        self._proof = -math.inf  # monotonic time the index was last proven current
        self._opened_at: float | None = None  # when the current stream was opened
        self.closed = False
        #: the last failure of the stream or of a probe (None: none yet)
        self.error: KVServiceError | None = None
        #: resyncs (``lost`` batches) applied, and protocol violations seen
        self.resyncs = 0
        self.violations = 0

    # --- answers ---
    @property
    def fresh(self) -> bool:
        """Whether the index answers: synced, its stream live, proven recently."""
        return (
            self._synced
            and self._open
            and not self.closed
            and time.monotonic() - self._proof <= self.stale_after_s
        )

    @property
    def lag_s(self) -> float:
        """Seconds since the index was last proven current (inf: never)."""
        return max(0.0, time.monotonic() - self._proof)

    def hits(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key, whether the server holds it in any layout or tier; None: unknown."""
        table = self._table
        return table.hits(keys) if self.fresh else None

    def prefix_hits(self, keys: Sequence[bytes]) -> int | None:
        """How many leading keys the server holds (any layout or tier); None: unknown."""
        table = self._table
        return table.prefix(keys) if self.fresh else None

    def __len__(self) -> int:
        return len(self._table)

    @property
    def nbytes(self) -> int:
        """Bytes of the key table (what the index costs per key, times the keys)."""
        return self._table.nbytes

    # --- the stream's side ---
    def _request(self) -> pb.WatchEventsRequest:
        req = pb.WatchEventsRequest(header=_header(), namespaces=[self.namespace])
        if self.cursor is not None:
            req.cursor.incarnation, req.cursor.sequence = self.cursor
        return req

    def _broken(self, error: KVServiceError | None) -> None:
        self._open = False
        if error is not None:
            self.error = error

    def _apply(self, response: pb.WatchEventsResponse) -> None:
        if response.WhichOneof("outcome") == "error":
            raise from_remote_error(response.error)
        batch = response.batch
        if batch.lost:
            self._synced = False  # what we hold is stale from here on
            self._pending = new_table(self._native)
            self.resyncs += 1
        if batch.lost or batch.snapshot:
            pending = self._pending
            if pending is None:
                raise ProtocolViolation("a snapshot batch without lost")
            for event in batch.events:
                self._event(pending, event)
            if batch.snapshot_done:
                self._table, self._pending = pending, None
                self.cursor = (batch.incarnation, batch.sequence)
                self._synced = True
        else:
            self._live(batch)
        self._open = True
        self._proof = time.monotonic()
        if self._on_batch is not None:
            try:
                self._on_batch(batch)
            except Exception as exc:  # the caller's code: log it, keep the index
                log.exception("presence index: on_batch raised")
                self.error = KVServiceError(f"on_batch raised: {exc!r}", reason="EVENTS_CALLBACK")

    def _live(self, batch: pb.EventBatch) -> None:
        if self._pending is not None or self.cursor is None:
            raise ProtocolViolation("a live batch before the snapshot ended")
        incarnation, sequence = self.cursor
        if batch.incarnation != incarnation:
            raise ProtocolViolation(
                f"a batch of incarnation {batch.incarnation!r} without lost (following "
                f"{incarnation!r})",
            )
        # Each event has its own number, and the server leaves out the events of
        # namespaces this watcher does not see: k events ending at s number at
        # least s - k + 1, which must come after the cursor.
        if batch.sequence - len(batch.events) < sequence:
            raise ProtocolViolation(
                f"{len(batch.events)} events ending at {batch.sequence} after {sequence}: "
                "a duplicate",
            )
        for event in batch.events:
            self._event(self._table, event)
        self.cursor = (incarnation, batch.sequence)

    def _event(self, table: KeyTable, event: pb.KVEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            if event.stored.namespace == self.namespace:
                table.add(event.stored.keys, self._bit(event.stored.layout, event.stored.tier))
        elif kind == "removed":
            if event.removed.namespace == self.namespace:
                bit = self._bit(event.removed.layout, event.removed.tier)
                table.remove(event.removed.keys, bit)
        elif kind == "cleared":
            table.clear()
        else:  # a newer server's kind: what it means for presence is unknown
            raise ProtocolViolation(f"an event of unknown kind {kind!r}")

    def _bit(self, layout: str, tier: int) -> int:
        """The table's bit for a (layout, tier) pair: numbered as they appear."""
        bit = self._bits.get((layout, tier))
        if bit is None:
            if len(self._bits) == 64:
                # A namespace is one model's layout: 64 pairs is far past any
                # deployment, and merging pairs could answer a removed key.
                raise KVServiceError(
                    "more than 64 (layout, tier) pairs in one namespace", reason="EVENTS_LAYOUTS"
                )
            bit = self._bits[(layout, tier)] = len(self._bits)
        return bit

    def _violation(self, exc: ProtocolViolation) -> None:
        log.warning("presence index %r: %s; resyncing", self.namespace, exc)
        self.violations += 1
        self.cursor = None  # the next stream starts with lost + a snapshot
        self._synced = False

    def _quiet_resume(self) -> bool:
        """A stream resumed from a cursor that has sent nothing for stale_after_s / 2:
        the server sends nothing while nothing happens, so nothing proves the index
        current; drop the cursor (the caller reopens: lost + a snapshot prove it)."""
        if self._open or self.cursor is None or self._opened_at is None:
            return False
        if time.monotonic() - self._opened_at < self.stale_after_s / 2:
            return False
        self.cursor = None
        return True

    def _probed(self, info: pb.GetServerInfoResult, sent: float) -> bool:
        """Take an answered probe as proof; False: the stream must be reopened."""
        if self.cursor is None or info.server_start_id != self.cursor[0]:
            return False  # a new incarnation: its stream will say lost
        if not info.serving:
            self._broken(ServiceUnavailable(info.failure_reason or "not serving"))
            return False
        if self._open:
            self._proof = max(self._proof, sent)
        return True


def _probe_request() -> pb.GetServerInfoRequest:
    return pb.GetServerInfoRequest(header=_header())


class PresenceIndex(_State):
    """The index of a ``KVCacheClient``: a follower thread reads the stream and a
    prober thread proves freshness while nothing happens. Use it as a context
    manager or call ``close()``."""

    def __init__(
        self,
        channel: grpc.Channel,
        metadata: tuple[tuple[str, str], ...] | None,
        namespace: str,
        *,
        stale_after_s: float = STALE_AFTER_S,
        on_batch: BatchCallback | None = None,
        native: bool | None = None,
    ) -> None:
        super().__init__(namespace, stale_after_s, on_batch, native)
        self._metadata = metadata
        self._watch = channel.unary_stream(
            _WATCH,
            request_serializer=pb.WatchEventsRequest.SerializeToString,
            response_deserializer=pb.WatchEventsResponse.FromString,
        )
        self._info = channel.unary_unary(
            _INFO,
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.GetServerInfoResponse.FromString,
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        name = f"kvsvc-presence-{namespace}"
        self._threads = [
            threading.Thread(target=self._follow, name=name, daemon=True),
            threading.Thread(target=self._probe, name=f"{name}-probe", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def wait_fresh(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the index to answer; whether it does."""
        end = time.monotonic() + timeout
        while not self.fresh:
            if self.closed or time.monotonic() >= end:
                return False
            self._stop.wait(0.005)
        return True

    def close(self) -> None:
        """Stop following (the answers turn None) and join the threads (bounded)."""
        self.closed = True
        self._stop.set()
        self._cancel()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5.0)

    def __enter__(self) -> PresenceIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cancel(self) -> None:
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def _follow(self) -> None:
        backoff = _BACKOFF_S[0]
        while not self._stop.is_set():
            error: KVServiceError | None = None
            try:
                call = self._watch(self._request(), metadata=self._metadata)
                with self._lock:
                    self._call = call
                    self._opened_at = time.monotonic()
                if self._stop.is_set():
                    call.cancel()
                for response in call:
                    self._apply(response)
                    backoff = _BACKOFF_S[0]
                error = ServiceUnavailable("the events stream ended without an error")
            except grpc.RpcError as exc:
                error = from_grpc_error(exc)
            except ProtocolViolation as exc:
                self._violation(exc)
                error = exc
            except KVServiceError as exc:
                error = exc
            except ValueError as exc:  # grpc: "Cannot invoke RPC on closed channel!"
                self.closed = True
                self.error = ServiceUnavailable(f"the client's channel is closed: {exc}")
                self._stop.set()
            finally:
                with self._lock:
                    self._call = None
                    self._opened_at = None
            self._broken(None if self._stop.is_set() else error)
            if self._stop.wait(backoff):
                break
            backoff = min(backoff * 2, _BACKOFF_S[1])

    def _probe(self) -> None:
        interval = self.stale_after_s / 4
        while not self._stop.wait(interval):
            if self._quiet_resume():
                self._cancel()  # reopened without the cursor
                continue
            if not self._open or time.monotonic() - self._proof < interval:
                continue  # nothing to prove, or a batch proved it already
            sent = time.monotonic()
            try:
                info = _unwrap(
                    self._info(
                        _probe_request(), timeout=self.stale_after_s / 2, metadata=self._metadata
                    )
                )
            except grpc.RpcError as exc:
                self.error = from_grpc_error(exc)  # no proof: the answers age out
                continue
            except ValueError:  # the channel was closed: the follower ends too
                return
            except KVServiceError as exc:
                self.error = exc
                continue
            if not self._probed(info, sent):
                self._cancel()  # reopen: the new stream starts where it must


class AsyncPresenceIndex(_State):
    """The index of an ``AsyncKVCacheClient``: the same, with a follower task and a
    prober task on the running loop. ``close()`` cancels them; ``aclose()`` (or
    ``async with``) also waits for them to end."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        metadata: tuple[tuple[str, str], ...] | None,
        namespace: str,
        *,
        stale_after_s: float = STALE_AFTER_S,
        on_batch: BatchCallback | None = None,
        native: bool | None = None,
    ) -> None:
        super().__init__(namespace, stale_after_s, on_batch, native)
        self._metadata = metadata
        self._watch = channel.unary_stream(
            _WATCH,
            request_serializer=pb.WatchEventsRequest.SerializeToString,
            response_deserializer=pb.WatchEventsResponse.FromString,
        )
        self._info = channel.unary_unary(
            _INFO,
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.GetServerInfoResponse.FromString,
        )
        self._call: Any = None
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow()), loop.create_task(self._probe())]

    async def wait_fresh(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the index to answer; whether it does."""
        end = time.monotonic() + timeout
        while not self.fresh:
            if self.closed or time.monotonic() >= end:
                return False
            await asyncio.sleep(0.005)
        return True

    def close(self) -> None:
        """Stop following: the answers turn None; the tasks end at their next await."""
        self.closed = True
        if self._call is not None:
            self._call.cancel()
        for t in self._tasks:
            t.cancel()

    async def aclose(self) -> None:
        """``close()``, then wait (bounded) for the tasks to end."""
        self.close()
        done, pending = await asyncio.wait(self._tasks, timeout=5.0)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                log.error("presence index task failed", exc_info=t.exception())
        if pending:
            log.error("presence index: %d task(s) did not end within 5 s", len(pending))

    def __enter__(self) -> AsyncPresenceIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> AsyncPresenceIndex:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _follow(self) -> None:
        backoff = _BACKOFF_S[0]
        while not self.closed:
            error: KVServiceError | None = None
            try:
                self._call = call = self._watch(self._request(), metadata=self._metadata)
                self._opened_at = time.monotonic()
                async for response in call:
                    self._apply(response)
                    backoff = _BACKOFF_S[0]
                error = ServiceUnavailable("the events stream ended without an error")
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError, also on cancel
                error = from_grpc_error(exc)
            except ProtocolViolation as exc:
                self._violation(exc)
                error = exc
            except KVServiceError as exc:
                error = exc
            finally:
                self._call = None
                self._opened_at = None
            self._broken(None if self.closed else error)
            if self.closed:
                break
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_S[1])

    async def _probe(self) -> None:
        interval = self.stale_after_s / 4
        while not self.closed:
            await asyncio.sleep(interval)
            if self._quiet_resume() and self._call is not None:
                self._call.cancel()  # reopened without the cursor
                continue
            if not self._open or time.monotonic() - self._proof < interval:
                continue
            sent = time.monotonic()
            try:
                response = await self._info(
                    _probe_request(), timeout=self.stale_after_s / 2, metadata=self._metadata
                )
                info = _unwrap(response)
            except grpc.RpcError as exc:
                self.error = from_grpc_error(exc)
                continue
            except KVServiceError as exc:
                self.error = exc
                continue
            if not self._probed(info, sent) and self._call is not None:
                self._call.cancel()  # reopen: the new stream starts where it must
