"""``kvsvc stats``: how the cache is doing, in one command (the ``redis-cli INFO`` of
kvsvc), read from GetServerInfo's FULL view and drawn with rich: the tiers
(capacity, use, hit rates, bytes, removals and skipped writes by reason), Lookup's
hit rate, the caller's tenant against its quota, the event stream's watchers and
lag, the copy loop and why, and the settings in force (secrets redacted).
``--watch`` redraws it in place every ``--interval`` seconds with per-second rates
(on a terminal; piped, each refresh is printed after the last), ``--json`` prints
the reply itself. Every bad setting, an unreachable server or a refused token is
one line and exit 2."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf import json_format
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvsvc.server.config import TOKEN_FILE_ENV, ConfigError, read_token_file
from kvsvc.v1 import kv_cache_service_pb2 as pb

if TYPE_CHECKING:
    from kvsvc.client import KVCacheClient

DEFAULT_TARGET = "127.0.0.1:50051"
_LOOPS = {pb.COPY_LOOP_KIND_NATIVE: "native", pb.COPY_LOOP_KIND_PYTHON: "Python"}


class Refused(Exception):
    """What makes ``kvsvc stats`` stop: its one line (exit 2)."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    stats = sub.add_parser(
        "stats",
        help="how the cache is doing: tiers, hit rates, tenant quota, events, settings",
        description="Show the server's stats (GetServerInfo's FULL view): each tier's "
        "capacity, use, hit rates and bytes, evictions and skipped writes by reason, the "
        "caller's tenant against its quota, event-stream watchers and lag, the copy loop "
        "and the settings in force (secrets redacted).",
    )
    stats.add_argument("--target", default=DEFAULT_TARGET, help="HOST:PORT or unix:PATH")
    stats.add_argument(
        "--token-file",
        default=os.environ.get(TOKEN_FILE_ENV, ""),
        help=f"file holding the bearer token (env {TOKEN_FILE_ENV})",
    )
    stats.add_argument("--tls-ca", default=None, help="PEM CA that signed the server's cert")
    stats.add_argument("--tls-cert", default=None, help="PEM client certificate (mTLS)")
    stats.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    stats.add_argument(
        "--tls-server-name", default=None, help="name to verify when it differs from the host"
    )
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds each call may take")
    stats.add_argument(
        "--watch",
        action="store_true",
        help="refresh in place with per-second rates, the settings left out (Ctrl-C ends)",
    )
    stats.add_argument(
        "--interval", type=float, default=2.0, help="seconds between --watch refreshes"
    )
    stats.add_argument(
        "--count", type=int, default=0, help="with --watch: end after this many refreshes"
    )
    stats.add_argument(
        "--all-settings",
        action="store_true",
        help="list settings at their defaults too (and with --watch, every setting)",
    )
    stats.add_argument("--json", action="store_true", help="print the reply as JSON")
    return stats


def run(args: argparse.Namespace) -> int:
    try:
        fetch = _connect(args)
        try:
            if not args.watch:
                _show(args, fetch(), None)
                return 0
            return _watch(args, fetch)
        finally:
            fetch.close()
    except Refused as exc:
        print(f"kvsvc stats: {exc}", file=sys.stderr)
        return 2


# --- the call ---
class _Fetch:
    """One client; each call is one GetServerInfo (FULL view)."""

    def __init__(self, client: KVCacheClient, timeout: float) -> None:
        self.client, self.timeout = client, timeout

    def __call__(self) -> pb.GetServerInfoResult:
        from kvsvc.errors import KVServiceError

        try:
            info = self.client.server_info(stats=True, timeout=self.timeout)
        except KVServiceError as exc:
            raise Refused(f"{self.client.target}: {type(exc).__name__}: {_line(exc)}") from None
        if not info.HasField("stats"):
            raise Refused(f"{self.client.target}: the server sent no stats (an older kvsvc?)")
        return info

    def close(self) -> None:
        self.client.close()


def _connect(args: argparse.Namespace) -> _Fetch:
    """The client the flags describe; every bad flag is Refused, before any call."""
    _check_target(args.target)
    for flag, value in (("--timeout", args.timeout), ("--interval", args.interval)):
        if not (math.isfinite(value) and value > 0):
            raise Refused(f"{flag} {value:g}: must be a positive number of seconds")
    if args.count < 0:
        raise Refused(f"--count {args.count}: must be 0 (no end) or more")
    try:
        token = read_token_file(args.token_file) if args.token_file else None
    except ConfigError as exc:
        raise Refused(str(exc)) from None
    from kvsvc.client import KVCacheClient
    from kvsvc.client.tls import ClientTLS

    tls = None
    files = (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key))
    if any(path is not None for _, path in files) or args.tls_server_name:
        for flag, path in files:
            if path is not None and not os.access(path, os.R_OK):
                raise Refused(f"{flag} {path}: cannot read it")
        try:
            tls = ClientTLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        except ValueError:
            raise Refused("--tls-cert and --tls-key go together") from None
    return _Fetch(KVCacheClient(args.target, token=token, tls=tls), args.timeout)


