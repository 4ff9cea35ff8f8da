"""The LMCache L2 adapter's tests need the real LMCache wheel in its own venv:
``make lmcache`` (scripts/check_lmcache.sh) makes it and runs them with
KVSVC_LMCACHE_REQUIRED=1, under which a missing LMCache fails instead of skipping.
The main venv's pytest skips these modules (``pytest.importorskip``)."""

from __future__ import annotations

import os
from typing import Any

import pytest

REQUIRED = os.environ.get("KVSVC_LMCACHE_REQUIRED") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    """Under KVSVC_LMCACHE_REQUIRED=1 a skipped test is a failed one."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped under KVSVC_LMCACHE_REQUIRED=1: {report.longrepr}"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped at collection (no LMCache) fails too under KVSVC_LMCACHE_REQUIRED=1."""
    if REQUIRED and report.skipped:
        report.outcome = "failed"
