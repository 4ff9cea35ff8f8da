"""A real vLLM engine (CPU) with KV events on publishes kvsvc's blocks: a router's
view, read from vLLM's ZMQ publisher (pyzmq + msgpack, vLLM's wire form: frames
topic, sequence, msgpack([ts, [event maps tagged "type"], dp_rank])). After a
prompt is stored in kvsvc its chunks arrive as BlockStored in the form vLLM's
offloading tiers publish theirs (medium "CPU", locality "LOCAL", ownership
"kvsvc", which tells them from vLLM's own blocks) and with the very hashes vLLM
publishes for its own blocks of that prompt; after the server is killed and
started again (empty: a new incarnation) they leave as BlockRemoved. vLLM
publishes only on scheduler steps, and kvsvc's blocks only while the presence
index is fresh, so a short flush prompt is repeated after each change until the
subscriber has seen what should follow (bounded: a minute)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.distributed", reason="the vLLM connector tests run in .venv-vllm")

import msgpack
import zmq
from test_engines import A, gen, step
from vllm_helpers import connector_config, free_port, make_model, run_engine

FLUSH = [7] * 10  # under one block: no lookup, no store; its steps publish
FLUSH_TOKENS = 32


class Subscriber:
    """vLLM's KV-events publisher as a router sees it, on a thread."""

    def __init__(self, port: int) -> None:
        self.batches: list[tuple[float, list[dict[str, Any]]]] = []
        # (kind, how many kvsvc hashes, file): made once that many have arrived,
        # which ends the driver's repeated flush.
        self.signals: list[tuple[str, int, Path]] = []
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(200):
                _topic, _seq, payload = self.sub.recv_multipart()
                ts, events, *_ = msgpack.unpackb(payload)
                self.batches.append((ts, events))
                for kind, n, path in self.signals:
                    if len(self.hashes(kind, kvsvc=True)) >= n:
                        path.touch()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sub.close(0)
        self.ctx.term()

    def hashes(self, kind: str, kvsvc: bool, after: float = 0, before: float = 1e18) -> set[int]:
        return {
            h
            for ts, events in self.batches
            if after <= ts <= before
            for e in events
            if e["type"] == kind and (e.get("ownership") == "kvsvc") == kvsvc
            for h in e["block_hashes"]
        }


@pytest.fixture(scope="module")
def events_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Subscriber]:
    work = tmp_path_factory.mktemp("events")
    model = make_model(work / "model")
    port, zmq_port = free_port(), free_port()
    seen_stored, seen_removed = work / "seen_stored", work / "seen_removed"
    steps = [
        {"do": "serve"},
        {"do": "wait_mapped"},
        gen("A", A),
        {"do": "wait_stored", "chunks": 5},
        {"do": "sleep", "s": 1},
        {**gen("flush1", FLUSH), "max_tokens": FLUSH_TOKENS, "until": str(seen_stored)},
        {"do": "kill"},
        {"do": "serve"},
        {"do": "wait_mapped"},
        {**gen("flush2", FLUSH), "max_tokens": FLUSH_TOKENS, "until": str(seen_removed)},
        {"do": "kill"},
    ]
    sub = Subscriber(zmq_port)
    sub.signals = [("BlockStored", 5, seen_stored), ("BlockRemoved", 5, seen_removed)]
    try:
        run = run_engine(
            work,
            "events",
            {
                "model": str(model),
                "port": port,
                "prefix_caching": True,  # vLLM then publishes its own blocks too
                "kv_transfer_config": connector_config(
                    port, lookup_timeout_s=2.0, log_level="DEBUG"
                ),
                "kv_events_config": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{zmq_port}",
                },
                "steps": steps,
            },
        )
        time.sleep(0.5)  # the last frames in flight
    finally:
        sub.close()
    return run, sub


def test_kvsvc_blocks_arrive_as_vllm_kv_events_and_leave(events_run) -> None:
    run, sub = events_run
    assert step(run, "A")["cached"] == [0]
    killed = step(run, "flush1")["t_end"]
    own = sub.hashes("BlockStored", kvsvc=False, before=killed)
    assert len(own) == 5, own  # vLLM's own: A's 5 full blocks of BLOCK tokens
    stored = sub.hashes("BlockStored", kvsvc=True, before=killed)
    # kvsvc's keys map back to vLLM's hashes
    assert stored == own, (stored, own, step(run, "flush1")["rounds"])
    assert not sub.hashes("BlockRemoved", kvsvc=True, before=killed)
    removed = sub.hashes("BlockRemoved", kvsvc=True, after=killed)
    assert removed == stored, (removed, stored)
    ours = [e for _, events in sub.batches for e in events if e.get("ownership") == "kvsvc"]
    assert {(e["medium"], e.get("locality")) for e in ours} == {("CPU", "LOCAL")}
