"""The vLLM connector's settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from kvsvc.integrations.common import parse_bool as _parse_bool
from kvsvc.integrations.common import read_token
from kvsvc.limits import validate_deadline

__all__ = ["VllmConnectorConfig", "read_token"]


@dataclass(frozen=True)
class VllmConnectorConfig:
    """The connector's settings: ``kv_connector_extra_config`` keys, else
    ``KVSVC_VLLM_<KEY>`` environment variables, else these defaults."""

    target: str = "127.0.0.1:50051"
    # A tenant prefix; the deployment fingerprint is appended to it.
    namespace: str = "vllm"
    # The scheduler waits at most this long per request for a Lookup; then a miss.
    lookup_timeout_s: float = 0.05
    load_timeout_s: float = 10.0
    store_timeout_s: float = 10.0
    fence_timeout_s: float = 10.0
    # After a failure, kvsvc counts as down (0 hits, stores skipped) this long,
    # then the connector reconnects on a fresh channel.
    reconnect_interval_s: float = 2.0
    blocks_per_chunk: int = 1
    log_level: str = "INFO"
    # Security, as the Python client names it: the bearer token's file (read at each
    # connect, so a rotated token is picked up), TLS (on when any tls_* is set, or
    # ``tls``: the system's roots), and the fd socket as this process sees it.
    token_file: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    fd_socket: str = ""
    # The scheduler answers lookups from a presence index that follows kvsvc's
    # events stream (no RPC on its step while the index is fresh); False: a Lookup
    # RPC per request, as without an index.
    presence: bool = True
    # The ``medium`` of the vLLM KV events that publish what kvsvc holds (only when
    # vLLM's kv_events_config enables events).
    kv_events_medium: str = "kvsvc"

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")

    @property
    def uses_tls(self) -> bool:
        return self.tls or any((self.tls_ca, self.tls_cert, self.tls_server_name))

    @classmethod
    def parse(
        cls, extra: dict[str, Any] | None, env: dict[str, str] | None = None
    ) -> VllmConnectorConfig:
        """Validate ``extra`` (unknown keys are an error, so a typo is not ignored)."""
        env = dict(os.environ) if env is None else env
        extra = dict(extra or {})
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(names)}"
            )
        values: dict[str, Any] = {}
        for name, f in names.items():
            raw = extra.get(name, env.get(f"KVSVC_VLLM_{name.upper()}"))
            if raw is None:
                continue
            if name.endswith("_s"):
                values[name] = validate_deadline(float(raw) if isinstance(raw, str) else raw, name)
            elif f.type in ("int", int):
                if isinstance(raw, bool) or int(raw) < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {raw!r}")
                values[name] = int(raw)
            elif f.type in ("bool", bool):
                values[name] = _parse_bool(name, raw)
            else:
                values[name] = str(raw)
        return cls(**values)
