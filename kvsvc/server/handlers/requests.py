"""What handlers check in a request's body, one place for each rule: keys,
namespaces (granted to the caller), oneofs this server knows, and the error a
tenant over its quota gets. The header is the wrapper's (kvsvc.server.rpc.wrapper)."""

from __future__ import annotations

from typing import Any

from kvsvc.errors import CapacityExhausted, InvalidRequest, UnsupportedRequest
from kvsvc.limits import MAX_KEY_BYTES, MAX_NAMESPACE_BYTES
from kvsvc.server.rpc.wrapper import Call
from kvsvc.server.security.auth import Tenant


def check_keys(keys: list[bytes]) -> None:
    for i, key in enumerate(keys):
        if not key:
            raise InvalidRequest(f"key {i} is empty", metadata={"keyIndex": i})
        if len(key) > MAX_KEY_BYTES:
            raise InvalidRequest(
                f"key {i} is {len(key)} bytes, more than the {MAX_KEY_BYTES} allowed",
                reason="KEY_TOO_LONG",
                metadata={"keyIndex": i, "keyBytes": len(key), "maxKeyBytes": MAX_KEY_BYTES},
            )


def check_namespace(namespace: str, call: Call) -> str:
    """The store's name for the caller's ``namespace``, if valid and granted to it."""
    if not namespace:
        raise InvalidRequest("namespace is required", metadata={"field": "namespace"})
    size = len(namespace.encode())
    if size > MAX_NAMESPACE_BYTES:
        raise InvalidRequest(
            f"namespace is {size} bytes, more than the {MAX_NAMESPACE_BYTES} allowed",
            reason="NAMESPACE_TOO_LONG",
            metadata={"namespaceBytes": size, "maxNamespaceBytes": MAX_NAMESPACE_BYTES},
        )
    call.tenant.check_namespace(namespace)
    return call.tenant.scoped(namespace)


def oneof(request: Any, group: str) -> str:
    """The set field of ``request``'s oneof ``group``; unset (or a kind newer than
    this server) is UnsupportedRequest."""
    which = request.WhichOneof(group)
    if which is None:
        raise UnsupportedRequest(
            f"{type(request).__name__}.{group} is not set (or is a kind this server does not know)",
            metadata={"field": group},
        )
    return str(which)


def quota_exceeded(tenant: Tenant, quota: str, used: int, limit: int) -> CapacityExhausted:
    return CapacityExhausted(
        f"tenant {tenant.name} is at its {quota} quota ({used} of {limit})",
        reason="TENANT_QUOTA_EXCEEDED",
        metadata={"quota": quota, "used": used, "limit": limit},
        retryable=quota == "max_inflight",
    )
