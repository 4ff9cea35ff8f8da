"""A failed call leaves no reference cycle behind: the typed error a caller drops
is freed at once by reference counting. A cycle per failure (an error held by a
frame of its own traceback) leaves each failed call's frames to the cyclic
collector, whose full passes over an engine process with torch loaded take
milliseconds: the error path's tail grew to several times success's."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ServerThread, make_cache

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


@pytest.mark.parametrize("session", [False, True], ids=["unary", "session"])
def test_a_failed_transfer_futures_error_is_freed_without_the_collector(
    server: ServerThread, shm_dir: Path, session: bool, no_collector: None
) -> None:
    """store_async/retrieve_async: the future completes on a callback; neither its
    frames nor the future keep the typed error in a cycle once the caller drops it."""
    cache = make_cache(shm_dir, "cyc")
    with KVCacheClient(server.address, session=session) as c:
        m = c.map("ns", [cache.rank_region()])
        refs = []
        for fut in (
            c.store_async(m, [(b"k", [10_000])]),  # a block id out of range: refused
            c.retrieve_async(m, [(b"k", [10_000])]),
        ):
            exc = fut.exception(30)
            assert isinstance(exc, InvalidRequest), exc
            with pytest.raises(InvalidRequest):  # result() still raises it, typed
                fut.result()
            refs.append(weakref.ref(exc))
            del exc, fut
        # The thread that completed a future may still be returning (its frame
        # holds the error until then): a cycle never ends, so wait for the end.
        end = time.monotonic() + 10
        while not all(_freed(r) for r in refs) and time.monotonic() < end:
            time.sleep(0.05)
        assert all(_freed(r) for r in refs), [gc.get_referrers(r()) for r in refs if r()]
