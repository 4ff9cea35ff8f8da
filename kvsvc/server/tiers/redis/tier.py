"""RemoteTier, what the servicer calls: its parts (Lookup's EXISTS, Retrieve's
fetch, the write-behind) put together, and its life (start-up's credential
check, close)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from typing import Any

from kvsvc.server.config import ConfigError
from kvsvc.server.tiers.redis.connection import reuse_freed_memory
from kvsvc.server.tiers.redis.fetch import Fetches
from kvsvc.server.tiers.redis.health import (
    AUTH,
    Skipped,
    Unresolved,
    caused_by,
    error_kind,
    log,
)
from kvsvc.server.tiers.redis.runs import Runs
from kvsvc.server.tiers.redis.values import redis_keys
from kvsvc.server.tiers.redis.writer import WriteBehind


class RemoteTier(Runs, Fetches, WriteBehind):
    """One per server: ``present`` (Lookup), ``fetch`` (Retrieve), ``write_behind``
    (after a Store). Public counters are read by kvsvc.server.ops.metrics (RemoteStats)."""

    def start(self) -> None:
        """Check the credentials once: refused ones are a ConfigError (they will not
        heal by themselves); an unreachable Redis is only a warning (the breaker
        and the misses handle it until it answers), and so is a host name that does
        not resolve within --remote-timeout (start-up never waits on DNS longer)."""
        if not reuse_freed_memory():
            log.info("remote tier: malloc keeps its defaults (not glibc, or mallopt refused)")
        try:
            if not self.resolver.first():
                raise Unresolved(f"{self.resolver.host} does not resolve (yet)")
            self._redis().ping()
            if not self.cluster:  # the run its first announcements belong to
                self.run_id = str(self._redis().info("server").get("run_id") or "") or None
            self.breaker.success()
            log.info("remote tier: Redis at %s answers", self.where)
        except Exception as exc:  # noqa: BLE001 - any failure here is judged below
            if error_kind(exc) == AUTH:
                raise ConfigError(
                    f"--remote {self.where}: Redis refused the credentials "
                    f"(--remote-password-file, the URL's user name): {exc}"
                ) from None
            if caused_by(exc, ssl.SSLCertVerificationError):  # will not heal
                raise ConfigError(
                    f"--remote {self.where}: Redis' TLS certificate did not verify "
                    f"(--remote-tls-ca, the host name in the URL): {exc.__context__ or exc}"
                ) from None
            log.warning(
                "remote tier: Redis at %s does not answer at start-up (%s: %s); serving "
                "from the local store, remote reads are misses until it answers",
                self.where,
                type(exc).__name__,
                exc,
            )
            self._count_error(exc)
        self._start_writers()
        self._start_run_checks()

    def close(self) -> None:
        """Stop the writers (queued writes are dropped and counted) and the readers."""
        self._closed = True
        self._stop_run_checks()
        self._stop_writers()
        self._stop_fetchers()
        self._close_client()

    async def aclose(self) -> None:
        """close(), and the loop's connections (Lookup's), within --remote-timeout."""
        self.close()
        await self._close_lookups()

    async def drop_namespace(self, namespace: str, budget: float) -> tuple[int, bool]:
        """Unlink every Redis key of ``namespace`` (each layout, each part: a SCAN
        MATCH of its key prefix, UNLINK in batches; a cluster's every primary) on a
        thread, within ``budget`` s. Returns (keys unlinked, whether the scan ended):
        a Redis that fails or answers too slowly leaves the rest, counted."""
        head = redis_keys(self.prefix, namespace, "", [b""])[0]  # prefix:ns-hex::
        pattern = _glob_escape(head[:-1]) + b"*"  # prefix:ns-hex:<layout>:<key>[:part]
        stop = time.monotonic() + budget
        done = [0, False]

        def drop(r: Any) -> None:
            batch: list[bytes] = []
            for key in r.scan_iter(match=pattern, count=DROP_SCAN_COUNT):
                batch.append(key)
                if len(batch) >= DROP_SCAN_COUNT:
                    done[0] += int(r.unlink(*batch))
                    batch = []
                if time.monotonic() > stop:
                    return
            if batch:
                done[0] += int(r.unlink(*batch))
            done[1] = True

        def run() -> None:
            with contextlib.suppress(Skipped):  # counted, and what was done is kept
                self._call(drop)

        work = self.loop.run_in_executor(None, run)
        try:
            await asyncio.wait_for(asyncio.shield(work), max(budget, 0.0) + self.timeout)
        except TimeoutError:
            log.warning("remote tier: dropping namespace keys outlived its budget")
        return done[0], bool(done[1])


#: keys per SCAN step and per UNLINK
DROP_SCAN_COUNT = 512


def _glob_escape(text: bytes) -> bytes:
    """``text`` matched literally by Redis' glob patterns (the prefix may hold any
    character; the namespace is hex)."""
    out = bytearray()
    for b in text:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)
