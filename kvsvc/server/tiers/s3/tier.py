"""S3Tier, the S3-compatible object tier behind the tier interface
(kvsvc.server.tiers.base): Lookup's answer (what this server wrote or read,
else a bounded HEAD), Retrieve's reads (reads), the write-behind (writer),
DropNamespace by prefix, and its life (start-up's checks, close)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from kvsvc.server.config import ConfigError, ServerConfig
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.events import EventLog
from kvsvc.server.tiers.base import Tier
from kvsvc.server.tiers.breaker import OPEN
from kvsvc.server.tiers.s3.client import AUTH, BUCKET, BUSY, error_kind, log, warn
from kvsvc.server.tiers.s3.endpoint import HEADS, Endpoint, Missing, Skipped
from kvsvc.server.tiers.s3.objects import chunk_bytes, namespace_prefix, object_name
from kvsvc.server.tiers.s3.reads import Reads
from kvsvc.server.tiers.s3.writer import Writer
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: keys one Lookup HEADs at most (HEADS at once), and HEADs queued or running at
#: once (beyond, Lookup asks none: a stuck endpoint never queues up Lookups)
HEADS_MAX = 64
#: objects per DropNamespace listing page and per DeleteObjects call (S3's most)
DROP_BATCH = 1000


class S3Tier(Tier):
    """One per server (--s3-endpoint). Counters live on ``endpoint`` (metrics)."""

    name = "s3"
    asked = True  # Lookup asks S3 (a HEAD) for keys this server has not seen

    def __init__(
        self,
        config: ServerConfig,
        store: ChunkStore,
        loop: asyncio.AbstractEventLoop,
        events: EventLog | None = None,
    ) -> None:
        self.store = store
        self.loop = loop
        self.lookup_budget = config.tiers.s3_lookup_budget
        self.endpoint = Endpoint(config, events)
        self.reads = Reads(self.endpoint, store, loop)
        self.writer = Writer(self.endpoint, store, loop, config.tiers.s3_queue_bytes)
        self._heads = concurrent.futures.ThreadPoolExecutor(
            HEADS, thread_name_prefix="kvsvc-s3-head"
        )
        self._heading = 0

    # --- life ---
    def start(self, ready: Callable[[], None]) -> None:
        """Refused credentials are a ConfigError (they will not heal by themselves);
        an endpoint that does not answer, or a bucket not made yet, a warning (the
        breaker and misses handle it until it does)."""
        e = self.endpoint
        e.connect()
        # On a thread, waited for --s3-timeout and a second at most: a resolver or
        # endpoint that never answers does not hold the start-up longer.
        probe = self._heads.submit(e.client.head_bucket, Bucket=e.bucket)
        try:
            probe.result(e.timeout + 1.0)
            log.info("s3 tier: bucket %s answers", e.where)
        except Exception as exc:  # noqa: BLE001 - judged below
            kind = error_kind(exc)
            if kind == AUTH:
                raise ConfigError(
                    f"--s3-endpoint {e.where}: S3 refused the credentials "
                    f"(--s3-credentials-file or the AWS environment): {exc}"
                ) from None
            if kind == "missing":  # HEAD has no body: a missing bucket is a bare 404
                kind = BUCKET
            log.warning(
                "s3 tier: %s does not answer at start-up (%s: %s); S3 reads are misses "
                "until it does",
                e.where,
                kind,
                exc,
            )
            e.count(e.errors, kind)
            e.breaker.failure()
        self.writer.start()
        ready()

    def close(self, timeout: float = 0.0) -> None:
        """Stop the writers (queued writes are skipped and counted) and the readers."""
        self.endpoint.closed = True
        self.writer.stop(self.endpoint.timeout + 1)
        self.reads.stop()
        self._heads.shutdown(wait=False, cancel_futures=True)

    async def aclose(self, timeout: float) -> None:
        await self.loop.run_in_executor(None, self.close, timeout)

    # --- what it says of itself ---
    @property
    def writing(self) -> bool:
        """Writes are skipped (counted) while the breaker is open."""
        return self.endpoint.breaker.state != OPEN

    def describe(self, out: pb.TierStats) -> None:
        """What this server knows without asking S3 (the bucket's size is S3's to say)."""
        e = self.endpoint
        out.writing, out.ready = self.writing, True
        out.chunks = len(e.known)
        with e.lock:
            out.read_bytes = e.bytes_read
            out.written_chunks, out.written_bytes = e.writes, e.bytes_written
            out.skipped_writes.update(e.skipped)
            if e.dropped_objects:
                out.removed_chunks["dropped"] = e.dropped_objects
        out.queued_bytes = self.writer.queued_bytes

    def collector(self) -> Any:
        from kvsvc.server.tiers.s3.metrics import S3Collector

        return S3Collector(self.endpoint, self.writer)

    # --- Lookup ---
    async def present(self, namespace: str, layout: str, keys: list[bytes]) -> list[bool]:
        """Whether the bucket holds each of the leading ``keys``: those this server
        wrote or read at once, then one HEAD each (HEADS at once, HEADS_MAX at
        most) within the Lookup budget; the answer ends at the first key it
        cannot vouch for."""
        e = self.endpoint
        out: list[bool] = []
        for key in keys:
            if (namespace, key, layout) not in e.known:
                break
            out.append(True)
        rest = keys[len(out) : len(out) + HEADS_MAX]
        if not rest:
            return out
        if self._heading >= HEADS_MAX:  # a stuck endpoint: never queue up Lookups
            e.count(e.errors, BUSY)
            return out
        heads = [self._head(namespace, layout, key) for key in rest]
        done, _ = await asyncio.wait(heads, timeout=self.lookup_budget)
        for key, head in zip(rest, heads, strict=True):
            if head not in done or head.result() is None:
                if head not in done:
                    e.count(e.errors, "budget")
                break
            e.remember((namespace, key, layout), chunk_bytes(head.result() or 0, layout))
            out.append(True)
        return out

    def _head(self, namespace: str, layout: str, key: bytes) -> asyncio.Future[int | None]:
        """The object's length, None where it is missing or S3 did not answer."""
        e = self.endpoint
        name = object_name(e.prefix, namespace, layout, key)

        def head() -> int | None:
            try:
                reply = e.call(lambda client: client.head_object(Bucket=e.bucket, Key=name))
            except (Missing, Skipped):
                return None
            return int(reply.get("ContentLength", 0))

        self._heading += 1
        fut = self.loop.run_in_executor(self._heads, head)
        fut.add_done_callback(self._headed)
        return fut

    def _headed(self, _: Any) -> None:
        self._heading -= 1

    # --- Retrieve ---
    async def load(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        committed: Callable[[], None],
    ) -> None:
        await self.reads.load(namespace, layout, keys, budget, committed)

    # --- writes ---
    def write_behind(self, chunk: Chunk) -> None:
        self.writer.put(chunk)

    # --- DropNamespace ---
    async def drop(self, namespace: str, budget: float, result: pb.DropNamespaceResult) -> None:
        """Delete every object under the namespace's prefix (listed, then deleted
        by batches) on a thread, within ``budget`` s; what a failing or slow
        endpoint leaves is counted. A write in flight meanwhile deletes its own
        object once sent (its chunk is discarded)."""
        e = self.endpoint
        for key in [k for k in e.known if k[0] == namespace]:
            e.forget(key, pb.REMOVAL_REASON_DROPPED)
        stop = time.monotonic() + max(budget, 0.0)
        dropped = [0, 0]  # objects, bytes (this call's: the counters are the server's)
        prefix = namespace_prefix(e.prefix, namespace)

        def drop_all(client: Any) -> bool:
            token: dict[str, str] = {}
            while time.monotonic() < stop:
                page = client.list_objects_v2(
                    Bucket=e.bucket, Prefix=prefix, MaxKeys=DROP_BATCH, **token
                )
                listed = page.get("Contents", [])
                names = [{"Key": o["Key"]} for o in listed]
                if names:
                    reply = client.delete_objects(
                        Bucket=e.bucket, Delete={"Objects": names, "Quiet": True}
                    )
                    # Quiet: only the objects it failed to delete are listed back.
                    failed = {err.get("Key") for err in reply.get("Errors", [])}
                    gone = [o for o in listed if o["Key"] not in failed]
                    dropped[0] += len(gone)
                    dropped[1] += sum(int(o.get("Size", 0)) for o in gone)
                    e.add(dropped_objects=len(gone))
                    if failed:
                        return False
                if not page.get("IsTruncated"):
                    return True
                token = {"ContinuationToken": page["NextContinuationToken"]}
            return False

        def run() -> bool:
            try:
                return e.call(drop_all)
            except (Missing, Skipped):
                return False

        work = self.loop.run_in_executor(self._heads, run)
        try:
            complete = await asyncio.wait_for(asyncio.shield(work), max(budget, 0.0) + e.timeout)
        except TimeoutError:
            complete = False
        result.s3_objects, result.s3_bytes = dropped
        result.s3_complete = complete
        if not complete:
            e.count(e.errors, "drop_incomplete")
            warn.warning("s3 tier: objects of a dropped namespace are left under %s", prefix)
