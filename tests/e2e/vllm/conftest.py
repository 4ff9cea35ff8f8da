"""The vLLM connector's tests need real vLLM (CPU build) in their own venv:
``make vllm`` (scripts/check_vllm.sh) makes it and runs them with
KVSVC_VLLM_REQUIRED=1, under which a missing vLLM fails instead of skipping.
The main venv's pytest skips its modules (``pytest.importorskip("vllm")``)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

REQUIRED = os.environ.get("KVSVC_VLLM_REQUIRED") == "1"
# Not just find_spec("vllm"): this folder itself is a namespace package "vllm".
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = _spec is not None and _spec.origin is not None

if not HAVE_VLLM and REQUIRED:
    raise RuntimeError(
        "KVSVC_VLLM_REQUIRED=1 but vLLM is not importable: run `make vllm` (it makes .venv-vllm)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    """Under KVSVC_VLLM_REQUIRED=1 a skipped test is a failed one."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped under KVSVC_VLLM_REQUIRED=1: {report.longrepr}"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped at collection (no vLLM) fails too under KVSVC_VLLM_REQUIRED=1."""
    if REQUIRED and report.skipped:
        report.outcome = "failed"
