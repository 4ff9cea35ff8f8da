#!/usr/bin/env bash
# Installs the clients the way their ecosystems do, outside the repository, and
# runs them against a live server:
#   1. Python: `python -m build` makes a wheel and an sdist; the wheel must carry
#      the native copy loop and presence table (setup.py's extensions); it goes
#      into an empty venv in a temp dir (torch as TORCH_SPEC, from pip's
#      configured index), which must use both, and whose `kvsvc serve` (its start
#      line naming the native copy loop) then listens on a unix socket and whose
#      `kvsvc demo` runs against it twice (shm files, then sealed memfds over
#      the socket dir); a wheel built without a compiler (CC=false) installs and
#      names the Python loop and why; then a wheel built from the sdist replaces
#      it, native again, and the demo runs again.
#   2. Node: `npm pack` (the tarball carries proto/), `npm install <tarball>` in
#      an empty directory, and the README's example program against that server.
#   3. Go: the module path in go.mod is the one the README documents (the code
#      itself is compiled under that path by scripts/check_clients.sh).
# Exits non-zero on any failure. Needs .venv (make install), node and npm.
# Env: TORCH_SPEC (default torch==2.13.0), as in the Makefile.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=.venv
BUILD_VERSION=1.2.2
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "check_packages: $VENV/bin/python not found; run make install first" >&2
  exit 2
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/check_packages.XXXXXX")
server_pid=
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"
    wait "$server_pid" || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
source scripts/apt.sh
command -v npm >/dev/null && command -v node >/dev/null || apt_install_missing "$WORK" nodejs npm
step() { printf '\n== check_packages: %s\n' "$*"; }
quiet_pip() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }

# --- 1. Python ----------------------------------------------------------------
step "python -m build (wheel + sdist)"
timeout 120 "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  "build==$BUILD_VERSION" 2> >(quiet_pip)
timeout 600 "$VENV/bin/python" -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 ||
  { tail -40 "$WORK/build.log" >&2; exit 1; }
wheel=$(ls "$WORK"/dist/kvsvc-*.whl)
sdist=$(ls "$WORK"/dist/kvsvc-*.tar.gz)
echo "built $(basename "$wheel") and $(basename "$sdist")"
# The wheel's native modules, named for the interpreter that will import them.
"$VENV/bin/python" - "$wheel" <<'PY'
import importlib.machinery, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
for mod in ("kvsvc/server/data/native/_copyloop", "kvsvc/client/native/_presence"):
    assert mod + suffix in names, f"check_packages: the wheel lacks {mod}{suffix}"
    print(f"ok: the wheel carries {mod}{suffix}")
PY

# Which copy loop and presence table the installed kvsvc uses: "native native
# <why>", or "python python <why>" (run outside the repository).
loops() {
  "$PY" -c 'from kvsvc.server.data.copies import copy_loop
from kvsvc.client.native import NATIVE
name, why = copy_loop()
print(name, "native" if NATIVE else "python", why)'
}
expect_native() {
  local got
  got=$(loops)
  [[ "$got" == "native native "* ]] ||
    { echo "check_packages: $1 runs copy loop / presence table: $got" >&2; exit 1; }
  echo "ok: $1 runs the native copy loop and presence table ($got)"
}

step "the wheel in an empty venv, outside the repository"
base_python=$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')
"$base_python" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
timeout 600 "$PY" -m pip install -q --disable-pip-version-check $TORCH_SPEC 2> >(quiet_pip)
timeout 600 "$PY" -m pip install -q --disable-pip-version-check "$wheel" 2> >(quiet_pip)
cd "$WORK"  # nothing of the repository on sys.path from here
where=$("$PY" -c 'import kvsvc; print(kvsvc.__file__)')
[[ "$where" == "$WORK/venv/"* ]] || { echo "check_packages: kvsvc imported from $where" >&2; exit 1; }
echo "kvsvc $("$WORK/venv/bin/kvsvc" --version) from $where"
expect_native "the wheel"

mkdir -p "$WORK/shm"
sock="$WORK/kvsvc.sock"
"$WORK/venv/bin/kvsvc" serve --listen "unix:$sock" --shm-dir "$WORK/shm" --store-bytes 64M \
  --socket-dir "$WORK/run" >"$WORK/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1200); do
  grep -q "serving on" "$WORK/server.log" && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
  sleep 0.1
