#!/usr/bin/env bash
# The LMCache L2 adapter's tests (tests/e2e/lmcache/) against the real LMCache
# wheel on CPU, in their own venv so that the main one stays small:
#   1. makes (or keeps) .venv-lmcache: the pinned CPU torch first (so that lmcache
#      keeps it), lmcache with its own dependencies, valkey-glide-sync (LMCache's
#      valkey adapter, measured beside kvsvc's), the test tools, then kvsvc itself
#      (editable; re-installed each run, in case pyproject.toml gained a
#      dependency). kvsvc's protobuf (>= 7.35) replaces the protobuf < 7 that
#      lmcache 0.5.6 declares: pip says so; LMCache's server, client and adapters
#      run with it (these tests are that check). A stamp file holds the pins: the
#      venv is re-used while they are unchanged.
#   2. runs pytest on tests/e2e/lmcache with KVSVC_LMCACHE_REQUIRED=1, which turns
#      every skip into a failure (the main venv's pytest skips those tests), then
#      the L2 adapter benchmark at smoke size (benchmarks/lmcache_l2.py, needs
#      redis-server: ./scripts/install_redis.sh).
# Env: LMCACHE_VENV (default .venv-lmcache).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
VENV="${LMCACHE_VENV:-.venv-lmcache}"
TORCH="torch==2.13.0"
LMCACHE="lmcache==0.5.6"
DEPS="valkey-glide-sync==2.6.0"
TEST_DEPS="pytest pytest-timeout pytest-asyncio"
want="$TORCH $LMCACHE $DEPS $TEST_DEPS"
STAMP="$VENV/.kvsvc-lmcache-pins"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "lmcache: keeping $VENV (pins unchanged)"
else
  echo "lmcache: making $VENV: $want (a few minutes)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # Git ignores the whole venv (the repository's .gitignore does not name it).
  echo '*' >"$VENV/.gitignore"
  # --no-compile: byte-compiling every module of torch and lmcache's dependencies
  # costs minutes of CPU; Python compiles the few hundred the tests import.
  "$VENV/bin/pip" install -q --no-compile "$TORCH"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q --no-compile "$LMCACHE" $DEPS $TEST_DEPS "$TORCH"
  echo "$want" >"$STAMP"
fi
# pip warns that kvsvc's protobuf and grpcio are newer than lmcache declares (see above).
"$VENV/bin/pip" install -q --no-compile -e . 2>&1 | grep -v "^ERROR: pip's dependency resolver\|requires protobuf\|requires grpcio" || true
"$VENV/bin/python" -c "import kvsvc.integrations.lmcache.adapter" # fails here, not in every test

export KVSVC_LMCACHE_REQUIRED=1 LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 600 -W ignore::DeprecationWarning \
  -W ignore::FutureWarning tests/e2e/lmcache "$@"
"$VENV/bin/python" -m benchmarks.lmcache_l2 --smoke
echo "lmcache: done in $((SECONDS - start)) s"
