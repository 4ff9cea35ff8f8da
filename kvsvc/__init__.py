"""kvsvc: a gRPC service that moves LLM KV-cache blocks between inference-engine
workers and a cache server, and never lets a failure look like silence.

This top level holds what both sides share (the error contract, framing, ids,
layout, logs, limits, the generated ``v1``); ``kvsvc.client`` and
``kvsvc.server`` never import each other. ``from kvsvc import Client`` (and the
error classes) resolve lazily, so importing the server does not load the client."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

#: Public names -> the module that defines them, imported on first use.
_LAZY = {
    "Client": ("kvsvc.client", "KVCacheClient"),
    "AsyncClient": ("kvsvc.client", "AsyncKVCacheClient"),
    "KVCacheClient": ("kvsvc.client", "KVCacheClient"),
    "AsyncKVCacheClient": ("kvsvc.client", "AsyncKVCacheClient"),
    "ClientTLS": ("kvsvc.client", "ClientTLS"),
    "SharedKVCache": ("kvsvc.client", "SharedKVCache"),
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    errors = importlib.import_module("kvsvc.errors")
    value = getattr(errors, name, None)
    if isinstance(value, type) and issubclass(value, BaseException):
        return value
    raise AttributeError(f"module 'kvsvc' has no attribute {name!r}")
