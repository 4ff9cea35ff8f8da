#!/usr/bin/env bash
# Regenerates the Python code for proto/ into OUT/kvsvc/v1 (OUT defaults to the
# repository root), the one way it is made.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-.}"
mkdir -p "$OUT/kvsvc/v1"
python -m grpc_tools.protoc -Iproto \
  --python_out="$OUT" --grpc_python_out="$OUT" \
  --mypy_out="$OUT" --mypy_grpc_out="$OUT" \
  proto/kvsvc/v1/*.proto
