"""GetServerInfo's FULL view (``kvsvc stats``): what the server holds and did, tier
by tier, and how it is set up.

``Counts`` holds the counters no other part keeps (Lookup and Retrieve hits of
memory, chunks committed and removed by reason, quota refusals), each bumped on
the loop where the event happens, O(1). ``Stats.fill`` reads them with the live
state when asked: nothing here walks the chunks, so a call costs the loop ~50 µs
whatever the server holds (docs/stats.md; benchmarks/stats_cost.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from kvsvc.server.config import GROUPS, ServerConfig, redact_url
from kvsvc.server.data import copies
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.events import EventLog, Watchers
from kvsvc.server.security.auth import Tenant
from kvsvc.server.tiers.chain import TierChain
from kvsvc.v1 import kv_cache_service_pb2 as pb

MEMORY = "memory"
#: Settings whose value may carry a secret, and what is shown instead (the others
#: hold flags, sizes, addresses and file names: the files' contents are never read).
SECRETS: Mapping[str, Callable[[str], str]] = {"remote": redact_url}
_COPY_LOOPS = {"native": pb.COPY_LOOP_KIND_NATIVE, "python": pb.COPY_LOOP_KIND_PYTHON}


class Counts:
    """Counters for the stats that nothing else keeps; a store listener too (the
    chunks committed by Stores, and removed, by reason)."""

    def __init__(self) -> None:
        self.lookup_requests = 0
        self.lookup_asked = 0
        self.lookup_hits = 0
        #: keys of memory's leading run (past it, the tiers' chain counts holders)
        self.lookup_memory = 0
        self.retrieve_asked = 0
        self.retrieve_hits = 0
        self.retrieve_bytes = 0
        self.stored_chunks = 0
        self.stored_bytes = 0
        self.removals: dict[str, int] = {}  # by the store's reason
        #: (tenant, quota) -> calls refused TENANT_QUOTA_EXCEEDED
        self.quota_refusals: dict[tuple[str, str], int] = {}

    def lookup(self, asked: int, hits: int, memory: int) -> None:
        self.lookup_requests += 1
        self.lookup_asked += asked
        self.lookup_hits += hits
        self.lookup_memory += memory

    def retrieve(self, asked: int, chunks: list[Chunk]) -> None:
        """A Retrieve asked memory for ``asked`` keys and found the leading ``chunks``."""
        self.retrieve_asked += asked
        self.retrieve_hits += len(chunks)
        self.retrieve_bytes += sum(c.size for c in chunks)

    def refused(self, tenant: str, quota: str) -> None:
        key = (tenant, quota)
        self.quota_refusals[key] = self.quota_refusals.get(key, 0) + 1

    # --- the store's listener ---
    def stored(self, chunk: Chunk) -> None:
        if not chunk.origin:  # a Store's, not a load from a tier below
            self.stored_chunks += 1
            self.stored_bytes += chunk.size

    def removed(self, chunk: Chunk, reason: str) -> None:
        self.removals[reason] = self.removals.get(reason, 0) + 1


class MappingView(Protocol):
    """What the tenant rows read of a mapping (kvsvc.server.data.regions.Mapping)."""

    @property
    def tenant(self) -> str: ...


class Stats:
    """Builds ``ServerStats`` from the server's parts (given by the servicer)."""

    def __init__(
        self,
        *,
        config: ServerConfig,
        store: ChunkStore,
        counts: Counts,
        tiers: TierChain,
        events: EventLog,
        watchers: Watchers,
        inflight: Callable[[], Iterable[str]],
        mappings: Mapping[str, MappingView],
    ) -> None:
        self.store, self.counts, self.tiers = store, counts, tiers
        self.events, self.watchers = events, watchers
        self.inflight, self.mappings = inflight, mappings
        #: the settings do not change while the server runs: serialized once, merged
        #: into each reply (parsing them back is ~10x cheaper than copying messages)
        self.settings = pb.ServerStats(settings=settings_in_force(config)).SerializeToString()

    def fill(self, out: pb.ServerStats, tenant: Tenant) -> None:
        """``out`` as ``tenant`` may see it: every figure of the server, and its own
        usage against its quota (no other tenant's)."""
        out.taken.FromNanoseconds(time.time_ns())
        out.tiers.append(self._memory())
        out.tiers.extend(self.tiers.describe())
        c = self.counts
        out.lookups.requests = c.lookup_requests
        out.lookups.asked_chunks = c.lookup_asked
        out.lookups.hit_chunks = c.lookup_hits
        out.tenants.append(self._tenant(tenant))
        self._events(out.events)
        kind, why = copies.copy_loop()
        out.copy_loop.kind = _COPY_LOOPS.get(kind, pb.COPY_LOOP_KIND_UNSPECIFIED)
        out.copy_loop.reason = why
        out.MergeFromString(self.settings)

    def _memory(self) -> pb.TierStats:
        s, c = self.store, self.counts
        out = pb.TierStats(
            name=MEMORY,
            capacity_bytes=s.capacity,
            used_bytes=s.used_bytes,
            chunks=len(s),
            writing=True,
            ready=True,
            lookup_hit_chunks=c.lookup_memory + self.tiers.lookup_hits.get(MEMORY, 0),
            retrieve_asked_chunks=c.retrieve_asked,
            retrieve_hit_chunks=c.retrieve_hits,
            read_bytes=c.retrieve_bytes,
            written_chunks=c.stored_chunks,
            written_bytes=c.stored_bytes,
        )
        out.removed_chunks.update(c.removals)
        return out

    def _tenant(self, tenant: Tenant) -> pb.TenantUsage:
        s, quota = self.store, tenant.quota
        name = tenant.name
        prefix = tenant.scoped("")  # a tenant's transfer ids: <tenant>/<id>
        out = pb.TenantUsage(
            tenant=name,
            used_bytes=s.used_by.get(name, 0),
            share_bytes=int(s.capacity * quota.store_share),
            namespaces=sum(1 for owner, _ in s.used_in if owner == name),
            mappings=sum(1 for m in self.mappings.values() if m.tenant == name),
            max_mappings=quota.max_mappings,
            inflight_transfers=sum(1 for t in self.inflight() if t.startswith(prefix)),
            max_inflight=quota.max_inflight,
        )
        for (who, which), n in self.counts.quota_refusals.items():
            if who == name:
                out.quota_refusals[which] = n
        return out

    def _events(self, out: pb.EventStreamStats) -> None:
        e, ring = self.events, self.events.ring
        positions = self.watchers.positions()
        out.watchers = e.watching
        out.published_events = e.published
        out.resyncs = e.resyncs
        out.ring_events = len(ring)
        out.ring_bytes = ring.bytes
        out.last_sequence = ring.last
        following = [p for p in positions if p >= 0]
        out.max_lag_events = max((ring.last - p for p in following), default=0)
        out.resyncing_watchers = len(positions) - len(following)


def settings_in_force(config: ServerConfig) -> Iterable[pb.ConfigSetting]:
    """Every setting as the server runs with it, secrets redacted, in --help's order."""
    for group in GROUPS:
        values = getattr(config, group.attr)
        for setting in group.settings:
            value = getattr(values, setting.name)
            shown = setting.show(value)
            hide = SECRETS.get(setting.name)
            if hide is not None and isinstance(value, str):
                shown = hide(value)
            yield pb.ConfigSetting(
                name=setting.name,
                group=group.attr,
                value=shown,
                is_default=value == setting.default,
            )
