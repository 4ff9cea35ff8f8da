"""The circuit breaker of a tier below memory that talks to a server (Redis, S3):
after ``failures`` failures in a row the tier stops calling it (reads are misses,
writes are skipped) and lets one probe call through every ``open_s``; the probe's
outcome closes or reopens it. Thread-safe: the tiers' reader and writer threads
share one. Each transition is one log line, in the tier's own words."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "Breaker"]

CLOSED, OPEN, HALF_OPEN = 0, 1, 2

log = logging.getLogger("kvsvc.server.tiers")


class Breaker:
    """Closed → open after ``failures`` failures in a row; open → one probe call
    after ``open_s``; the probe's outcome closes or reopens it. ``what`` names the
    server in the log lines ("Redis", "S3"), ``tier`` the tier, and
    ``meanwhile`` what the tier does while open."""

    def __init__(
        self,
        failures: int,
        open_s: float,
        *,
        tier: str,
        what: str,
        meanwhile: str,
    ) -> None:
        self.failures = failures
        self.open_s = open_s
        self.tier, self.what, self.meanwhile = tier, what, meanwhile
        self.state = CLOSED
        self.opened_total = 0
        self._fails = 0
        self._opened = 0.0
        self._probing = False
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a call may go now (while half open: the one probe's turn)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and time.monotonic() - self._opened >= self.open_s:
                self.state = HALF_OPEN
            if self.state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def blocked(self) -> bool:
        """Whether a call now would be refused (without taking the probe's turn)."""
        with self._lock:
            if self.state == CLOSED:
                return False
            if self.state == OPEN:
                return time.monotonic() - self._opened < self.open_s
            return self._probing

    def success(self) -> None:
        with self._lock:
            if self.state != CLOSED:
                log.warning("%s tier: %s answers again; breaker closed", self.tier, self.what)
            self.state, self._fails, self._probing = CLOSED, 0, False

    def failure(self) -> None:
        with self._lock:
            self._fails += 1
            self._probing = False
            if self.state == HALF_OPEN or (self.state == CLOSED and self._fails >= self.failures):
                if self.state == CLOSED:
                    log.warning(
                        "%s tier: %d %s failures in a row; breaker open, probing every %g s (%s)",
                        self.tier,
                        self._fails,
                        self.what,
                        self.open_s,
                        self.meanwhile,
                    )
                    self.opened_total += 1
                self.state = OPEN
                self._opened = time.monotonic()
