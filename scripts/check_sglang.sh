#!/usr/bin/env bash
# The SGLang storage backend's tests (tests/e2e/sglang/) against the real SGLang
# wheel on CPU, in their own venv so that the main one stays small:
#   1. makes (or keeps) .venv-sglang: the pinned torch (the CPU wheel), sglang with
#      --no-deps (its own pins want CUDA torch 2.14.1 and flashinfer), and the
#      packages `import sglang` and its host pools and cache controller really
#      import on CPU (traced here: shared/notes/engines.md), then kvsvc itself
#      (editable). A stamp file holds the pins: the venv is re-used while they are
#      unchanged (kvsvc is re-installed each run, in case pyproject.toml gained a
#      dependency).
#   2. runs pytest on tests/e2e/sglang with KVSVC_SGLANG_REQUIRED=1, which turns
#      every skip into a failure (the main venv's pytest skips those tests), then
#      the SGLang benchmark at smoke size (benchmarks/sglang.py; the main venv's
#      bench-smoke skips it: no SGLang there).
# Env: SGLANG_VENV (default .venv-sglang).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
VENV="${SGLANG_VENV:-.venv-sglang}"
TORCH="torch==2.13.0"
SGLANG="sglang==0.5.23"
# What sglang 0.5.23 imports at module level on the way to hicache_storage,
# backend_factory, pool_host.{mha,mla} and managers.cache_controller.
DEPS="triton numpy orjson psutil pybase64 requests packaging pillow starlette
typing_extensions pydantic msgspec pyzmq tqdm IPython aiohttp transformers
apache-tvm-ffi dill sentencepiece compressed-tensors gguf"
TEST_DEPS="pytest pytest-timeout pytest-asyncio"
want="$TORCH $SGLANG $(echo $DEPS) $TEST_DEPS"
STAMP="$VENV/.kvsvc-sglang-pins"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "sglang: keeping $VENV (pins unchanged)"
else
  echo "sglang: making $VENV: $want (a few minutes)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # --no-compile: byte-compiling every module of torch, sglang and transformers
  # costs minutes of CPU; Python compiles the few hundred the tests import.
  "$VENV/bin/pip" install -q --no-compile "$TORCH"
  "$VENV/bin/pip" install -q --no-compile --no-deps "$SGLANG"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q --no-compile $DEPS $TEST_DEPS "$TORCH"
  echo "$want" >"$STAMP"
fi
"$VENV/bin/pip" install -q -e .

export KVSVC_SGLANG_REQUIRED=1
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 300 tests/e2e/sglang "$@"
"$VENV/bin/python" -m benchmarks.sglang --smoke
echo "sglang: done in $((SECONDS - start)) s"
