"""Whether the disk takes writes, and how the tier heals when it stops.

A filesystem that refuses a write (read-only after an error or a remount, EIO,
EACCES) takes the tier "down": from then on writes are skipped before they are
queued, each counted under the reason that took it down, and a probe (a small
temporary file written and removed by the writer thread) runs every ``RETRY_S``
until one lands; then the tier is up again. Each change is logged once. A full
disk is not down: eviction makes room, and each skipped write says so.

Files a Store replaced but that could not be removed (the disk refused) are owed:
they are out of the index at once, so this process never serves them, and their
removal is queued again, ahead of any new write, as soon as the disk is back, and
at stop. Memory alone would not outlive the process: a server killed or stopped
while the disk refuses, or in the second between the disk's recovery and the next
probe, would leave the old file for its successor to index. So each owed name is
also recorded off the disk before the Store replies, and a start removes what the
record lists before it indexes (kvsvc.server.tiers.disk.owed: where, and the one
case it cannot cover)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

log = logging.getLogger("kvsvc.server.tiers.disk")

#: seconds between probes while the disk refuses writes
RETRY_S = 1.0
#: reasons a write is skipped while the tier is down (kvsvc_disk_skipped_writes)
DOWN_REASONS = ("read_only", "permission", "io")


class WriteHealth:
    """On the loop: up or down, what was skipped, and the removals owed."""

    def __init__(
        self,
        root: str,
        loop: asyncio.AbstractEventLoop,
        probe: Callable[[], None],
        unlink: Callable[[list[str]], None],
    ) -> None:
        self.root, self.loop = root, loop
        self._probe, self._unlink = probe, unlink
        #: why writes are skipped now (a DOWN_REASONS entry), None while they land
        self.down: str | None = None
        self.skipped = dict.fromkeys(DOWN_REASONS, 0)
        #: files replaced or dropped that are still on disk (their removal failed)
        self.owed: set[str] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def writing(self) -> bool:
        return self.down is None

    def skip(self) -> bool:
        """True (and counted) when a write must be skipped now."""
        if self.down is None:
            return False
        self.skipped[self.down] += 1
        return True

    def failed(self, reason: str, what: str) -> None:
        """A write or a removal failed for ``reason`` (a DOWN_REASONS entry)."""
        self.skipped[reason] += what == "write"
        if self.down is not None:
            return
        self.down = reason
        log.warning(
            "disk tier: %s refuses writes (%s, on a %s): writes are skipped and counted, "
            "memory keeps serving; retrying every %g s",
            self.root,
            reason,
            what,
            RETRY_S,
        )
        self._schedule()

    def owe(self, names: Iterable[str]) -> None:
        self.owed.update(names)

    def settle(self, removed: Iterable[str]) -> None:
        """``removed`` are gone from disk (removed, or never there)."""
        self.owed.difference_update(removed)

    def probed(self, outcome: str | None) -> None:
        """A probe's outcome (on the loop)."""
        self._timer = None
        if self._closed or self.down is None:
            return
        if outcome is not None:
            self._schedule()
            return
        log.warning("disk tier: %s takes writes again; writing resumed", self.root)
        self.down = None
        self.retry_owed()

    def retry_owed(self) -> None:
        """Queue the owed removals again (ahead of writes queued after this)."""
        if self.owed:
            self._unlink(sorted(self.owed))

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()

    def _schedule(self) -> None:
        if not self._closed and self._timer is None:
            self._timer = self.loop.call_later(RETRY_S, self._probe)
