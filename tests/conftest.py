"""Fixtures: real servers on real sockets, in a background thread (in-process,
for white-box checks) or as a `kvsvc serve` subprocess (black-box, failpoints).
The helpers behind them are in support.py, which tests import by name."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import (
    ServerProcess,
    ServerThread,
)

from kvsvc.client import KVCacheClient
from kvsvc.server.config import ServerConfig


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


@pytest.fixture
def config(shm_dir: Path) -> ServerConfig:
    return ServerConfig.from_settings(
        listen="127.0.0.1:0", store_bytes=64 << 20, shm_dir=str(shm_dir)
    )


@pytest.fixture
def server(config: ServerConfig) -> Iterator[ServerThread]:
    st = ServerThread(config)
    yield st
    st.stop()


@pytest.fixture
def make_server(config: ServerConfig) -> Iterator:
    started: list[ServerThread] = []

    def make(**changes: object) -> ServerThread:
        st = ServerThread(config.replace(**changes))
        started.append(st)
        return st

    yield make
    for st in started:
        st.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[KVCacheClient]:
    with KVCacheClient(server.address) as c:
        yield c


@pytest.fixture
def spawn(shm_dir: Path) -> Iterator:
    procs: list[ServerProcess] = []

    def start(
        *args: str, env: dict[str, str] | None = None, port: int = 0, host: str = "127.0.0.1"
    ) -> ServerProcess:
        p = ServerProcess(shm_dir, *args, env=env, port=port, host=host)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.signal(signal.SIGKILL)
        p.kill()
