"""kvsvc as an L2 adapter of LMCache's multiprocess server, loaded by LMCache's
``plugin`` adapter type: ``python -m lmcache.v1.multiprocess.server ... --l2-adapter
'{"type": "plugin", "module_path": "kvsvc.integrations.lmcache", "class_name":
"KvsvcL2Adapter", "adapter_params": {"target": "127.0.0.1:50051", ...}}'``
(docs/lmcache.md). LMCache imports this module by that path and takes the class by
name; the class (and LMCache with it) is imported on that first use, so the
settings (``.config``) and keys (``.keys``) load without LMCache."""

from __future__ import annotations

from typing import Any

__all__ = ["KvsvcL2Adapter"]


def __getattr__(name: str) -> Any:
    if name == "KvsvcL2Adapter":
        from kvsvc.integrations.lmcache.adapter import KvsvcL2Adapter

        return KvsvcL2Adapter
    raise AttributeError(f"module 'kvsvc.integrations.lmcache' has no attribute {name!r}")
