#!/usr/bin/env bash
# Checks the C++ client (clients/cpp) end to end, on a fresh Debian 12 machine
# that has only the Python venv (.venv, made by the Makefile):
#   1. installs what it needs from Debian (only what is missing): cmake, g++,
#      grpc++ and protobuf with their code generators, GoogleTest, nlohmann-json;
#   2. cmake configure + build (at most -j2: CI machines have 2 cores), the
#      protobuf and gRPC code generated from proto/ at build time;
#   3. ctest: the GoogleTest suites, against real `kvsvc serve` processes;
#   4. installs the library into a temp prefix and builds and runs the README's
#      example outside the repository (find_package(kvsvc)) against a server.
# Closes with `cpp: N passed, M failed` (the GoogleTest cases, plus the example
# as one) and exits non-zero on any failure.
# Env: KVSVC_BIN (default .venv/bin/kvsvc); CHECK_CPP_SKIP_INSTALL=1 to skip
# step 1; CHECK_CPP_BUILD_DIR (default clients/cpp/build, kept between runs so
# a rebuild is incremental); CHECK_CPP_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/apt.sh
REPO=$PWD
start=$SECONDS

export KVSVC_BIN="${KVSVC_BIN:-$REPO/.venv/bin/kvsvc}"
if [[ ! -x "$KVSVC_BIN" ]]; then
  echo "check_cpp: $KVSVC_BIN not found: make the Python venv first with 'make install' (creates .venv), or set KVSVC_BIN to a kvsvc command" >&2
  exit 1
fi
BUILD="${CHECK_CPP_BUILD_DIR:-$REPO/clients/cpp/build}"
JOBS="${CHECK_CPP_JOBS:-2}"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/check_cpp.XXXXXX")
server_pid=
cleanup() {
  if [[ -n "$server_pid" ]]; then
    kill -TERM -- "-$server_pid" 2>/dev/null || true
    sleep 1
    kill -KILL -- "-$server_pid" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

step() { printf '\n== check_cpp: %s\n' "$*"; }

# --- 1. install -------------------------------------------------------------
APT_PACKAGES=(
  cmake g++ make pkgconf protobuf-compiler libprotobuf-dev protobuf-compiler-grpc libgrpc++-dev
  libgtest-dev nlohmann-json3-dev
)
if [[ "${CHECK_CPP_SKIP_INSTALL:-}" != 1 ]]; then
  step "install"
  apt_install_missing "$WORK" "${APT_PACKAGES[@]}"
fi
cmake --version | head -1
g++ --version | head -1

# --- 2. build ---------------------------------------------------------------
step "cmake configure + build ($BUILD, -j$JOBS)"
t0=$SECONDS
cmake -S clients/cpp -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSVC_BIN="$KVSVC_BIN" \
  -DCMAKE_INSTALL_PREFIX="$WORK/prefix" >"$WORK/configure.log" 2>&1 || { cat "$WORK/configure.log"; exit 1; }
cmake --build "$BUILD" -j "$JOBS"
echo "built in $((SECONDS - t0))s"

# --- 3. tests ---------------------------------------------------------------
step "ctest (GoogleTest against live kvsvc servers)"
rm -rf "$BUILD/test-results"
set +e
(cd "$BUILD" && timeout 400 ctest --output-on-failure --timeout 240)
ctest_rc=$?
set -e
passes=0
fails=0
for t in errors_test live_test; do
  xml="$BUILD/test-results/$t.xml"
  if [[ ! -s "$xml" ]]; then
    echo "check_cpp: $t left no results (it crashed or timed out)" >&2
    fails=$((fails + 1))
    continue
  fi
  # The <testsuites ...> line totals the binary's cases.
  head=$(grep -m1 '<testsuites ' "$xml")
  n=$(sed -E 's/.* tests="([0-9]+)".*/\1/' <<<"$head")
  f=$(sed -E 's/.* failures="([0-9]+)".*/\1/' <<<"$head")
  e=$(sed -E 's/.* errors="([0-9]+)".*/\1/' <<<"$head")
  passes=$((passes + n - f - e))
  fails=$((fails + f + e))
done
if ((ctest_rc != 0 && fails == 0)); then fails=1; fi

# --- 4. the README's example, built outside the repository -------------------
step "install + the README's example (find_package(kvsvc), outside the repository)"
example_ok=0
# The README shows example/example.cc verbatim.
if ! diff <(sed -n '/^```cpp$/,/^```$/p' clients/cpp/README.md | sed '1d;$d') clients/cpp/example/example.cc; then
  echo "check_cpp: clients/cpp/README.md's example differs from clients/cpp/example/example.cc" >&2
elif cmake --install "$BUILD" >"$WORK/install.log" 2>&1 &&
  cp -r clients/cpp/example "$WORK/example" &&
  cmake -S "$WORK/example" -B "$WORK/example/build" -DCMAKE_PREFIX_PATH="$WORK/prefix" \
    >"$WORK/example-configure.log" 2>&1 &&
  cmake --build "$WORK/example/build" -j "$JOBS" >"$WORK/example-build.log" 2>&1; then
  mkdir -p "$WORK/shm"
  setsid "$KVSVC_BIN" serve --listen 127.0.0.1:0 --shm-dir "$WORK/shm" --device cpu \
    --shutdown-grace 1 >"$WORK/server.log" 2>&1 &
  server_pid=$!
  addr=
  for _ in $(seq 600); do
    addr=$(grep -m1 -oE 'serving on 127\.0\.0\.1:[0-9]+' "$WORK/server.log" | cut -d' ' -f3) || true
    [[ -n "$addr" ]] && break
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  if [[ -n "$addr" ]] && timeout 60 "$WORK/example/build/kv_example" "$addr" | tee "$WORK/example.out" &&
    grep -q "block 3 now holds: block 0's KV bytes" "$WORK/example.out"; then
    example_ok=1
  else
    echo "check_cpp: the example failed; server log:" >&2
    cat "$WORK/server.log" >&2
  fi
else
  cat "$WORK"/install.log "$WORK"/example-*.log 2>/dev/null >&2 || true
  echo "check_cpp: the example does not build against the installed client" >&2
fi
if ((example_ok)); then passes=$((passes + 1)); else fails=$((fails + 1)); fi

echo
echo "check_cpp: done in $((SECONDS - start))s"
echo "cpp: $passes passed, $fails failed"
((fails == 0))