done
grep -q "serving on" "$WORK/server.log" || { echo "server did not start" >&2; exit 1; }
grep -q "serving on .*copy loop native: built with the package" "$WORK/server.log" || {
  grep "serving on" "$WORK/server.log" >&2
  echo "check_packages: the server does not name the native copy loop" >&2
  exit 1
}
echo "ok: the wheel's server says: $(grep -o "copy loop native: [^,]*" "$WORK/server.log")"

demo() {
  local what=$1
  shift
  if ! timeout 300 "$WORK/venv/bin/kvsvc" demo --target "unix:$sock" --shm-dir "$WORK/shm" "$@" \
    >"$WORK/demo.log" 2>&1 || ! grep -q "^demo: OK" "$WORK/demo.log"; then
    cat "$WORK/demo.log" >&2
    echo "check_packages: kvsvc demo $* ($what) failed" >&2
    exit 1
  fi
  echo "ok: kvsvc demo $* ($what)"
}
demo "wheel, shm files"
demo "wheel, sealed memfds" --memfd

step "without a C compiler: the sdist still installs, on the Python loops, and says why"
CC=false timeout 600 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps \
  -w "$WORK/no-cc" "$sdist" 2> >(quiet_pip)
timeout 300 "$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
  "$WORK"/no-cc/kvsvc-*.whl 2> >(quiet_pip)
got=$(loops)
[[ "$got" == "python python the native loop was not built when kvsvc was installed"* ]] ||
  { echo "check_packages: without a compiler: $got" >&2; exit 1; }
echo "ok: built with CC=false, kvsvc runs: $got"

step "the sdist: built into a wheel, installed over it"
timeout 600 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WORK/from-sdist" \
  "$sdist" 2> >(quiet_pip)
timeout 300 "$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
  "$WORK"/from-sdist/kvsvc-*.whl 2> >(quiet_pip)
expect_native "the sdist's wheel"
demo "sdist" --memfd
cd "$REPO"

# --- 2. Node ------------------------------------------------------------------
step "npm pack + npm install <tarball> in an empty directory"
(cd clients/node && npm pack --silent --pack-destination "$WORK" >/dev/null)
tarball=$(ls "$WORK"/kvsvc-client-*.tgz)
# The listing first: `tar | grep -q` under pipefail fails whenever grep's early exit
# gets tar killed by SIGPIPE (it did in a fresh-clone CI run).
listing=$(tar tzf "$tarball")
grep -q "package/proto/kvsvc/v1/kv_cache_service.proto" <<<"$listing" ||
  { echo "check_packages: $tarball carries no proto/" >&2; exit 1; }
[[ ! -e clients/node/proto ]] || { echo "check_packages: npm pack left clients/node/proto" >&2; exit 1; }
mkdir "$WORK/app"
(cd "$WORK/app" && npm init -y >/dev/null &&
  timeout 300 npm install --no-audit --no-fund --loglevel=error "$tarball")
# The README's example, verbatim but for the server's address.
"$VENV/bin/python" - "$REPO/clients/node/README.md" "unix:$sock" >"$WORK/app/example.js" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
example = text.split("## Example", 1)[1]
code = re.search(r"```js\n(.*?)```", example, re.S).group(1)
assert "'127.0.0.1:50051'" in code, "the README example no longer targets 127.0.0.1:50051"
print(code.replace("'127.0.0.1:50051'", repr(sys.argv[2])))
EOF
out=$(cd "$WORK/app" && env -u KVSVC_PROTO_DIR timeout 60 node example.js)
echo "README example printed: $out"
[[ "$out" == "2 4096 SERVING" ]] || { echo "check_packages: expected '2 4096 SERVING'" >&2; exit 1; }

# --- 3. Go --------------------------------------------------------------------
step "Go module path"
module=$(awk '$1 == "module" { print $2; exit }' clients/go/go.mod)
grep -q "go get $module" clients/go/README.md ||
  { echo "check_packages: clients/go/README.md does not document module $module" >&2; exit 1; }
case "$module" in
  example.com/* | *placeholder*) echo "check_packages: $module is a placeholder" >&2; exit 1 ;;
esac
echo "ok: module $module"

echo
echo "check_packages: all checks passed"
