"""kvsvc as a vLLM KV connector: ``kv_connector_module_path: "kvsvc.integrations.vllm"``
with ``kv_connector: "KvsvcConnector"``. vLLM imports this module by that path and
takes the class by name; the class (and vLLM with it) is imported on that first
use, so the connector's settings (``.config``) load without vLLM installed."""

from __future__ import annotations

from typing import Any

__all__ = ["KvsvcConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvsvcConnector":
        from kvsvc.integrations.vllm.connector import KvsvcConnector

        return KvsvcConnector
    raise AttributeError(f"module 'kvsvc.integrations.vllm' has no attribute {name!r}")
