"""The SGLang storage backend's tests need the real SGLang wheel in its own venv:
``make sglang`` (scripts/check_sglang.sh) makes it and runs them with
KVSVC_SGLANG_REQUIRED=1, under which a missing SGLang fails instead of skipping.
The main venv's pytest skips these modules (``pytest.importorskip``)."""

from __future__ import annotations

from support import EngineVenv

VENV = EngineVenv("KVSVC_SGLANG_REQUIRED", "SGLang", module="sglang", target="sglang")
HAVE_SGLANG = VENV.present
pytest_runtest_makereport = VENV.runtest_makereport
pytest_collectreport = VENV.collectreport

# SGLang's host pools import torchvision on the way (cpu_imports.py says why).
if HAVE_SGLANG:
    from cpu_imports import absent_torchvision

    absent_torchvision()
