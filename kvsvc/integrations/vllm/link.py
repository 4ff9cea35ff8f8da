"""The connector's link to kvsvc, one per role and process: a client that a failure
replaces, and a "down until" time during which the connector skips kvsvc (a miss,
no stores) instead of waiting on a dead server in a vLLM hook."""

from __future__ import annotations

import contextlib
import time

from kvsvc.client import ClientTLS, KVCacheClient
from kvsvc.errors import (
    Cancelled,
    DeadlineExceeded,
    MappingLost,
    ServiceNotServing,
    ServiceUnavailable,
    TransferUnprovable,
)
from kvsvc.integrations.vllm.common import log
from kvsvc.integrations.vllm.config import VllmConnectorConfig, read_token

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


def make_client(cfg: VllmConnectorConfig, control_timeout: float) -> KVCacheClient:
    """A client with the connector's target, token, TLS and fd socket. Raises
    ValueError when the token file cannot be read (the caller counts kvsvc as down)."""
    tls = None
    if cfg.uses_tls:
        tls = ClientTLS(
            ca=cfg.tls_ca or None,
            cert=cfg.tls_cert or None,
            key=cfg.tls_key or None,
            server_name=cfg.tls_server_name or None,
        )
    # Over the client's Session stream (unary where the server lacks it): the
    # scheduler's Lookup per request costs about half a unary call's.
    return KVCacheClient(
        cfg.target,
        token=read_token(cfg.token_file) if cfg.token_file else None,
        tls=tls,
        fd_socket=cfg.fd_socket or None,
        control_timeout=control_timeout,
        transfer_timeout=cfg.load_timeout_s,
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
            try:
                self.client = make_client(self.cfg, self.control_timeout)
            except ValueError as exc:  # the token file: kvsvc counts as down, told why
                log.error("kvsvc: %s; kvsvc skipped for %.1f s", exc, self.cfg.reconnect_interval_s)
                self.down_until = time.monotonic() + self.cfg.reconnect_interval_s
                return None
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
