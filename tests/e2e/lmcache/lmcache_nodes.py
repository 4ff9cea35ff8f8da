"""LMCache "nodes": each a real LMCache 0.5.6 multiprocess server (``python -m
lmcache.v1.multiprocess.server``, the command docs/lmcache.md gives) with the kvsvc
adapter on its command line, and an engine worker beside it that uses LMCache's own
MP client (``RequestClientFactory``) and its own CPU worker transfer path
(``create_transfer_context``: engine-driven, what a CPU vLLM worker uses), over a
CPU KV cache in vLLM's CPU layout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.transfer_context.worker_transfer import create_transfer_context
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

MODEL = "tiny/model"
LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 2, 128, 2, 16, 16
ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(port: int, spec: str, extra: tuple[str, ...] = ()) -> list[str]:
    """``extra``: more of the server's flags (``--shm-name NAME``: its L1 arena in a
    shared file, which the adapter copies in place)."""
    return [
        sys.executable, "-m", "lmcache.v1.multiprocess.server",
        "--host", "127.0.0.1", "--port", str(port),
        "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "engine_driven",
        "--disable-metrics", "--l2-adapter", spec, *extra,
    ]  # fmt: skip


class Node:
    """One LMCache server process and its engine worker (started by ``start``)."""

    def __init__(self, name: str, spec: str, logs: Path, extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = logs / f"lmcache-{name}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            server_command(self.port, spec, extra),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
        )
        self.kv = {
            f"model.layers.{i}.attn": torch.zeros(
                2, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, dtype=torch.float16
            )
            for i in range(LAYERS)
        }
        self.client: Any = None
        self.ctx: Any = None
        self.chunk = 0

    def start(self, timeout_s: float = 240) -> None:
        """Wait until the server answers (its imports take tens of seconds on a busy
        2-core machine), then register the worker's KV cache."""
        self.client = RequestClientFactory.create(f"tcp://127.0.0.1:{self.port}")
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"LMCache {self.name} exited: {self.output()}"
            try:
                self.chunk = int(self.client.get_chunk_size().result(timeout=2))
                break
            except Exception:  # noqa: BLE001 - not listening yet
                assert time.monotonic() < deadline, f"LMCache {self.name}: {self.output()}"
                time.sleep(0.3)
        self.ctx = create_transfer_context(
            self.kv, instance_id=os.getpid() * 10 + len(self.name), req_client=self.client
        )
        self.ctx.register(self.kv, MODEL, 1, self.blocks_per_chunk, 60.0)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk // BLOCK_SIZE

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def key(self, tokens: list[int], request_id: str, salt: str = "") -> Any:
        return IPCCacheServerKey(
            model_name=MODEL,
            world_size=1,
            worker_id=0,
            token_ids=tuple(tokens),
            start=0,
            end=len(tokens),
            request_id=request_id,
            cache_salt=salt,
            num_kv_readers=1,
        )

    def store(self, tokens: list[int], blocks: list[int], request_id: str, salt: str = "") -> bool:
        key = self.key(tokens, request_id, salt)
        f = self.ctx.submit_store(request_id, key, self.kv, [blocks], None, self.blocks_per_chunk)
        return bool(f.result(timeout=60))

    def prefetch(
        self, tokens: list[int], request_id: str, salt: str = "", timeout_s: float = 60
    ) -> int:
        """LMCache's lookup (it prefetches from L2 into L1): the chunks it found."""
        key = self.key(tokens, request_id, salt)
        self.client.lookup(key, 1).result(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while (
            status := self.client.query_prefetch_status(request_id).result(timeout=timeout_s)
        ) is None:
            assert time.monotonic() < deadline, f"prefetch {request_id} never ended"
            time.sleep(0.05)
        return int(status)

    def retrieve(
        self, tokens: list[int], blocks: list[int], request_id: str, salt: str = ""
    ) -> bool:
        key = self.key(tokens, request_id, salt)
        f = self.ctx.submit_retrieve(
            request_id, key, self.kv, [blocks], None, self.blocks_per_chunk
        )
        return bool(f.result(timeout=60))

    def blocks_bytes(self, blocks: list[int]) -> list[torch.Tensor]:
        return [t[:, blocks].clone() for t in self.kv.values()]

    def fill(self, blocks: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in self.kv.values():
            t[:, blocks] = torch.randn(t[:, blocks].shape, generator=g).half()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
