"""The S3 tier's Prometheus series (``kvsvc_s3_*``), read from the tier when
scraped, and its row of the figures every tier reports (``kvsvc_tier_*{tier="s3"}``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvsvc.server.tiers.s3.endpoint import Endpoint
from kvsvc.server.tiers.s3.writer import Writer


class Figures(NamedTuple):
    """The fields of every tier's figures (kvsvc.server.ops' TierFigures, read by
    name): S3 does not tell this server its size, so no used or capacity bytes."""

    hits: int
    read_bytes: int
    written_chunks: int
    written_bytes: int
    queue_bytes: int
    used_bytes: int | None = None
    capacity_bytes: int | None = None


class S3Collector:
    def __init__(self, endpoint: Endpoint, writer: Writer) -> None:
        self.endpoint = endpoint
        self.writer = writer

    def collect(self) -> Iterator[Any]:
        e = self.endpoint
        with e.lock:
            tables = (dict(e.errors), dict(e.rejected), dict(e.skipped))
            misses, dropped = e.misses, e.dropped_objects
        yield CounterMetricFamily(
            "kvsvc_s3_misses", "chunks Retrieve asked S3 for and did not get", value=misses
        )
        yield CounterMetricFamily(
            "kvsvc_s3_dropped_objects", "objects deleted by DropNamespace", value=dropped
        )
        for (name, doc, label), table in zip(
            (
                (
                    "kvsvc_s3_errors",
                    "S3 exchanges that failed or were skipped, by kind: auth, bucket, timeout, "
                    "connection, server (5xx), breaker_open, busy, budget, capacity, other",
                    "kind",
                ),
                (
                    "kvsvc_s3_rejected_objects",
                    "S3 objects refused (never loaded), by why: header, layout, name, "
                    "truncated, checksum, stale (its newest version was never written)",
                    "kind",
                ),
                (
                    "kvsvc_s3_skipped_writes",
                    "chunks not written to S3, by why: queue (write-behind full), "
                    "unavailable (S3 failing, breaker open), bucket, closing, other",
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
            "kvsvc_s3_breaker_state",
            "the S3 circuit breaker: 0 closed, 1 open, 2 half-open (one probe)",
            value=e.breaker.state,
        )
        yield GaugeMetricFamily(
            "kvsvc_s3_known_objects",
            "keys this server wrote to or read from S3 (Lookup asks S3 nothing for them)",
            value=len(e.known),
        )

    def figures(self) -> Figures:
        e = self.endpoint
        return Figures(
            hits=e.hits,
            read_bytes=e.bytes_read,
            written_chunks=e.writes,
            written_bytes=e.bytes_written,
            queue_bytes=self.writer.queued_bytes,
        )
