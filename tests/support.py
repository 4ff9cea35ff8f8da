"""What tests of every layer share: real servers on real sockets, in a background
thread (in-process, for white-box checks) or as a `kvsvc serve` subprocess
(black-box, failpoints), and the checks they make of them. Imported by name
(`from support import ...`; pytest puts tests/ on the path); the fixtures that
build on these are in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsvc.client import KVCacheClient
from kvsvc.client.kvcache import SharedKVCache
from kvsvc.server.config import ServerConfig
from kvsvc.server.data.store import ChunkStore
from kvsvc.server.ops.lifecycle import Server

REPO = Path(__file__).resolve().parent.parent


class ServerThread:
    """An in-process server on its own event loop thread, so sync clients can call it."""

    def __init__(self, config: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: Server = self.run(self._make(config))
        self.address = self.server.address

    async def _make(self, config: ServerConfig) -> Server:
        server = Server(config)
        await server.start()
        return server

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class ServerProcess:
    """`kvsvc serve` as a subprocess: the command users run."""

    def __init__(
        self,
        shm_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
    ) -> None:
        self.log_path = shm_dir.parent / f"server-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w+")  # noqa: SIM115
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvsvc",
                "serve",
                "--listen",
                f"{host}:{port}",
                "--shm-dir",
                str(shm_dir),
                "--store-bytes",
                "64M",
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(rf"serving on {re.escape(host)}:(\d+)", self.output())
            if m:  # a wildcard host is reached on loopback
                self.address = f"127.0.0.1:{m.group(1)}"
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsvc serve exited: {self.output()}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"kvsvc serve did not start: {self.output()}")

    def output(self) -> str:
        return self.log_path.read_text()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def health_status(
    address: str, service: str = "", timeout: float = 5, token: str | None = None
) -> int:
    """One health Check (with ``token`` where the server requires one)."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        request = health_pb2.HealthCheckRequest(service=service)
        return stub.Check(request, timeout=timeout, metadata=metadata).status


SERVING = health_pb2.HealthCheckResponse.SERVING


NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


LAYOUTS: dict[str, dict] = {
    # vLLM: per layer [2, num_blocks, block_size, kv_heads, head_dim]
    "vllm": dict(layer_shape=None, block_dim=1),
    # FlashInfer / SGLang style: [num_blocks, 2, block_size, kv_heads, head_dim]
    "blocks_first": dict(layer_shape=(12, 2, 4, 2, 16), block_dim=0),
    # blocks in the middle of a [kv_heads, num_blocks, block_size, head_dim] layout
    "blocks_middle": dict(layer_shape=(2, 12, 4, 16), block_dim=1),
}


def make_cache(
    shm_dir: Path,
    name: str,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "vllm",
    layers: int = 3,
    seed: int | None = None,
    memfd: bool = False,
) -> SharedKVCache:
    """A small shm KV cache (a file in `shm_dir`, or a sealed memfd): `layers` x 12
    blocks of 4 tokens x 2 heads x 16 dims; random contents when `seed` is given."""
    cache = SharedKVCache(
        name,
        num_layers=layers,
        num_blocks=12,
        block_size=4,
        kv_heads=2,
        head_dim=16,
        dtype=dtype,
        shm_dir=str(shm_dir),
        memfd=memfd,
        **LAYOUTS[layout],
    )
    if seed is not None:
        fill_random(cache, seed)
    return cache


def fill_random(cache: SharedKVCache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))


def wait_inflight(address: str, n: int, limit: float = 30) -> None:
    """Poll until the server runs at least ``n`` copies: a sleep in its place is a
    race a loaded CI host loses."""
    end = time.monotonic() + limit
    with KVCacheClient(address) as c:
        while c.server_info(timeout=5).inflight_transfers < n:
            assert time.monotonic() < end, f"fewer than {n} copies in flight after {limit} s"
            time.sleep(0.02)


def wait_health(
    address: str,
    status: int,
    limit: float = 30,
    token: str | None = None,
    service: str = "kvsvc.v1.KVCacheService",
) -> None:
    """Poll the health service until it reports ``status`` (bounded): readiness, the
    service's name, by default (a held part, such as the disk's index, keeps only
    that NOT_SERVING; "" is liveness)."""
    end = time.monotonic() + limit
    while health_status(address, service, token=token) != status:
        assert time.monotonic() < end, f"health not {status} after {limit} s"
        time.sleep(0.02)


@contextlib.contextmanager
def truncating(cache: SharedKVCache) -> Iterator[None]:
    """While the block runs, the owner keeps truncating its region file to one page
    and giving it its size back (a client that shrinks memory under a copy)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            os.truncate(cache.path, 4096)
            time.sleep(0.002)
            os.truncate(cache.path, cache.size)

    t = threading.Thread(target=loop)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def flip(store: ChunkStore, namespace: str, key: bytes, rng: random.Random) -> int:
    """Flip one bit at a random place of the stored chunk; returns the offset."""
    (chunk,) = [c for k, c in list(store._chunks.items()) if k[:2] == (namespace, key)]
    at = rng.randrange(chunk.size)
    store.view[chunk.offset + at] ^= 1 << rng.randrange(8)
    return at


def write_model_dir(path: Path, weights: bytes) -> str:
    """A model directory as a plug-in's weights identity reads it (a config and one
    weight file; kvsvc.integrations.identity): written again, other weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    return str(path)


#: docs/metrics.md: the metrics reference
METRICS_DOC = REPO / "docs" / "metrics.md"


def documented_metrics() -> dict[str, str]:
    """docs/metrics.md's reference tables: series name -> type."""
    row = re.compile(r"^\| `([a-z0-9_]+)` \| (counter|gauge|histogram) \|", re.M)
    return dict(row.findall(METRICS_DOC.read_text()))


class EngineVenv:
    """An engine's tests (tests/e2e/<engine>/) need the real engine, in a venv of its
    own that ``make <engine>`` makes: it runs them with ``env``=1, under which an
    engine that does not import, or any skipped test, is a failure (a broken venv
    must not pass as skips). The main venv's pytest skips them. A conftest binds
    the hooks: ``pytest_runtest_makereport = venv.runtest_makereport`` and
    ``pytest_collectreport = venv.collectreport``."""

    def __init__(self, env: str, engine: str, module: str = "", target: str = "") -> None:
        self.env = env
        self.required = os.environ.get(env) == "1"
        # Not just find_spec(module): the engine's test folder is itself a namespace
        # package of that name. Without a module, only the skips are checked.
        spec = importlib.util.find_spec(module) if module else None
        self.present = spec is not None and spec.origin is not None
        if module and self.required and not self.present:
            raise RuntimeError(
                f"{env}=1 but {engine} is not importable: run `make {target}` "
                f"(it makes .venv-{target})"
            )

    @pytest.hookimpl(hookwrapper=True)
    def runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
        """Under ``env``=1 a skipped test is a failed one."""
        outcome = yield
        report = outcome.get_result()
        if self.required and report.skipped:
            report.outcome = "failed"
            report.longrepr = f"skipped under {self.env}=1: {report.longrepr}"

    def collectreport(self, report: pytest.CollectReport) -> None:
        """A module skipped at collection (no engine) fails too under ``env``=1."""
        if self.required and report.skipped:
            report.outcome = "failed"
