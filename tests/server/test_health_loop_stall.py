"""Issue 40: an event loop that hangs for good is reported on the --health-listen
port (Check and Watch) as NOT_SERVING, by the watchdog thread, without the loop.
The main port's health is answered on the loop, so there a hung loop is a Check
that times out; the health port must answer."""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import NOT_SERVING, SERVING, ServerProcess, health_status

from kvsvc.client import KVCacheClient
from kvsvc.server.ops.health import SERVICE_NAME

pytestmark = pytest.mark.slow  # starts servers as subprocesses

FP = "KVSVC_FAILPOINTS"
#: The loop's stall threshold in these tests (--stall-timeout): small, so they are
#: quick, but far above a busy host's scheduling hiccups before the hang.
STALL_S = 1.0
#: Generous bound on anything expected to happen "soon" on a loaded 2-core host.
SOON_S = 30.0


def health_address(srv: ServerProcess) -> str:
    """The health listener's address, from the start-up log (bounded wait)."""
    end = time.monotonic() + SOON_S
    while True:
        m = re.search(r"health-only plaintext listener on 127\.0\.0\.1:(\d+)", srv.output())
        if m:
            return f"127.0.0.1:{m.group(1)}"
        assert time.monotonic() < end, srv.output()
        time.sleep(0.05)


def watch(channel: grpc.Channel, service: str, into: queue.Queue[object]) -> threading.Thread:
    """A Watch stream read by a thread; each status (then the end: None, or the
    RpcError that ended it) goes to ``into``."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=service), timeout=120
    )

    def read() -> None:
        try:
            for msg in stream:
                into.put(msg.status)
            into.put(None)
        except grpc.RpcError as exc:
            into.put(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def next_status(seen: queue.Queue[object], timeout: float) -> object:
    return seen.get(timeout=timeout)


def wait_for(seen: queue.Queue[object], want: object, timeout: float) -> list[object]:
    """Statuses from ``seen`` up to and including ``want`` (bounded)."""
    got: list[object] = []
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        assert left > 0, f"no {want} within {timeout} s; saw {got}"
        try:
            item = seen.get(timeout=left)
        except queue.Empty:
            continue
        got.append(item)
        if item == want:
            return got
        assert item in (SERVING, NOT_SERVING), got  # the stream must not end first


@pytest.fixture
def hung_server(spawn) -> Iterator[tuple[ServerProcess, str]]:
    srv = spawn(
        "--health-listen",
        "127.0.0.1:0",
        "--stall-timeout",
        str(STALL_S),
        env={FP: "loop.stall=Lookup@hang"},
    )
    yield srv, health_address(srv)
    srv.kill()  # the loop is hung: SIGTERM could not stop it


def test_a_hung_event_loop_is_not_serving_on_the_health_port(hung_server) -> None:
    srv, probe = hung_server
    for name in ("", SERVICE_NAME):
        assert health_status(probe, name, timeout=10) == SERVING
    seen: dict[str, queue.Queue[object]] = {name: queue.Queue() for name in ("", SERVICE_NAME)}
    with grpc.insecure_channel(probe) as ch:
        for name, q in seen.items():
            watch(ch, name, q)  # daemon readers: the server's kill ends them
        for q in seen.values():
            assert next_status(q, SOON_S) == SERVING
        # A Lookup blocks the event loop for good (its deadline cannot help: the
        # loop that would answer it is the one that hangs).
        with KVCacheClient(srv.address) as c:
            t = threading.Thread(
                target=lambda: _ignore(lambda: c.lookup([b"k"], namespace="ns", timeout=2)),
                daemon=True,
            )
            t.start()
            t0 = time.monotonic()
            for q in seen.values():
                wait_for(q, NOT_SERVING, SOON_S)
            flipped = time.monotonic() - t0
            t.join(SOON_S)
        # not before the threshold (the loop was seen stale), not long after it
        assert STALL_S * 0.5 < flipped < SOON_S, flipped
        # Check answers, and answers NOT_SERVING (not a timeout), for both names.
        for name in ("", SERVICE_NAME):
            assert health_status(probe, name, timeout=10) == NOT_SERVING
        # ...and keeps answering it: NOT_SERVING is kept, the streams stay open.
        time.sleep(STALL_S)
        for name in ("", SERVICE_NAME):
            assert health_status(probe, name, timeout=10) == NOT_SERVING
        for q in seen.values():
            assert q.empty(), list(q.queue)  # no SERVING after it, no end
    log = srv.output()
    assert "EVENT_LOOP_STALLED" in log or "missed its heartbeat" in log, log
    # the loop is still hung: the main port's Check cannot be answered
    with pytest.raises(grpc.RpcError) as ei:
        health_status(srv.address, SERVICE_NAME, timeout=1)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def _ignore(call: Callable[[], object]) -> None:
    # a deadline or UNAVAILABLE once the server is killed: not what is tested
    with contextlib.suppress(Exception):
        call()


def test_sigterm_ends_watch_streams_on_the_health_port(spawn) -> None:
    """Graceful shutdown still works through the health port: NOT_SERVING is sent,
    then the stream ends with OK, and the server exits 0."""
    srv = spawn("--health-listen", "127.0.0.1:0")
    probe = health_address(srv)
    seen: queue.Queue[object] = queue.Queue()
    with grpc.insecure_channel(probe) as ch:
        reader = watch(ch, SERVICE_NAME, seen)
        assert next_status(seen, SOON_S) == SERVING
        srv.signal(signal.SIGTERM)
        got = wait_for(seen, NOT_SERVING, SOON_S)
        end = next_status(seen, SOON_S)
        assert end is None, (got, end)  # ended by the server, with OK
        reader.join(SOON_S)
    assert srv.wait(SOON_S) == 0
    log = srv.output()
    for bad in ("CRITICAL", "fatal failure", "Traceback"):
        assert bad not in log, log
