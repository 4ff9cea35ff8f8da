"""The SGLang storage backend's settings: the keys of
``--hicache-storage-backend-extra-config`` (the same names as the vLLM
connector's), else ``KVSVC_SGLANG_<KEY>`` environment variables, else these
defaults. SGLang's own keys in the same dict (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``, ...) are set aside, not refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsvc.integrations.common import parse_settings

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
class SglangStorageConfig:
    """What ``KvsvcHiCacheStorage`` reads from the extra config."""

    target: str = "127.0.0.1:50051"
    # The tenant prefix; a fingerprint of the model and page geometry is appended.
    namespace: str = "sglang"
    # batch_exists / exists wait at most this long for a Lookup: then 0 hits.
    lookup_timeout_s: float = 0.05
    load_timeout_s: float = 10.0
    store_timeout_s: float = 10.0
    # Map, memfd passing, Fence.
    fence_timeout_s: float = 10.0
    # After a failure kvsvc counts as down (0 hits, writes refused) this long.
    reconnect_interval_s: float = 2.0
    log_level: str = "INFO"
    token_file: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    fd_socket: str = ""
    # batch_exists from the presence index (no RPC while it is fresh).
    presence: bool = True

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")

    @property
    def uses_tls(self) -> bool:
        return self.tls or any((self.tls_ca, self.tls_cert, self.tls_server_name))

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> SglangStorageConfig:
        ours = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        return parse_settings(cls, ours, "KVSVC_SGLANG_", "--hicache-storage-backend-extra-config")
