"""Helpers of the vLLM connector tests: engines run as driver.py processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(ipc_dir: str) -> dict[str, str]:
    """``ipc_dir``: where vLLM makes its ZMQ unix sockets (``VLLM_RPC_BASE_PATH``; by
    default the temp dir itself, where each engine leaves ~19 of them behind)."""
    env = dict(os.environ)
    env.update(
        VLLM_RPC_BASE_PATH=ipc_dir,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    if len(os.sched_getaffinity(0)) <= 2:
        # As docs/vllm.md says: else vLLM reserves no core with a connector set here.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env


def run_engine(tmp: Path, name: str, plan: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """Run driver.py with ``plan``; its result, with the engine's log as ``log``."""
    plan_path, out_path, log_path = (tmp / f"{name}.{s}" for s in ("plan.json", "out.json", "log"))
    plan_path.write_text(json.dumps(plan))
    # Its own socket dir, removed with what the engine left in it: short, under the
    # temp dir (a socket's path must fit in 108 bytes; pytest's tmp_path may not).
    ipc_dir = tempfile.mkdtemp(prefix="kv")
    try:
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "driver.py"), str(plan_path), str(out_path)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=engine_env(ipc_dir),
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(30)
                rc = -9
    finally:
        shutil.rmtree(ipc_dir)
    log = log_path.read_text(errors="replace")
    result = json.loads(out_path.read_text()) if out_path.exists() else {"steps": []}
    result["log"] = log
    result["rc"] = rc
    if rc != 0 or not result.get("done"):
        raise AssertionError(f"engine {name} failed (rc {rc}); log tail:\n{log[-6000:]}")
    return result


def connector_config(port: int, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvsvcConnector",
        "kv_connector_module_path": "kvsvc.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": f"127.0.0.1:{port}", **extra},
    }


def make_model(path: Path, **overrides: Any) -> Path:
    """A tiny random Llama in bf16 (there is no model hub here)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **{
            "vocab_size": 512,
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
            "max_position_embeddings": 4096,
            **overrides,
        }
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path
