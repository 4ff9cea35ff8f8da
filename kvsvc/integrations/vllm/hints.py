"""The scheduler's presence index: kvsvc's client-side index of this deployment's
namespace (``KVCacheClient.presence``), which follows kvsvc's events stream in
the background and answers lookups from local memory. It is a hint: ``None``
(unknown: not connected, stale, resyncing) sends the scheduler to the Lookup RPC,
and a hit whose key is gone by the Retrieve is a failed load that vLLM
recomputes. It has its own client, kept across the Link's replacements (the
index reconnects and resyncs by itself), and is opened again at most once per
``reconnect_interval_s`` when opening failed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvsvc.client import KVCacheClient
from kvsvc.errors import BoundedLog
from kvsvc.integrations.vllm.common import log
from kvsvc.integrations.vllm.config import VllmConnectorConfig
from kvsvc.integrations.vllm.link import make_client


class Hints:
    """``prefix_hits``/``hits`` from the index, or None (then ask kvsvc)."""

    def __init__(
        self,
        cfg: VllmConnectorConfig,
        namespace: str,
        listener: Callable[[Any], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.listener = listener
        self.client: KVCacheClient | None = None
        self.index: Any = None
        self.retry_at = 0.0
        self.warn = BoundedLog(log, 60.0)

    def open(self) -> Any:
        """The index, opened now if it is not (never more than once per interval)."""
        if self.index is not None or not self.cfg.presence:
            return self.index
        now = time.monotonic()
        if now < self.retry_at:
            return None
        self.retry_at = now + self.cfg.reconnect_interval_s
        try:
            client = self.client or make_client(self.cfg, self.cfg.fence_timeout_s)
            self.client = client
            presence = getattr(client, "presence", None)
            if presence is None:  # a kvsvc client without the index: Lookup RPCs
                self.warn.warning("kvsvc: this client has no presence index; Lookup RPCs")
                self.retry_at = float("inf")
                return None
            index = presence(self.namespace, on_batch=self.listener)
        except Exception as exc:  # noqa: BLE001 - the scheduler falls back to Lookup
            self.warn.warning(
                "kvsvc presence index not opened (%s: %s): Lookup RPCs; retrying in %.1f s",
                type(exc).__name__,
                exc,
                self.cfg.reconnect_interval_s,
            )
            return None
        self.index = index
        log.info("kvsvc: presence index of %s opened", self.namespace)
        return index

    @property
    def fresh(self) -> bool:
        index = self.open()
        return bool(index is not None and index.fresh)

    def prefix_hits(self, keys: Sequence[bytes]) -> int | None:
        index = self.open()
        return None if index is None else index.prefix_hits(keys)

    def hits(self, keys: Sequence[bytes]) -> list[bool] | None:
        index = self.open()
        return None if index is None else index.hits(keys)

    def close(self) -> None:
        if self.index is not None:
            with contextlib.suppress(Exception):
                self.index.close()
            self.index = None
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None
