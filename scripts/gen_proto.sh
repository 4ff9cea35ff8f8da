#!/usr/bin/env bash
# Regenerates the Python code for proto/ into OUT (default: src/), the one way it is made.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-src}"
mkdir -p "$OUT/kvsvc/v1"
python -m grpc_tools.protoc -Iproto \
  --python_out="$OUT" --grpc_python_out="$OUT" \
  --mypy_out="$OUT" --mypy_grpc_out="$OUT" \
  proto/kvsvc/v1/*.proto
