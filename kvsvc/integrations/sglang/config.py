"""The SGLang storage backend's settings: the keys of
``--hicache-storage-backend-extra-config`` (the same names as the vLLM
connector's), else ``KVSVC_SGLANG_<KEY>`` environment variables, else these
defaults. SGLang's own keys in the same dict (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``, ...) are set aside, not refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsvc.integrations.common import ConnectionSettings, parse_settings

# Keys SGLang reads from the same extra config (storage/backend_factory.py,
# managers/cache_controller.py, pool_host/common.py): not ours to validate.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "allocator",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)


@dataclass(frozen=True)
class SglangStorageConfig(ConnectionSettings):
    """What ``KvsvcHiCacheStorage`` reads from the extra config (the connection keys
    are kvsvc.integrations.common.ConnectionSettings'); ``namespace`` is the tenant
    prefix, a fingerprint of the model and page geometry is appended to it."""

    namespace: str = "sglang"

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> SglangStorageConfig:
        ours = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        return parse_settings(cls, ours, "KVSVC_SGLANG_", "--hicache-storage-backend-extra-config")


def model_source(model_name: str | None) -> tuple[str, str | None, bool]:
    """``(path or hub name, revision, revision known)`` of the model SGLang runs: from
    SGLang's runtime context (what its own storage linkers read), else the storage
    config's ``model_name`` (SGLang's served name, possibly tagged with the host
    pool's page format: then only a name, and identity.py says so)."""
    try:
        from sglang.srt.runtime_context import get_model

        bag = get_model()
        return str(bag.model_path), getattr(bag, "revision", None), True
    except Exception:  # noqa: BLE001 - not published (a test, another SGLang): the name
        return str(model_name or ""), None, False
