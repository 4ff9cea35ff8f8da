"""A real vLLM engine (CPU) with KV events on publishes kvsvc's blocks: a router's
view, read from vLLM's ZMQ publisher (pyzmq + msgpack, vLLM's wire form: frames
topic, sequence, msgpack([ts, [event maps tagged "type"], dp_rank])). After a
prompt is stored in kvsvc its chunks arrive as BlockStored with medium "kvsvc"
and the very hashes vLLM publishes for its own blocks of that prompt; after the
server is killed and started again (empty: a new incarnation) they leave as
BlockRemoved. vLLM publishes only on scheduler steps, so short flush prompts
follow each change."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("vllm.distributed", reason="the vLLM connector tests run in .venv-vllm")

import msgpack
import zmq
from test_engines import A, gen, step
from vllm_helpers import connector_config, free_port, make_model, run_engine

FLUSH = [7] * 10  # under one block: no lookup, no store; its steps publish
# Steps enough (~1 s or more) for the presence index to be fresh again on a loaded
# host: kvsvc's blocks are announced only while it is (events.py).
FLUSH_TOKENS = 64


class Subscriber:
    """vLLM's KV-events publisher as a router sees it, on a thread."""

    def __init__(self, port: int) -> None:
        self.batches: list[tuple[float, list[dict[str, Any]]]] = []
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
            if e["type"] == kind and (e.get("medium") == "kvsvc") == kvsvc
            for h in e["block_hashes"]
        }


@pytest.fixture(scope="module")
def events_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Subscriber]:
    work = tmp_path_factory.mktemp("events")
    model = make_model(work / "model")
    port, zmq_port = free_port(), free_port()
    steps = [
        {"do": "serve"},
        {"do": "wait_mapped"},
        gen("A", A),
        {"do": "wait_stored", "chunks": 5},
        {"do": "sleep", "s": 1},
        {**gen("flush1", FLUSH), "max_tokens": FLUSH_TOKENS},
        {"do": "kill"},
        {"do": "serve"},
        {"do": "wait_mapped"},
        {"do": "sleep", "s": 3},
        {**gen("flush2", FLUSH), "max_tokens": FLUSH_TOKENS},
        {"do": "kill"},
    ]
    sub = Subscriber(zmq_port)
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
    assert stored == own, (stored, own)  # kvsvc's keys map back to vLLM's hashes
    assert not sub.hashes("BlockRemoved", kvsvc=True, before=killed)
    removed = sub.hashes("BlockRemoved", kvsvc=True, after=killed)
    assert removed == stored, (removed, stored)
