"""One vLLM engine process for the connector tests (vLLM spawns its engine core
and worker; they need a ``__main__`` guard, so tests run this as a script).

``python driver.py PLAN.json RESULT.json``. The plan names the model, the
kv-transfer config (or none: the baseline) and a list of steps: ``generate``
(prompts as token ids; its own ``max_tokens`` optional; with ``until``, repeated
until the test makes that file), ``serve`` (start
``kvsvc serve`` on the plan's port, with optional failpoints), ``kill`` (SIGKILL
it), ``wait_mapped`` and ``wait_stored`` (poll the server, bounded), ``sleep``.
The plan may also set ``kv_events_config``, ``prefix_caching`` and the server's
``store_bytes``. The result holds each generate's output token ids, cached
(= loaded) tokens and wall time, written after every
step so a crash still leaves what ran."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvsvc.client import KVCacheClient
from kvsvc.errors import KVServiceError


class KvsvcProcess:
    """`kvsvc serve` on ``port``; ``args``: more flags (they win over the defaults);
    ``client``: what the readiness check's KVCacheClient needs (token, tls) for a
    secured server."""

    def __init__(
        self,
        port: int,
        failpoints: str,
        shm_dir: str,
        *args: str,
        store_bytes: str = "256M",
        client: dict[str, Any] | None = None,
    ) -> None:
        env = dict(os.environ)
        env.pop("KVSVC_FAILPOINTS", None)
        if failpoints:
            env["KVSVC_FAILPOINTS"] = failpoints
        self.address = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvsvc",
                "serve",
                "--listen",
                self.address,
                "--store-bytes",
                store_bytes,
                "--shm-dir",
                shm_dir,
                *args,
            ],
            env=env,
            start_new_session=True,
        )
        # 60 s was too short on a 2-core host at load 11 (the server imports torch).
        deadline = time.monotonic() + 180
        with KVCacheClient(self.address, **(client or {})) as c:
            while True:
                try:
                    c.server_info(timeout=2)
                    return
                except KVServiceError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"kvsvc serve did not start: rc {self.proc.poll()}"
                        ) from None
                    time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def poll(address: str, what: str, ok: Any, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    with KVCacheClient(address) as c:
        while True:
            info = c.server_info(timeout=5)
            if ok(info):
                return {"mappings": info.mappings, "stored_chunks": info.stored_chunks}
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not reached in {timeout} s: {info}")
            time.sleep(0.2)


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if plan.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**plan["kv_transfer_config"])
    if plan.get("kv_events_config"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**plan["kv_events_config"])
    t0 = time.monotonic()
    llm = LLM(
        model=plan["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=plan.get("prefix_caching", False),
        gpu_memory_utilization=0.15,
        max_model_len=plan.get("max_model_len", 2048),
        max_num_seqs=4,
        **kwargs,
    )
    result: dict[str, Any] = {"engine_start_s": time.monotonic() - t0, "steps": []}
    params = SamplingParams(temperature=0, max_tokens=plan.get("max_tokens", 8), ignore_eos=True)
    server: KvsvcProcess | None = None
    shm_dir = tempfile.mkdtemp(prefix="kvsvc-vllm-shm-")
    address = f"127.0.0.1:{plan.get('port', 0)}"
    try:
        for step in plan["steps"]:
            rec: dict[str, Any] = {"step": step["do"], "name": step.get("name", step["do"])}
            print(f"driver: {rec['name']} start", file=sys.stderr, flush=True)
            t = time.monotonic()
            rec["t_start"] = time.time()
            if step["do"] == "generate":
                sp = params
                if "max_tokens" in step:
                    sp = SamplingParams(
                        temperature=0, max_tokens=step["max_tokens"], ignore_eos=True
                    )
                prompts = [TokensPrompt(prompt_token_ids=p) for p in step["prompts"]]
                outs = llm.generate(prompts, sp)
                # "until": repeat (scheduler steps publish) until the test, which
                # watches from outside, makes that file; bounded by "max_s".
                until = Path(step["until"]) if "until" in step else None
                rec["rounds"] = 1
                stop_at = t + step.get("max_s", 60)
                while until is not None and not until.exists() and time.monotonic() < stop_at:
                    llm.generate(prompts, sp)
                    rec["rounds"] += 1
                rec["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
                rec["cached"] = [int(o.num_cached_tokens or 0) for o in outs]
            elif step["do"] == "serve":
                server = KvsvcProcess(
                    plan["port"],
                    step.get("failpoints", ""),
                    shm_dir,
                    store_bytes=plan.get("store_bytes", "256M"),
                )
            elif step["do"] == "kill":
                assert server is not None
                server.kill()
                server = None
            elif step["do"] == "wait_mapped":
                rec["info"] = poll(address, "a mapping", lambda i: i.mappings >= 1)
            elif step["do"] == "wait_stored":
                n = step["chunks"]
                rec["info"] = poll(address, f"{n} chunks", lambda i, n=n: i.stored_chunks >= n)
            elif step["do"] == "sleep":
                time.sleep(step["s"])
            rec["seconds"] = time.monotonic() - t
            rec["t_end"] = time.time()
            result["steps"].append(rec)
            out_path.write_text(json.dumps(result))
            print(
                f"driver: {rec['name']} done in {rec['seconds']:.1f} s", file=sys.stderr, flush=True
            )
    finally:
        if server is not None:
            server.kill()
        # vLLM's shutdown force-kills its engine core after a few seconds.
        del llm
    result["done"] = True
    out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
