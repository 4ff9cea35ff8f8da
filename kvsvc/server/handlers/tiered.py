"""A Retrieve with keys memory lacks: the tiers below memory load them into the
store (kvsvc.server.tiers.chain), and each group they commit is copied into the
engine's side at once, in key order, while later ones are read: one streamed
transfer under the call's id (kvsvc.server.data.stream), so Fence waits for all
of it. The local prefix is copied meanwhile. The reply counts the parts that
were copied: a prefix, since a part that cannot start (the deadline) or a chunk
that fails its check ends it. Also: dropping the chunks a copy found corrupt,
shared with the plain Retrieve."""

from __future__ import annotations

import functools
import logging
import time

from kvsvc.errors import NOT_STARTED
from kvsvc.server.data.copies import Digest, Inline, Piece, Side, failed_chunks, tasks
from kvsvc.server.data.engine import Stream, TransferEngine
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.ops.metrics import Metrics
from kvsvc.server.rpc.wrapper import LOGGER, Call
from kvsvc.server.tiers.chain import TierChain
from kvsvc.v1 import kv_cache_service_pb2 as pb

log = logging.getLogger(LOGGER)


def drop_failed(
    store: ChunkStore, call: Call, chunks: list[Chunk], results: list[list[Digest]], base: int = 0
) -> dict[int, Digest]:
    """On the loop, once a Retrieve's copy (or part, whose first chunk is chunk
    ``base``) has ended: the chunks that failed their check, dropped from the
    store (counted, announced as removed); the reply's prefix ends before the
    first. Their blocks hold undefined bytes that are never reported loaded."""
    failed = failed_chunks(results)
    for ci, (_, si, got) in sorted(failed.items()):
        chunk = chunks[ci - base]
        store.discard(chunk, "check_failed")
        log.warning(
            "retrieve %s: chunk %d (key %s) failed its checksum at segment %d "
            "(stored %08x, read %08x): dropped, not loaded",
            call.request_id,
            ci,
            chunk.key[1].hex()[:32],
            si,
            chunk.digests[si],
            got,
        )
    return failed


class TieredRetrieve:
    """One such Retrieve: ``run`` it once. Its state is what the parts share: the
    chunks handed to the stream (in key order), the first chunks that failed or
    whose part was refused, and whether more parts may start."""

    def __init__(
        self,
        store: ChunkStore,
        engine: TransferEngine,
        tiers: TierChain,
        threads: int,
        call: Call,
        request: tuple[str, str, str, list[tuple[bytes, Side]]],
    ) -> None:
        self.store, self.engine, self.tiers, self.threads = store, engine, tiers, threads
        self.call = call
        self.namespace, self.layout, self.mapping_id, self.sides = request
        self.keys = [k for k, _ in self.sides]
        self.stream: Stream | None = None
        self.loaded: list[Chunk] = []  # handed to the stream, in key order
        self.failed: dict[int, Digest] = {}  # failed their check: no part after the first
        self.cut: list[int] = []  # first chunks of parts refused as they came up
        self.failure: BaseException | None = None  # raised once no part runs
        self.over = False  # no more parts: refused, failed, or the call ended

    async def run(self, local: list[Chunk], metrics: Metrics, start_id: str) -> pb.RetrieveResponse:
        """``local``: the pinned local prefix (released here, pinned again checked)."""
        t0 = time.perf_counter()
        try:
            self.store.release(local)
            self.extend()
            if not self.over:
                rest = self.keys[len(self.loaded) :]
                await self.tiers.load(
                    self.namespace, self.layout, rest, self.call.deadline, self.extend
                )
                self.extend()  # keys committed meanwhile by others
        except BaseException:  # cancelled (the deadline, the client): no part starts now
            self.over = True
            if self.stream is not None:
                self.stream.abandon()
            raise
        await self._end()
        response = pb.RetrieveResponse()
        result = response.result  # filled in place: a result passed in would be copied
        result.transfer_id = self.call.request_id
        result.server_start_id = start_id
        loaded = self.loaded
        if loaded:
            nbytes = sum(c.size for c in loaded)
            metrics.observe_transfer("retrieve", nbytes, time.perf_counter() - t0)
            loaded = loaded[: min([*self.failed, *self.cut], default=len(loaded))]
            result.loaded_chunks = len(loaded)
            result.loaded_bytes = sum(c.size for c in loaded)
        for key, side in self.sides[: len(loaded)]:
            if isinstance(side, Inline):
                result.chunks.add(key=key, data=bytes(side.out))
        return response

    async def _end(self) -> None:
        """No part starts from now on; wait for those that did (or raise the failure
        that stopped the first from starting)."""
        self.over = True
        if self.stream is not None:
            if self.failure is not None:
                self.stream.fail(self.failure)
            await self.stream.end()
        elif self.failure is not None:
            raise self.failure

    def extend(self) -> None:
        """On the loop: copy the chunks committed since the last part."""
        if self.over or self.failed:
            return
        base = len(self.loaded)
        part = self.store.acquire_prefix(self.namespace, self.keys[base:], self.layout)
        if not part:
            return
        try:
            pieces = self._pieces(part, base)
        except Exception as exc:  # noqa: BLE001 - raised by the handler, after the copies
            self.store.release(part)
            self.failure, self.over = exc, True
            return
        nbytes = sum(c.size for c in part)
        todo = tasks(pieces, nbytes, self.threads)
        done = functools.partial(self._part_done, part, base)
        if self.stream is None:
            self.call.started = True
            try:
                self.stream = self.engine.stream(
                    self.call.key, self.mapping_id, self.call.deadline, nbytes, todo, done
                )
            except Exception as exc:  # noqa: BLE001 - raised by the handler
                self.call.started = getattr(exc, "transfer_state", None) != NOT_STARTED
                self.failure, self.over = exc, True
                return
        elif not self.stream.add(nbytes, todo, done):
            self.over = True
            return
        self.loaded.extend(part)

    def _pieces(self, part: list[Chunk], base: int) -> list[Piece]:
        """The part's chunks checked against their engine sides, cut into pieces."""
        for i, chunk in enumerate(part, base):
            self.sides[i][1].check(chunk.size, i)
        return [
            piece
            for i, chunk in enumerate(part, base)
            for piece in self.sides[i][1].pieces(self.store.buffer(chunk), i, to_store=False)
        ]

    def _part_done(
        self,
        part: list[Chunk],
        base: int,
        results: list[list[Digest]] | None,
        error: BaseException | None,
    ) -> None:
        """A part's finalize: its failed chunks dropped; no longer read. A part
        refused as it came up (the deadline) ends the prefix before it."""
        if results is not None:
            self.failed.update(drop_failed(self.store, self.call, part, results, base))
        else:
            self.cut.append(base)
        self.store.release(part)
