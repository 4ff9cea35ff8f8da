"""What every part of the S3 tier shares: the client behind its breaker (``call``,
the one gate every exchange passes), the tier's counters, and what this server
knows the bucket holds (its own writes and reads: Lookup asks nothing for those;
the events stream is told of each key as it joins or leaves that set, and a
snapshot lists it)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvsvc.server.config import ServerConfig
from kvsvc.server.data.store import ChunkKey
from kvsvc.server.events import EventLog
from kvsvc.server.tiers.breaker import Breaker
from kvsvc.server.tiers.s3.client import (
    BREAKER_FAILURES,
    BREAKER_OPEN,
    BREAKER_OPEN_S,
    MISSING,
    error_kind,
    make_client,
    warn,
)
from kvsvc.server.tiers.s3.objects import Rejected
from kvsvc.v1 import kv_cache_service_pb2 as pb

T = TypeVar("T")

#: keys this server remembers the bucket holding (its writes and reads), and
#: keys whose newest version it failed to write; beyond, the oldest are forgotten
KNOWN_MAX = 1 << 20
#: threads for Retrieve's GETs, Lookup's HEADs and the write-behind's PUTs
READERS = 4
HEADS = 8
WRITERS = 2


class Skipped(Exception):
    """An S3 exchange that did not happen or failed (counted; ``kind`` says why)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Missing(Exception):
    """The object is not there: a miss, not a failure."""


class Endpoint:
    """The bucket behind its breaker, and the tier's counters (read by metrics
    and GetServerInfo; written on threads and the loop, under ``lock``)."""

    def __init__(self, config: ServerConfig, events: EventLog | None = None) -> None:
        tiers = config.tiers
        self.config = config
        self.where = f"{tiers.s3_endpoint}/{tiers.s3_bucket}"
        self.bucket = tiers.s3_bucket
        self.prefix = tiers.s3_prefix.strip("/")
        self.timeout = tiers.s3_timeout
        self.breaker = Breaker(
            BREAKER_FAILURES,
            BREAKER_OPEN_S,
            tier="s3",
            what="S3",
            meanwhile="S3 reads are misses, writes are skipped",
        )
        self.client: Any = None
        self.closed = False
        self.lock = threading.Lock()
        self.hits = self.misses = self.bytes_read = 0
        self.writes = self.bytes_written = 0
        self.dropped_objects = 0
        self.errors: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        #: the bucket holds these as far as this server knows: key -> the chunk's bytes
        self.known: collections.OrderedDict[ChunkKey, int] = collections.OrderedDict()
        #: told (TIER_S3) of each key that joins or leaves ``known``
        self.events = events
        if events is not None:
            events.list_tier(pb.TIER_S3, lambda: self.known.items())
        #: keys whose newest version was not written: the bucket may hold an older
        #: one, never loaded (a replaced version is never served again)
        self.stale: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()

    def connect(self) -> None:
        self.client = make_client(self.config, READERS + HEADS + WRITERS + 2)

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` if the breaker allows it. Raises Missing (not a failure),
        Rejected (the object is not this chunk: counted by the caller) or Skipped
        (the breaker, or a failure: counted here, and the breaker told)."""
        if self.closed:
            raise Skipped("closing")
        if self.client is None or not self.breaker.allow():
            self.count(self.errors, BREAKER_OPEN)
            raise Skipped(BREAKER_OPEN)
        try:
            out = fn(self.client)
        except Rejected:
            self.breaker.success()
            raise
        except Exception as exc:  # every S3 failure is a miss, counted
            kind = error_kind(exc)
            if kind == MISSING:
                self.breaker.success()
                raise Missing from exc
            self.breaker.failure()
            self.count(self.errors, kind)
            warn.warning("s3 tier: %s (%s: %s): a miss", kind, type(exc).__name__, exc)
            raise Skipped(kind) from exc
        self.breaker.success()
        return out

    def count(self, table: dict[str, int], kind: str, n: int = 1) -> None:
        with self.lock:
            table[kind] = table.get(kind, 0) + n

    def add(self, **figures: int) -> None:
        with self.lock:
            for name, n in figures.items():
                setattr(self, name, getattr(self, name) + n)

    # --- what the bucket holds, as far as this server knows (on the loop) ---
    def remember(self, key: ChunkKey, nbytes: int) -> None:
        """The bucket holds ``key``'s newest version (written or read here, or a
        HEAD said so): announced stored the first time."""
        self.stale.pop(key, None)
        fresh = key not in self.known
        self.known[key] = nbytes
        self.known.move_to_end(key)
        if fresh and self.events is not None:
            self.events.stored(key[0], (key[1],), key[2], nbytes, pb.TIER_S3)
        if len(self.known) > KNOWN_MAX:
            # Forgotten: an index must not keep a hit this server no longer vouches for.
            old, _ = self.known.popitem(last=False)
            self._removed(old, pb.REMOVAL_REASON_TIER_DROPPED)

    def forget(self, key: ChunkKey, reason: int) -> None:
        """This server no longer vouches for ``key`` in the bucket (``reason``: a
        RemovalReason): announced removed if it was known."""
        if self.known.pop(key, None) is not None:
            self._removed(key, reason)

    def doubt(self, key: ChunkKey) -> None:
        """``key``'s newest version did not reach the bucket: never load it from there."""
        self.forget(key, pb.REMOVAL_REASON_TIER_DROPPED)
        self.stale[key] = None
        if len(self.stale) > KNOWN_MAX:
            self.stale.popitem(last=False)

    def _removed(self, key: ChunkKey, reason: int) -> None:
        if self.events is not None:
            self.events.removed(key[0], (key[1],), key[2], reason, pb.TIER_S3)
