"""kvsvc as an SGLang HiCache storage backend:
``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name": "kvsvc", "module_path": "kvsvc.integrations.sglang",
"class_name": "KvsvcHiCacheStorage", "interface_v1": 1, ...}'``. SGLang imports this
module by that path and takes the class by name; the class (and SGLang with it) is
imported on that first use, so the settings (``.config``) load without SGLang."""

from __future__ import annotations

from typing import Any

__all__ = ["KvsvcHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvsvcHiCacheStorage":
        from kvsvc.integrations.sglang.storage import KvsvcHiCacheStorage

        return KvsvcHiCacheStorage
    raise AttributeError(f"module 'kvsvc.integrations.sglang' has no attribute {name!r}")
