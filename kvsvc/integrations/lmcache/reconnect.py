"""Lookups never reconnect: after kvsvc failed, one background probe at a time
finds out whether it is back, and lookups report absent until it says so.

A lookup is on LMCache's hot path (its prefetch controller asks before every
load). Reconnecting inline made the lookup that came after ``reconnect_interval_s``
pay the first call on a fresh channel to a kvsvc that may still be down: with
kvsvc killed, lookups' p99 was 8.2 ms against 1.3 ms up (``benchmarks.lmcache_l2``,
docs/lmcache.md), every slow one such a probe. Stores and loads still reconnect
on their own threads, where a failed attempt costs no lookup anything."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvsvc.client import KVCacheClient
from kvsvc.integrations.common import Link


class Reconnect:
    """Which client a lookup may use, and the thread that brings kvsvc back."""

    def __init__(
        self, link: Link, on_failure: Callable[[BaseException], None], timeout_s: float
    ) -> None:
        self.link = link
        self.on_failure = on_failure  # the adapter's failure path: counts, logs, down again
        self.timeout_s = timeout_s
        self.probes = 0  # probes made (report_status)
        self._lock = threading.Lock()
        self._unproven = False  # kvsvc failed and no probe has had an answer since
        self._probing = False  # the probe thread runs
        self._stop = threading.Event()

    @property
    def unproven(self) -> bool:
        with self._lock:
            return self._unproven

    def failed(self) -> None:
        """kvsvc failed: lookups skip it until a probe gets an answer; the probe
        thread (one at a time) asks once kvsvc's down time has passed, and again
        after each failure, until kvsvc answers or the adapter closes."""
        with self._lock:
            self._unproven = True
            if self._probing or self._stop.is_set():
                return
            self._probing = True
        threading.Thread(target=self._run, name="kvsvc-l2-reconnect", daemon=True).start()

    def client(self) -> KVCacheClient | None:
        """The client for a lookup, or None (absent) while kvsvc counts as down or
        is not yet proven back. Never makes a call of its own."""
        if time.monotonic() < self.link.down_until:
            return None
        with self._lock:
            if self._unproven:
                return None
        return self.link.get()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                wait = self.link.down_until - time.monotonic()
                if wait > 0:
                    self._stop.wait(wait)
                    continue
                if self._probe():
                    with self._lock:  # with the flag, so a failure after it starts anew
                        self._unproven = self._probing = False
                    return
        finally:
            with self._lock:
                self._probing = False

    def _probe(self) -> bool:
        self.probes += 1
        try:
            client = self.link.get()
            if client is None:  # down again: a store or load failed meanwhile
                return False
            client.server_info(timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure is kvsvc down: the adapter's path
            self.on_failure(exc)
            return False
        return True
