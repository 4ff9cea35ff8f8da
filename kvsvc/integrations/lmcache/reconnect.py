"""Lookups never reconnect: after kvsvc failed, a background probe finds out
whether it is back, and lookups report absent until it says so.

A lookup is on LMCache's hot path (its prefetch controller asks before every
load). Reconnecting inline made the lookup that came after ``reconnect_interval_s``
pay the first call on a fresh channel to a kvsvc that may still be down: with
kvsvc killed, lookups' p99 was 4.9 ms against 1.1 ms up (``benchmarks.lmcache_l2``,
docs/lmcache.md), the slow ones those probes. Stores and loads still reconnect on
their own threads, where a failed attempt costs no lookup anything.

The probe thread's only exits are ``close()`` and an answer; whatever else
happens in it is logged and retried. While kvsvc is unproven a lookup also makes
sure the thread runs, so no state can leave lookups absent with nobody asking."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvsvc.client import KVCacheClient
from kvsvc.integrations.common import Link

log = logging.getLogger("kvsvc.lmcache")


class Reconnect:
    """Which client a lookup may use, and the thread that proves kvsvc is back."""

    def __init__(
        self, link: Link, on_failure: Callable[[BaseException], None], timeout_s: float
    ) -> None:
        self.link = link
        self.on_failure = on_failure  # the adapter's failure path: counts, logs, down again
        self.timeout_s = timeout_s
        self.probes = 0  # probes made (report_status)
        self._lock = threading.Lock()
        self._unproven = False  # kvsvc failed and no probe has had an answer since
        self._failures = 0  # failures seen: a probe's answer proves only the ones before it
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def unproven(self) -> bool:
        with self._lock:
            return self._unproven

    def failed(self) -> None:
        """kvsvc failed: lookups skip it until a probe, made once kvsvc's down time
        has passed and after every failure since, gets an answer."""
        with self._lock:
            self._unproven = True
            self._failures += 1
        self._ensure_probing()

    def client(self) -> KVCacheClient | None:
        """The client for a lookup, or None (absent) while kvsvc counts as down or
        is not yet proven back. Never makes a call of its own."""
        if time.monotonic() < self.link.down_until:
            return None
        if self.unproven:
            self._ensure_probing()
            return None
        return self.link.get()

    @property
    def probing(self) -> bool:
        """Whether the probe thread runs (after ``close``, until its last probe ends)."""
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """No probe starts after this; one in flight ends by its own deadline."""
        self._stop.set()

    def _ensure_probing(self) -> None:
        with self._lock:
            if self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(
                target=self._run, name="kvsvc-l2-reconnect", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self._unproven:
                    self._thread = None  # with the flag: a failure after this starts anew
                    return
                failures = self._failures
            wait = self.link.down_until - time.monotonic()
            if wait > 0:
                self._stop.wait(wait)
                continue
            try:
                answered = self._probe()
            except Exception:  # the probe must outlive any failure path
                log.exception("kvsvc: the reconnect probe failed; retried")
                self._stop.wait(self.link.cfg.reconnect_interval_s)
                continue
            if answered:
                with self._lock:
                    if self._failures == failures:  # no failure came while it asked
                        self._unproven = False
                        log.info("kvsvc answered again: lookups resume")

    def _probe(self) -> bool:
        self.probes += 1
        client = self.link.get()
        if client is None:  # down again: a store or load failed meanwhile
            return False
        try:
            client.server_info(timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure is kvsvc down: the adapter's path
            self.on_failure(exc)
            return False
        return True
