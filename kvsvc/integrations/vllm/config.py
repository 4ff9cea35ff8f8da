"""The vLLM connector's settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from kvsvc.limits import validate_deadline


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
            else:
                values[name] = str(raw)
        return cls(**values)
