#!/usr/bin/env bash
# Checks the Node.js and Go clients end to end, on a fresh Debian 12 machine
# that has only the Python venv (.venv, made by the Makefile):
#   1. installs what the clients need: Debian's Go, protoc and Go gRPC libraries
#      (only when one is missing), and `npm ci` in clients/node;
#   2. regenerates the generated code into a temp dir and fails if the
#      committed code differs (run scripts/gen_clients.sh to update it);
#   3. runs `node --test` and `go test` (GOPATH mode against Debian's packaged
#      libraries: there is no Go module proxy here) against real `kvsvc serve`
#      processes, and exits non-zero on any failure.
# Env: KVSVC_BIN (default .venv/bin/kvsvc), CHECK_CLIENTS_SKIP_INSTALL=1 to skip step 1.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/apt.sh
REPO=$PWD

export KVSVC_BIN="${KVSVC_BIN:-$REPO/.venv/bin/kvsvc}"
if [[ ! -x "$KVSVC_BIN" ]]; then
  echo "check_clients: $KVSVC_BIN not found: make the Python venv first with 'make install' (creates .venv), or set KVSVC_BIN to a kvsvc command" >&2
  exit 1
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/check_clients.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n== check_clients: %s\n' "$*"; }

# --- 1. install -------------------------------------------------------------
# golang-github-golang-protobuf-1-5-dev, not the 1.3 one that grpc-dev would pull
# by default: 1.3's marshaller cannot encode protoc-gen-go 1.28 messages' oneofs.
APT_PACKAGES=(
  golang-go protobuf-compiler libprotobuf-dev protoc-gen-go protoc-gen-go-grpc
  golang-google-grpc-dev golang-google-protobuf-dev golang-google-genproto-dev
  golang-github-golang-protobuf-1-5-dev
)
if [[ "${CHECK_CLIENTS_SKIP_INSTALL:-}" != 1 ]]; then
  step "install"
  command -v node >/dev/null && command -v npm >/dev/null || APT_PACKAGES+=(nodejs npm)
  apt_install_missing "$WORK" "${APT_PACKAGES[@]}"
  (cd clients/node && npm ci --no-audit --no-fund --loglevel=error)
fi
go version
node --version

# --- 2. generated code is up to date ----------------------------------------
step "generated code"
scripts/gen_clients.sh "$WORK/gen" >/dev/null
if ! diff -r "$WORK/gen/clients/go/gen" clients/go/gen; then
  echo "check_clients: clients/go/gen differs from what scripts/gen_clients.sh makes from proto/;" \
    "run scripts/gen_clients.sh and commit the result" >&2
  exit 1
fi
echo "clients/go/gen matches proto/"

# --- 3. tests ---------------------------------------------------------------
failed=0
passes=0
fails=0

# Each suite takes about 2 minutes on an idle 2-core host (node 125 s, go 112 s,
# WatchEvents' live tests included) and more than 5 minutes at a load of 6: the
# limits leave that room and still end a hung suite.
step "node --test (clients/node)"
node_tap="$WORK/node.tap"
set +e
(cd clients/node && timeout 600 node --test \
  --test-reporter=spec --test-reporter-destination=stdout \
  --test-reporter=tap --test-reporter-destination="$node_tap" test/*.test.js)
rc=$?
set -e
n_pass=$(awk '/^# pass /{print $3}' "$node_tap" 2>/dev/null | tail -1)
n_fail=$(awk '/^# fail /{print $3}' "$node_tap" 2>/dev/null | tail -1)
n_pass=${n_pass:-0}
n_fail=${n_fail:-0}
if ((rc != 0)); then
  failed=1
  ((n_fail > 0)) || n_fail=1
  echo "check_clients: node --test failed (exit $rc)" >&2
fi
passes=$((passes + n_pass))
fails=$((fails + n_fail))

step "go vet + go test (clients/go, GOPATH mode on Debian's libraries)"
module=$(awk '$1 == "module" { print $2; exit }' clients/go/go.mod)
gopath="$WORK/gopath"
mkdir -p "$gopath/src/$(dirname "$module")"
ln -s "$REPO/clients/go" "$gopath/src/$module"
export GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOFLAGS=
[[ -n "$(go env GOCACHE 2>/dev/null)" ]] || export GOCACHE="${TMPDIR:-/tmp}/kvsvc-go-cache"
set +e
(
  cd "$gopath/src/$module"
  unformatted=$(gofmt -l $(find . -name '*.go' -not -path './gen/*'))
  if [[ -n "$unformatted" ]]; then
    echo "gofmt: not formatted: $unformatted" >&2
    exit 1
  fi
  go vet ./... && go test -count=1 -v -timeout 600s ./...
) 2>&1 | tee "$WORK/go.log"
rc=${PIPESTATUS[0]}
set -e
g_pass=$(grep -cE '^\s*--- PASS' "$WORK/go.log" || true)
g_fail=$(grep -cE '^\s*--- FAIL' "$WORK/go.log" || true)
if ((rc != 0)); then
  failed=1
  ((g_fail > 0)) || g_fail=1
  echo "check_clients: go test failed (exit $rc)" >&2
fi
passes=$((passes + g_pass))
fails=$((fails + g_fail))

echo
echo "check_clients: node $n_pass passed, $n_fail failed; go $g_pass passed, $g_fail failed"
echo "clients: $passes passed, $fails failed"
exit "$failed"
