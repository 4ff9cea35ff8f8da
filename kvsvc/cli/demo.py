"""`kvsvc demo`: what an engine does with kvsvc, end to end, in a few seconds.

Maps a synthetic KV cache (vLLM layout, shared memory), stores chunks, looks
them up, retrieves them into fresh blocks, checks them bit-exact, then shows
one of each error a user catches. Exits non-zero if anything is off.

With ``--memfd`` the caches are sealed memfds passed over the server's fd
socket: what an engine in another container does, sharing only the socket
directory with the server (no /dev/shm, no IPC namespace)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.errors import (
    DeadlineExceeded,
    InvalidRequest,
    KVServiceError,
    Miss,
    ServiceUnavailable,
    Unauthenticated,
)
from kvsvc.server.config import ConfigError, ServerConfig, check_shm_dir


@contextmanager
def embedded_server(shm_dir: str) -> Iterator[str]:
    """A server on 127.0.0.1 in a background thread, for a demo with no --target."""
    from kvsvc.server.ops.lifecycle import Server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = ServerConfig.from_settings(
        listen="127.0.0.1:0", store_bytes=256 << 20, shm_dir=shm_dir
    )

    async def start() -> Server:
        server = Server(config)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield server.address
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def run_demo(
    target: str | None,
    shm_dir: str,
    *,
    memfd: bool = False,
    fd_socket: str | None = None,
    token: str | None = None,
) -> int:
    """The demo's exit status. What keeps it from running (no server at --target,
    one that stopped serving, an unusable shm dir) is one line that says what to do,
    never a traceback."""
    try:
        if not memfd or target is None:
            check_shm_dir(shm_dir, "--shm-dir")
        if target is None:
            with embedded_server(shm_dir) as address:
                return _demo(address, shm_dir, memfd, fd_socket, None)
        return _demo(target, shm_dir, memfd, fd_socket, token)
    except (ConfigError, _Stop) as exc:
        print(f"kvsvc demo: {exc}", file=sys.stderr)
        return 1


class _Stop(Exception):
    """Ends the demo with one line on stderr."""


def _demo(target: str, shm_dir: str, memfd: bool, fd_socket: str | None, token: str | None) -> int:
    with KVCacheClient(target, fd_socket=fd_socket, token=token) as client:
        try:
            info = client.server_info()
        except Unauthenticated:
            raise _Stop(
                f"the server at {target} refused the demo's credentials: give it the token "
                "of a tenant in its --auth-token-file with --token-file (or KVSVC_TOKEN_FILE)"
            ) from None
        except (ServiceUnavailable, DeadlineExceeded) as exc:
            raise _Stop(
                f"no kvsvc server answers at {target} ({exc.message}). Start one first "
                "(`make serve`, or `.venv/bin/kvsvc serve`) and wait for its 'serving on' "
                "line, or leave out --target and the demo starts its own"
            ) from None
        if not info.serving:
            raise _Stop(
                f"the server at {target} is not serving "
                f"({info.failure_reason or 'shutting down'}): restart it and run the demo again"
            )
        print(
            f"kvsvc {info.version} at {target}: start id {info.server_start_id[:12]}, "
            f"store {info.used_bytes >> 20}/{info.capacity_bytes >> 20} MiB, "
            f"serving={info.serving}"
        )
        try:
            return _steps(client, shm_dir, memfd)
        except KVServiceError as exc:
            raise _Stop(
                f"{type(exc).__name__} from the server at {target}: {exc}. "
                "Check the server's log for this request id"
            ) from None


def _steps(client: KVCacheClient, shm_dir: str, memfd: bool) -> int:
    rows: list[tuple[str, str, float]] = []
    ok = True

    def step(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        rows.append((name, out if isinstance(out, str) else "ok", time.perf_counter() - t0))
        return out

    def expect(name: str, cls: type[KVServiceError], fn: Callable[[], Any]) -> None:
        nonlocal ok
        t0 = time.perf_counter()
        try:
            fn()
        except cls as exc:
            rows.append((name, f"{type(exc).__name__} [{exc.reason}]", time.perf_counter() - t0))
            return
        ok = False
        rows.append((name, f"UNEXPECTED: no {cls.__name__}", time.perf_counter() - t0))

    tag = f"kvsvc-demo-{os.getpid()}"
    dims = dict(num_layers=4, num_blocks=32, block_size=16, kv_heads=8, head_dim=128)
    where = "a sealed memfd" if memfd else shm_dir
    try:
        src = SharedKVCache(f"{tag}-src", shm_dir=shm_dir, memfd=memfd, **dims)  # type: ignore[arg-type]
    except OSError as exc:
        raise _Stop(f"cannot create the demo's KV cache in {where}: {exc}") from None
    try:
        dst = SharedKVCache(f"{tag}-dst", shm_dir=shm_dir, memfd=memfd, **dims)  # type: ignore[arg-type]
    except OSError as exc:
        src.close()
        raise _Stop(f"cannot create the demo's KV cache in {where}: {exc}") from None

    def region(cache: SharedKVCache) -> Any:
        token = client.register_memfd(cache.fd) if memfd else ""
        return cache.rank_region(token=token)

    try:
        for layer in src.layers:
            layer.copy_(torch.randn(layer.shape).to(layer.dtype))
        kind = "memfd" if memfd else "shm file"
        m_src = step(f"map source cache ({kind})", lambda: client.map("demo", [region(src)]))
        m_dst = step(f"map target cache ({kind})", lambda: client.map("demo", [region(dst)]))
        chunks = [(f"{tag}-chunk{i}".encode(), list(range(4 * i, 4 * i + 4))) for i in range(4)]
        r = step("store 4 chunks x 4 blocks", lambda: client.store(m_src, chunks))
        rows[-1] = (
            rows[-1][0],
            f"{r.stored_chunks} stored, {r.stored_bytes >> 10} KiB",
            rows[-1][2],
        )
        keys = [k for k, _ in chunks]
        hits = step("lookup", lambda: f"{client.lookup(m_src, keys)} of 4 present")
        ok &= hits.startswith("4 ")
        targets = [(k, [31 - b for b in ids]) for k, ids in chunks]
        got = step("retrieve into other blocks", lambda: client.retrieve(m_dst, targets))
        rows[-1] = (rows[-1][0], f"{got.loaded_chunks} loaded", rows[-1][2])
        exact = all(
            torch.equal(
                a.index_select(1, torch.tensor(s_ids)).view(torch.uint8),
                b.index_select(1, torch.tensor(d_ids)).view(torch.uint8),
            )
            for a, b in zip(src.layers, dst.layers, strict=True)
            for (_, s_ids), (_, d_ids) in zip(chunks, targets, strict=True)
        )
        rows.append(("verify bit-exact", "identical" if exact else "MISMATCH", 0.0))
        ok &= exact and got.loaded_chunks == 4
        expect(
            "bad input (block 99)",
            InvalidRequest,
            lambda: client.store(m_src, [(b"bad", [99])]),
        )
        expect("miss", Miss, lambda: client.get("demo", b"never-stored"))
        ghost = src.rank_region(token="unused")  # a file that never appears in its shm dir
        for t in ghost.tensors:
            t.handle.shared_memory.name = f"{tag}-never-created"
            t.handle.shared_memory.size_bytes = src.size
        expect(
            "deadline (region never appears)",
            DeadlineExceeded,
            lambda: client.map("demo", [ghost], timeout=0.2),
        )
        ok &= not client.leased_blocks(m_src) and not client.leased_blocks(m_dst)
        step("unmap both", lambda: (client.unmap(m_src), client.unmap(m_dst)) and "ok")
    finally:
        src.close()
        dst.close()
    width = max(len(r[0]) for r in rows)
    print(f"\n{'step':<{width}}  {'result':<40} ms")
    for name, result, seconds in rows:
        print(f"{name:<{width}}  {result:<40} {seconds * 1e3:.1f}")
    print("\ndemo:", "OK" if ok else "FAILED")
    return 0 if ok else 1
