"""The client's shape: one table of calls that matches the proto, the sync and
asyncio clients exposing the same methods, and an import that pulls in no server
code (an engine process imports the client, not torch or the server)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from kvsvc.client import AsyncKVCacheClient, KVCacheClient, plans, session
from kvsvc.v1 import kv_cache_service_pb2 as pb

# What `import kvsvc.client` may load: the wire types, errors, limits, framing, ids
# and the client's own modules. A module added here must hold no server code.
CLIENT_MODULES = {
    "kvsvc.client.presence",
    "kvsvc.client.native",
    "kvsvc.client.native._presence",
    "kvsvc.client.native.table",
    "kvsvc",
    "kvsvc.client",
    "kvsvc.client.calls",
    "kvsvc.client.plans",
    "kvsvc.client.clients",
    "kvsvc.client.fdpass",
    "kvsvc.client.session",
    "kvsvc.client.tls",
    "kvsvc.framing",
    "kvsvc.ids",
    "kvsvc.limits",
    "kvsvc.pidfds",
    "kvsvc.v1",
    "kvsvc.v1.error_pb2",
    "kvsvc.v1.kv_cache_service_pb2",
}
# In the asyncio client these return an asyncio.Task or are plain reads.
NOT_COROUTINES = {
    "store_async",
    "retrieve_async",
    "leased_blocks",
    "unproven_transfers",
    "presence",  # returns the index at once; it follows the stream in the background
    "fd_server_watch",  # a pidfd and a poll(0) of the lease's socket: no wait
}


def public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(cls, name))
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name))
    }


def test_importing_the_client_loads_no_torch_and_no_server_module() -> None:
    code = (
        "import json, sys, kvsvc.client\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvsvc'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(json.loads(out.stdout))
    assert "torch" not in loaded
    # the error contract may be one module or a package of them
    extra = {m for m in loaded - CLIENT_MODULES if m.split(".")[:2] != ["kvsvc", "errors"]}
    assert extra == set(), sorted(extra)


def test_sync_and_async_clients_have_the_same_methods_and_signatures() -> None:
    sync, aio = public(KVCacheClient), public(AsyncKVCacheClient)
    assert sync.keys() == aio.keys()
    for name, sig in sync.items():
        assert aio[name].parameters == sig.parameters, name
        assert not inspect.iscoroutinefunction(getattr(KVCacheClient, name)), name
        expected = name not in NOT_COROUTINES
        assert inspect.iscoroutinefunction(getattr(AsyncKVCacheClient, name)) == expected, name
    # every operation of the table of calls is a method of both
    for name in ("map", "store", "retrieve_async", "register_memfd", "get"):
        assert name in sync


def test_the_table_of_calls_covers_the_service_with_its_own_types() -> None:
    methods = {call.method for call in plans.CALLS}
    # Session carries Lookup, Store, Retrieve and Fence (kvsvc.client.session), not a
    # call of its own.
    # WatchEvents is followed by the presence index (kvsvc.client.presence).
    assert methods == set(plans.SERVICE.methods_by_name) - {"Session", "WatchEvents"}
    assert set(session.FIELDS) <= methods
    for call in plans.CALLS:
        assert call.request is getattr(pb, f"{call.method}Request")
        assert call.response is getattr(pb, f"{call.method}Response")
        assert call.result is getattr(pb, f"{call.method}Result")
        assert call.path == f"/kvsvc.v1.KVCacheService/{call.method}"


def test_a_call_whose_result_type_is_not_the_protos_is_refused_at_import() -> None:
    with pytest.raises(TypeError, match=r"StoreResponse\.result is not"):
        plans.Call("Store", pb.RetrieveResult, plans.TRANSFER, plans.Lease.TRANSFER)
