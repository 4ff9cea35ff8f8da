"""The connector's link to kvsvc, one per role and process: a client that a failure
replaces, and a "down until" time during which the connector skips kvsvc (a miss,
no stores) instead of waiting on a dead server in a vLLM hook."""

from __future__ import annotations

import contextlib
import time

from kvsvc.client import KVCacheClient
from kvsvc.errors import (
    Cancelled,
    DeadlineExceeded,
    MappingLost,
    ServiceNotServing,
    ServiceUnavailable,
    TransferUnprovable,
)
from kvsvc.integrations.vllm.config import VllmConnectorConfig

# Failures after which the mapping may be gone (kvsvc down, restarted, stuck): map again.
LINK_ERRORS = (
    MappingLost,
    ServiceUnavailable,
    ServiceNotServing,
    DeadlineExceeded,
    Cancelled,
    TransferUnprovable,
    ConnectionError,
)


class Link:
    """A client that is replaced by a fresh channel after a failure, at most
    once per ``reconnect_interval_s`` (gRPC's own reconnect backoff grows to
    minutes), and a "down until" time during which callers skip kvsvc."""

    def __init__(self, cfg: VllmConnectorConfig, control_timeout: float) -> None:
        self.cfg = cfg
        self.control_timeout = control_timeout
        self.client: KVCacheClient | None = None
        self.down_until = 0.0
        self.old: list[KVCacheClient] = []

    def get(self) -> KVCacheClient | None:
        """The client, or None while kvsvc counts as down."""
        if time.monotonic() < self.down_until:
            return None
        if self.client is None:
            # Over the client's Session stream (unary where the server lacks it): the
            # scheduler's Lookup per request costs about half a unary call's.
            self.client = KVCacheClient(
                self.cfg.target,
                control_timeout=self.control_timeout,
                transfer_timeout=self.cfg.load_timeout_s,
            )
        return self.client

    def failed(self) -> None:
        self.down_until = time.monotonic() + self.cfg.reconnect_interval_s
        if self.client is not None:
            # In-flight futures may still use it: closed later, not now. A call
            # still running on one closed here ends as Cancelled (UNKNOWN: fenced).
            self.old.append(self.client)
            self.client = None
            while len(self.old) > 4:
                with contextlib.suppress(Exception):
                    self.old.pop(0).close()

    def close(self) -> None:
        for c in [*self.old, *([self.client] if self.client else [])]:
            with contextlib.suppress(Exception):
                c.close()
        self.old.clear()
        self.client = None
