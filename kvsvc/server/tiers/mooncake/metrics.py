"""The Mooncake tier's Prometheus series (``kvsvc_mooncake_*``), read from the
tier when scraped, and its row of the figures every tier reports
(``kvsvc_tier_*{tier="mooncake"}``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvsvc.server.ops.metrics import TierFigures
from kvsvc.server.tiers.mooncake.gate import Gate
from kvsvc.server.tiers.mooncake.writer import Known, Writer


class MooncakeCollector:
    def __init__(self, gate: Gate, writer: Writer, known: Known) -> None:
        self.gate = gate
        self.writer = writer
        self.known = known

    def collect(self) -> Iterator[Any]:
        g = self.gate
        with g.lock:
            tables = (dict(g.errors), dict(g.rejected), dict(g.skipped))
            misses, dropped = g.misses, g.dropped_values
        yield CounterMetricFamily(
            "kvsvc_mooncake_misses", "chunks Retrieve asked Mooncake for and did not get", misses
        )
        yield CounterMetricFamily(
            "kvsvc_mooncake_dropped_values", "values removed by DropNamespace", value=dropped
        )
        for (name, doc, label), table in zip(
            (
                (
                    "kvsvc_mooncake_errors",
                    "Mooncake calls that failed or were not made, by kind: rpc (master), "
                    "transfer (peer), timeout, busy (every Mooncake thread taken), budget, "
                    "breaker_open, setup, connecting, no_space, capacity, other Mooncake codes",
                    "kind",
                ),
                (
                    "kvsvc_mooncake_rejected_values",
                    "Mooncake values refused (never loaded), by why: header, layout, name, "
                    "truncated, checksum, stale (its newest version was never written)",
                    "kind",
                ),
                (
                    "kvsvc_mooncake_skipped_writes",
                    "chunks not written to Mooncake, by why: queue (write-behind full), "
                    "unavailable (Mooncake failing, breaker open), busy, closing, or "
                    "Mooncake's code (no_space...)",
                    "reason",
                ),
            ),
            tables,
            strict=True,
        ):
            family = CounterMetricFamily(name, doc, labels=[label])
            for kind, n in sorted(table.items()):
                family.add_metric([kind], n)
            yield family
        yield GaugeMetricFamily(
            "kvsvc_mooncake_breaker_state",
            "the Mooncake circuit breaker: 0 closed, 1 open, 2 half-open (one probe)",
            value=g.breaker.state,
        )
        yield GaugeMetricFamily(
            "kvsvc_mooncake_calls_in_flight",
            "Mooncake calls on the tier's threads now (Retrieve, Lookup, DropNamespace)",
            value=g.inflight,
        )
        yield GaugeMetricFamily(
            "kvsvc_mooncake_known_values",
            "keys this server wrote to or read from Mooncake (Lookup asks nothing for them)",
            value=len(self.known.versions),
        )

    def figures(self) -> TierFigures:
        g = self.gate
        return TierFigures(
            hits=g.hits,
            read_bytes=g.bytes_read,
            written_chunks=g.writes,
            written_bytes=g.bytes_written,
            queue_bytes=self.writer.queued_bytes,
        )