def _check_target(target: str) -> None:
    """HOST:PORT (port 1-65535) or unix:PATH: gRPC would otherwise guess (port 443)."""
    if target.startswith("unix:"):
        if len(target) > len("unix:"):
            return
        raise Refused("--target unix: needs a path (unix:/run/kvsvc/grpc.sock)")
    host, colon, port = target.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Refused(f"--target {target}: give HOST:PORT (port 1-65535) or unix:PATH")


def _line(exc: BaseException) -> str:
    """The error's first line (gRPC's details may run over several)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# --- showing it ---
def _show(args: argparse.Namespace, info: pb.GetServerInfoResult, rates: Rates | None) -> None:
    if args.json:
        print(json_format.MessageToJson(info, indent=None), flush=True)
        return
    Console().print(_view(args, info, rates))


def _view(
    args: argparse.Namespace, info: pb.GetServerInfoResult, rates: Rates | None
) -> RenderableType:
    """What one look shows; --watch leaves the settings out (they do not change while
    the server runs: one screen holds the rest) unless --all-settings asks for them."""
    settings = "all" if args.all_settings else "none" if args.watch else "changed"
    return render(info, args.target, rates=rates, settings=settings)


def _watch(args: argparse.Namespace, fetch: Callable[[], pb.GetServerInfoResult]) -> int:
    """Refresh until Ctrl-C or --count refreshes: in place on a terminal, one after
    another when piped (or with --json, one JSON line each)."""
    console = Console()
    live = None if args.json or not console.is_terminal else Live(console=console)
    last: pb.GetServerInfoResult | None = None
    shown = 0
    try:
        if live is not None:
            live.start()
        while True:
            info = fetch()
            rates = Rates.between(last, info) if last is not None else None
            if live is not None:
                live.update(_view(args, info, rates), refresh=True)
            else:
                _show(args, info, rates)
            last, shown = info, shown + 1
            if args.count and shown >= args.count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()


@dataclass(frozen=True)
class Rates:
    """Per-second figures between two replies (--watch)."""

    seconds: float
    lookups: float
    lookup_hit_rate: float | None
    stored: float
    evicted: float

    @classmethod
    def between(cls, before: pb.GetServerInfoResult, now: pb.GetServerInfoResult) -> Rates | None:
        a, b = before.stats, now.stats
        seconds = (b.taken.ToNanoseconds() - a.taken.ToNanoseconds()) / 1e9
        if seconds <= 0 or before.server_start_id != now.server_start_id:
            return None  # a restart: its counters began again
        asked = b.lookups.asked_chunks - a.lookups.asked_chunks
        hits = b.lookups.hit_chunks - a.lookups.hit_chunks
        memory_a, memory_b = _memory(a), _memory(b)
        return cls(
            seconds=seconds,
            lookups=(b.lookups.requests - a.lookups.requests) / seconds,
            lookup_hit_rate=hits / asked if asked else None,
            stored=(memory_b.written_chunks - memory_a.written_chunks) / seconds,
            evicted=(
                memory_b.removed_chunks.get("evicted", 0)
                - memory_a.removed_chunks.get("evicted", 0)
            )
            / seconds,
        )


def _memory(stats: pb.ServerStats) -> pb.TierStats:
    return next((t for t in stats.tiers if t.name == "memory"), pb.TierStats())


def render(
    info: pb.GetServerInfoResult,
    target: str,
    *,
    rates: Rates | None = None,
    settings: str = "changed",
) -> RenderableType:
    """The whole view: a heading, then one table per section; ``settings``: "all",
    "changed" (those not at their defaults) or "none"."""
    s = info.stats
    parts: list[RenderableType] = [_heading(info, target)]
    if rates is not None:
        parts.append(_rates(rates))
    parts += [
        _tiers(s),
        _traffic(s),
        _reasons(s),
        _tenants(s),
        _events(s.events),
    ]
    if settings != "none":
        parts.append(_settings(s.settings, everything=settings == "all"))
    return Group(*parts)


def _heading(info: pb.GetServerInfoResult, target: str) -> Text:
    s = info.stats
    up = (s.taken.ToNanoseconds() - info.start_time.ToNanoseconds()) / 1e9
    state = Text("serving", style="green") if info.serving else Text("NOT SERVING", style="red")
    line = Text.assemble(
        (f"kvsvc {info.version}", "bold"),
        f" at {target}: ",
        state,
        f" (failure: {info.failure_reason})" if info.failure_reason else "",
        f", up {_duration(up)}, device {info.device}\n",
        f"start id {info.server_start_id}, mappings {info.mappings}, "
        f"transfers in flight {info.inflight_transfers}\n",
        f"lookups {s.lookups.requests}: hit rate ",
        (_ratio(s.lookups.hit_chunks, s.lookups.asked_chunks), "bold"),
        f" of {s.lookups.asked_chunks} keys asked\n",
        "copy loop: ",
        (_LOOPS.get(s.copy_loop.kind, "unknown"), "bold"),
        f" ({s.copy_loop.reason})",
    )
    return line


def _rates(r: Rates) -> Text:
    hit = "-" if r.lookup_hit_rate is None else f"{r.lookup_hit_rate:.1%}"
    return Text(
        f"last {r.seconds:.1f} s: {r.lookups:.1f} lookups/s (hit rate {hit}), "
        f"{r.stored:.1f} chunks stored/s, {r.evicted:.1f} evicted/s",
        style="cyan",
    )


def _tiers(s: pb.ServerStats) -> Table:
    t = _table("Tiers", "tier", "capacity", "used", "use", "chunks", "writes")
    for tier in s.tiers:
        # a shared store's own size is not this server's to say
        unknown = tier.name in ("redis", "s3")
        t.add_row(
            tier.name,
            "-" if not tier.capacity_bytes else _bytes(tier.capacity_bytes),
            "-" if unknown else _bytes(tier.used_bytes),
            _ratio(tier.used_bytes, tier.capacity_bytes),
            str(tier.chunks),
            _writes(tier),
        )
    return t


def _traffic(s: pb.ServerStats) -> Table:
    t = _table(
        "Hits and bytes", "tier", "lookup hits", "retrieve hits", "hit rate", "read", "written"
    )
    t.add_column("queued", justify="right")
    for tier in s.tiers:
        t.add_row(
            tier.name,
            str(tier.lookup_hit_chunks),
            f"{tier.retrieve_hit_chunks} of {tier.retrieve_asked_chunks}",
            _ratio(tier.retrieve_hit_chunks, tier.retrieve_asked_chunks),
            _bytes(tier.read_bytes),
            f"{tier.written_chunks} ({_bytes(tier.written_bytes)})",
            _bytes(tier.queued_bytes),
        )
    return t


def _table(title: str, first: str, *numbers: str) -> Table:
    """A section: its first column names the row, the others are right-aligned figures."""
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD)
    t.add_column(first, no_wrap=True)
    for name in numbers:
        t.add_column(name, justify="right", no_wrap=True)
    return t


def _writes(tier: pb.TierStats) -> Text:
    if not tier.ready:
        return Text("index loading", style="yellow")
    return Text("landing", style="green") if tier.writing else Text("skipped", style="red")


def _reasons(s: pb.ServerStats) -> Table:
    t = _table("Removed and skipped, by reason", "tier")
    t.add_column("removed chunks")
    t.add_column("skipped writes")
    for tier in s.tiers:
        t.add_row(tier.name, _by_reason(tier.removed_chunks), _by_reason(tier.skipped_writes))
    return t


def _by_reason(counts: Mapping[str, int]) -> str:
    shown = [f"{reason} {n}" for reason, n in sorted(counts.items()) if n]
    return ", ".join(shown) or "none"


def _tenants(s: pb.ServerStats) -> Table:
    t = _table(
        "Tenant (the caller's) against its quota",
        "tenant", "used", "share", "of share", "ns", "mappings", "in flight",
    )  # fmt: skip
    t.add_column("quota refusals")
    for u in s.tenants:
        over = u.share_bytes and u.used_bytes > u.share_bytes
        t.add_row(
            u.tenant,
            _bytes(u.used_bytes),
            _bytes(u.share_bytes),
            Text(_ratio(u.used_bytes, u.share_bytes), style="red" if over else ""),
            str(u.namespaces),
            _of(u.mappings, u.max_mappings),
            _of(u.inflight_transfers, u.max_inflight),
            _by_reason(u.quota_refusals),
        )
    return t


def _events(e: pb.EventStreamStats) -> Table:
    t = _table("Event stream (WatchEvents)", "watchers", "resyncing", "max lag", "published")
    for name in ("resyncs", "ring", "last"):
        t.add_column(name, justify="right", no_wrap=True)
    t.add_row(
        str(e.watchers),
        str(e.resyncing_watchers),
        f"{e.max_lag_events} events",
        str(e.published_events),
        str(e.resyncs),
        f"{e.ring_events} events, {_bytes(e.ring_bytes)}",
        f"#{e.last_sequence}",
    )
    return t


def _settings(settings: Iterable[pb.ConfigSetting], everything: bool) -> Table:
    listed = list(settings)
    shown = [s for s in listed if everything or not s.is_default]
    hidden = len(listed) - len(shown)
    t = _table("Settings in force" + ("" if everything else " (not at their defaults)"), "setting")
    t.add_column("value")
    t.add_column("group")
    if hidden:
        t.caption, t.caption_justify = f"{hidden} more at their defaults (--all-settings)", "left"
    for s in shown:
        t.add_row(
            "--" + s.name.replace("_", "-"),
            Text(s.value, style="dim" if s.is_default else "bold"),
            s.group,
        )
    return t


# --- numbers as people read them ---
def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)  # not reached


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _of(n: int, limit: int) -> str:
    return f"{n} / {limit}" if limit else str(n)


def _duration(seconds: float) -> str:
    s = int(max(seconds, 0))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{s:02d}s"
