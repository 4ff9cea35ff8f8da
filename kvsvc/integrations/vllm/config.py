"""The vLLM connector's settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsvc.integrations.common import ConnectionSettings, parse_settings, read_token

__all__ = ["VllmConnectorConfig", "read_token"]


@dataclass(frozen=True)
class VllmConnectorConfig(ConnectionSettings):
    """The connector's settings: ``kv_connector_extra_config`` keys, else
    ``KVSVC_VLLM_<KEY>`` environment variables, else these defaults (the connection
    keys are kvsvc.integrations.common.ConnectionSettings')."""

    namespace: str = "vllm"
    blocks_per_chunk: int = 1
    # The ``medium`` of the vLLM KV events that publish what kvsvc holds (only when
    # vLLM's kv_events_config enables events).
    kv_events_medium: str = "kvsvc"

    @classmethod
    def parse(
        cls, extra: dict[str, Any] | None, env: dict[str, str] | None = None
    ) -> VllmConnectorConfig:
        """Validate ``extra`` (unknown keys are an error, so a typo is not ignored)."""
        return parse_settings(cls, extra, "KVSVC_VLLM_", "kv_connector_extra_config", env)
