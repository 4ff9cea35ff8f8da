"""A failed call leaves no reference cycle behind: the typed error a caller drops
is freed at once by reference counting. A cycle per failure (an error held by a
frame of its own traceback) leaves each failed call's frames to the cyclic
collector, whose full passes over an engine process with torch loaded take
milliseconds: the error path's tail grew to several times success's."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest
from support import ServerThread

from kvsvc.client import AsyncKVCacheClient, KVCacheClient
from kvsvc.errors import InvalidRequest, Miss


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _freed(ref: weakref.ref) -> bool:
    return ref() is None


@pytest.mark.parametrize("session", [False, True], ids=["unary", "session"])
def test_a_sync_clients_typed_error_is_freed_without_the_collector(
    server: ServerThread, session: bool, no_collector: None
) -> None:
    with KVCacheClient(server.address, session=session) as c:
        for call in (
            lambda: c.lookup([b"k", b""], namespace="ns"),  # rejected by the server
            lambda: c.get("ns", b"absent"),  # re-mapped by the client (a Miss)
        ):
            ref = None
            try:
                call()
            except (InvalidRequest, Miss) as exc:
                ref = weakref.ref(exc)
            assert ref is not None, "the call did not fail"
            assert _freed(ref), gc.get_referrers(ref())


@pytest.mark.parametrize("session", [False, True], ids=["unary", "session"])
def test_an_async_clients_typed_error_is_freed_without_the_collector(
    server: ServerThread, session: bool, no_collector: None
) -> None:
    async def go() -> list[weakref.ref]:
        refs = []
        async with AsyncKVCacheClient(server.address, session=session) as c:
            for _ in range(3):
                try:
                    await c.lookup([b"k", b""], namespace="ns")
                except InvalidRequest as exc:
                    refs.append(weakref.ref(exc))
        return refs

    refs = asyncio.run(go())
    assert len(refs) == 3
    assert all(_freed(r) for r in refs)
