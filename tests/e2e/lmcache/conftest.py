"""The LMCache L2 adapter's tests need the real LMCache wheel in its own venv:
``make lmcache`` (scripts/check_lmcache.sh) makes it and runs them with
KVSVC_LMCACHE_REQUIRED=1, under which a missing LMCache fails instead of skipping.
The main venv's pytest skips these modules (``pytest.importorskip``)."""

from __future__ import annotations

from support import EngineVenv

VENV = EngineVenv("KVSVC_LMCACHE_REQUIRED", "LMCache")
pytest_runtest_makereport = VENV.runtest_makereport
pytest_collectreport = VENV.collectreport
