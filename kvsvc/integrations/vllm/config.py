"""The vLLM connector's settings, and the namespace a request's cache salt maps to."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kvsvc.integrations.common import ConnectionSettings, parse_settings, read_token

__all__ = ["VllmConnectorConfig", "read_token", "salt_namespace"]

#: hex digits of a salt's SHA-256 in its namespace (64 bits: two salts share a
#: namespace by chance ~never, and if they did their keys still differ: vLLM folds
#: the salt into its block hashes)
SALT_HASH_CHARS = 16

#: vLLM's media for KV held outside the GPU (vllm/v1/kv_offload/base.py Medium)
KV_EVENTS_MEDIA = ("CPU", "STORAGE")


@dataclass(frozen=True)
class VllmConnectorConfig(ConnectionSettings):
    """The connector's settings: ``kv_connector_extra_config`` keys, else
    ``KVSVC_VLLM_<KEY>`` environment variables, else these defaults (the connection
    keys are kvsvc.integrations.common.ConnectionSettings')."""

    namespace: str = "vllm"
    blocks_per_chunk: int = 1
    # The ``medium`` of the vLLM KV events that publish this engine's blocks in
    # kvsvc (only when vLLM's kv_events_config enables events): one of vLLM's
    # offloading media (KV_EVENTS_MEDIA), as routers know them; "STORAGE" where
    # kvsvc keeps the deployment's chunks on disk.
    kv_events_medium: str = "CPU"
    # A request with a ``cache_salt`` keeps its chunks in a namespace of its own,
    # ``<namespace>/salt-<hash>`` (salt_namespace): an eviction share of its own
    # (kvsvc's --namespace-share) and one DropNamespace to delete them.
    salt_namespaces: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_events_medium not in KV_EVENTS_MEDIA:
            raise ValueError(
                f"kv_events_medium {self.kv_events_medium!r} is not one of vLLM's "
                f"offloading media {KV_EVENTS_MEDIA}"
            )

    @classmethod
    def parse(
        cls, extra: dict[str, Any] | None, env: dict[str, str] | None = None
    ) -> VllmConnectorConfig:
        """Validate ``extra`` (unknown keys are an error, so a typo is not ignored)."""
        return parse_settings(cls, extra, "KVSVC_VLLM_", "kv_connector_extra_config", env)


def salt_namespace(namespace: str, salt: str | None) -> str:
    """The namespace of a request's chunks: ``namespace`` itself when it has no salt
    (None or empty), else ``<namespace>/salt-<first 64 bits of SHA-256(salt), hex>``
    (the salt itself never reaches kvsvc; a tenant granted ``<namespace>*`` or a
    prefix of it is granted every salt's namespace)."""
    if not salt:
        return namespace
    digest = hashlib.sha256(salt.encode()).hexdigest()[:SALT_HASH_CHARS]
    return f"{namespace}/salt-{digest}"
