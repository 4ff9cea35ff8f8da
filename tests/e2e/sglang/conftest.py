"""The SGLang storage backend's tests need the real SGLang wheel in its own venv:
``make sglang`` (scripts/check_sglang.sh) makes it and runs them with
KVSVC_SGLANG_REQUIRED=1, under which a missing SGLang fails instead of skipping.
The main venv's pytest skips these modules (``pytest.importorskip``)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

REQUIRED = os.environ.get("KVSVC_SGLANG_REQUIRED") == "1"
# Not just find_spec("sglang"): this folder itself is a namespace package "sglang".
_spec = importlib.util.find_spec("sglang")
HAVE_SGLANG = _spec is not None and _spec.origin is not None

if not HAVE_SGLANG and REQUIRED:
    raise RuntimeError(
        "KVSVC_SGLANG_REQUIRED=1 but SGLang is not importable: run `make sglang` "
        "(it makes .venv-sglang)"
    )

# SGLang's host pools import torchvision on the way (cpu_imports.py says why).
if HAVE_SGLANG:
    from cpu_imports import absent_torchvision

    absent_torchvision()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    """Under KVSVC_SGLANG_REQUIRED=1 a skipped test is a failed one."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped under KVSVC_SGLANG_REQUIRED=1: {report.longrepr}"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped at collection (no SGLang) fails too under KVSVC_SGLANG_REQUIRED=1."""
    if REQUIRED and report.skipped:
        report.outcome = "failed"
