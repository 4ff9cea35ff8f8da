"""A presence index across the server's death (issue 29, "Prove it"): after a kill -9
the index turns unknown (None) in bounded time, never answering from the dead
incarnation, then resyncs on the new one (its keys, not the old ones); a server that
hangs (SIGSTOP: the stream stays open, silent) turns it unknown too, within its
stale_after_s, and it answers again once the server does. Real `kvsvc serve`
processes; the sync and the asyncio clients."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

from support import ServerProcess

from kvsvc.client import AsyncKVCacheClient, KVCacheClient
from kvsvc.errors import ServiceUnavailable

KEYS = [f"key-{i}".encode() for i in range(32)]
#: Margin over an index's stale_after_s for it to turn unknown on a loaded host.
MARGIN_S = 3.0
#: Bound on a restarted process being reached and its snapshot applied.
RESYNC_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until_up(client: KVCacheClient) -> str:
    deadline = time.monotonic() + RESYNC_S
    while True:
        try:
            return client.server_info(timeout=5).server_start_id
        except ServiceUnavailable:
            assert time.monotonic() < deadline, "the restarted server was not reached"
            time.sleep(0.05)


def wait_for(what: str, cond, limit: float) -> float:
    """Seconds until ``cond()`` held (bounded by ``limit``)."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < limit, f"not {what} within {limit} s"
        time.sleep(0.002)
    return time.monotonic() - start


def test_kill_9_turns_the_index_unknown_then_it_resyncs_on_the_new_incarnation(
    shm_dir: Path,
) -> None:
    port = free_port()
    proc = ServerProcess(shm_dir, port=port)
    try:
        with KVCacheClient(proc.address) as c, c.presence("ns", stale_after_s=1.0) as index:
            c.put("ns", [(k, b"v" * 256) for k in KEYS[:16]], timeout=10)
            wait_for(
                "fresh with the keys",
                lambda: index.hits(KEYS) == [True] * 16 + [False] * 16,
                RESYNC_S,
            )
            old = index.cursor
            assert old is not None
            proc.proc.kill()
            proc.proc.wait(10)
            gone = wait_for("unknown", lambda: index.hits(KEYS) is None, 1.0 + MARGIN_S)
            assert not index.fresh and index.prefix_hits(KEYS) is None
            print(f"kill -9: the index answered None after {gone * 1e3:.1f} ms")
            time.sleep(0.5)
            assert index.hits(KEYS) is None  # still unknown while nothing serves
            proc.kill()
            proc = ServerProcess(shm_dir, port=port)
            new_id = until_up(c)
            assert new_id != old[0]
            took = wait_for("fresh again", lambda: index.fresh, RESYNC_S)
            print(f"resynced {took:.3f} s after the restarted server answered")
            assert index.cursor is not None and index.cursor[0] == new_id
            # The new incarnation holds nothing of the old one's.
            assert index.hits(KEYS) == [False] * 32 and index.prefix_hits(KEYS) == 0
            assert index.resyncs >= 2
            c.put("ns", [(k, b"w" * 256) for k in KEYS[8:12]], timeout=10)
            wait_for("the new keys", lambda: index.hits(KEYS[8:12]) == [True] * 4, RESYNC_S)
            assert index.prefix_hits(KEYS) == 0 and c.lookup(KEYS[8:12], namespace="ns") == 4
    finally:
        proc.kill()


def test_a_hung_server_turns_the_index_unknown_within_stale_after_s(shm_dir: Path) -> None:
    proc = ServerProcess(shm_dir)
    stopped = False
    try:
        with KVCacheClient(proc.address) as c, c.presence("ns", stale_after_s=0.5) as index:
            c.put("ns", [(k, b"v" * 256) for k in KEYS[:4]], timeout=10)
            wait_for("fresh", lambda: index.prefix_hits(KEYS) == 4, RESYNC_S)
            incarnation = index.cursor[0] if index.cursor else ""
            proc.signal(signal.SIGSTOP)  # the stream stays open; nothing answers
            stopped = True
            gone = wait_for("unknown", lambda: index.hits(KEYS) is None, 0.5 + MARGIN_S)
            print(f"hung server: the index answered None after {gone * 1e3:.1f} ms")
            proc.signal(signal.SIGCONT)
            stopped = False
            back = wait_for("fresh again", lambda: index.fresh, RESYNC_S)
            print(f"answering again {back * 1e3:.1f} ms after SIGCONT")
            assert index.cursor is not None and index.cursor[0] == incarnation
            assert index.prefix_hits(KEYS) == 4
    finally:
        if stopped:
            proc.signal(signal.SIGCONT)
        proc.kill()


def test_the_async_index_across_a_kill_9(shm_dir: Path) -> None:
    port = free_port()
    procs = [ServerProcess(shm_dir, port=port)]

    async def until(what: str, cond, limit: float) -> float:
        start = time.monotonic()
        while not cond():
            assert time.monotonic() - start < limit, f"not {what} within {limit} s"
            await asyncio.sleep(0.002)
        return time.monotonic() - start

    async def go() -> None:
        async with (
            AsyncKVCacheClient(procs[0].address) as c,
            c.presence("ns", stale_after_s=1.0) as index,
        ):
            await c.put("ns", [(k, b"v" * 256) for k in KEYS[:3]], timeout=10)
            await until("fresh", lambda: index.prefix_hits(KEYS) == 3, RESYNC_S)
            before = index.cursor
            procs[0].proc.kill()
            gone = await until("unknown", lambda: index.hits(KEYS) is None, 1.0 + MARGIN_S)
            print(f"async index: None after {gone * 1e3:.1f} ms")
            procs[0].kill()
            procs.append(await asyncio.to_thread(ServerProcess, shm_dir, port=port))
            await until("fresh again", lambda: index.fresh, RESYNC_S)
            assert index.cursor is not None and before is not None
            assert index.cursor[0] != before[0]
            assert index.prefix_hits(KEYS) == 0

    try:
        asyncio.run(go())
    finally:
        for p in procs:
            p.kill()
