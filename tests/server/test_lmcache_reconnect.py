"""The LMCache adapter's reconnect probe (kvsvc/integrations/lmcache/reconnect.py),
engine-free, against a real `kvsvc serve` killed and restarted on its port: lookups
make no call while kvsvc is unproven, even past its down time; the probe brings them
back; a failure path that raises does not end the probing; a failure after kvsvc
was proven starts probing again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from redis_servers import free_port
from support import ServerProcess

from kvsvc.integrations.common import Link
from kvsvc.integrations.lmcache.config import LmcacheAdapterConfig
from kvsvc.integrations.lmcache.reconnect import Reconnect

INTERVAL_S = 0.2


class Failures:
    """The adapter's failure path as the probe sees it: mark kvsvc down; the first
    ``raises`` calls raise after that, as a broken path would."""

    def __init__(self, link: Link, raises: int = 0) -> None:
        self.link = link
        self.raises = raises
        self.calls = 0
        self.reconnect: Reconnect | None = None
        self.lock = threading.Lock()

    def __call__(self, exc: BaseException) -> None:
        with self.lock:
            self.calls += 1
            raise_now = self.calls <= self.raises
        self.link.failed()
        assert self.reconnect is not None
        self.reconnect.failed()
        if raise_now:
            raise RuntimeError("a failure path that raises")


def make(target: str, raises: int = 0) -> tuple[Reconnect, Failures]:
    cfg = LmcacheAdapterConfig(target=target, reconnect_interval_s=INTERVAL_S)
    link = Link(cfg, 2.0)
    failures = Failures(link, raises)
    failures.reconnect = Reconnect(link, failures, 2.0)
    return failures.reconnect, failures


def wait_for_client(r: Reconnect, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while r.client() is None:
        assert time.monotonic() < deadline, f"never proven back: {r.probes} probes"
        time.sleep(0.05)


def test_lookups_wait_for_the_probe_and_come_back(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "shm").mkdir()
    srv = ServerProcess(tmp_path / "shm", port=port)
    r, failures = make(srv.address, raises=2)
    try:
        client = r.client()
        assert client is not None
        client.server_info(timeout=5)

        srv.kill()
        r.link.failed()
        r.failed()
        assert r.unproven and r.client() is None
        # Past the down time, while kvsvc is still gone: lookups still get nothing
        # and the probe (its failure path raising twice) keeps asking.
        deadline = time.monotonic() + 60
        while failures.calls < 4:
            assert r.client() is None
            assert time.monotonic() < deadline, f"the probe stopped: {failures.calls} failures"
            time.sleep(INTERVAL_S / 4)
        assert r.unproven

        srv = ServerProcess(tmp_path / "shm", port=port)
        wait_for_client(r)
        assert not r.unproven
        client = r.client()
        assert client is not None
        client.server_info(timeout=5)

        # Proven, the probe thread ended: a new failure starts it again.
        probes = r.probes
        srv.kill()
        r.link.failed()
        r.failed()
        srv = ServerProcess(tmp_path / "shm", port=port)
        wait_for_client(r)
        assert r.probes > probes
    finally:
        r.close()
        r.link.close()
        srv.kill()


def test_close_stops_the_probe(tmp_path: Path) -> None:
    r, failures = make(f"127.0.0.1:{free_port()}")  # nothing listens there
    r.failed()
    deadline = time.monotonic() + 30
    while failures.calls < 1:
        assert time.monotonic() < deadline, "no probe"
        time.sleep(0.05)
    r.close()
    while r.probing:  # a probe in flight ends by its deadline
        assert time.monotonic() < deadline, "the probe thread outlived close"
        time.sleep(0.05)
    calls = failures.calls
    time.sleep(INTERVAL_S * 5)
    assert failures.calls == calls and not r.probing
    assert r.client() is None
    r.link.close()
