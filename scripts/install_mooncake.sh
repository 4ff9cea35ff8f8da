#!/usr/bin/env bash
# Installs Mooncake Store's client and mooncake_master (the mooncake extra:
# mooncake-transfer-engine-non-cuda) into the venv, and libibverbs1 from Debian's
# packages (a shared library its binaries link; no RDMA hardware needed), when
# missing: the Mooncake-tier tests and benchmark (tests/server/test_mooncake_tier.py,
# benchmarks/mooncake_tier.py) start a real master. `make pytest` runs this first, so
# CI machines get them too.
# Usage: scripts/install_mooncake.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
name=mooncake-transfer-engine-non-cuda
version=0.3.13.post1
# shellcheck source=scripts/apt.sh
source scripts/apt.sh
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
apt_install_missing "$logs" libibverbs1 >/dev/null
# pip show exits 1 when the package is absent (a fresh venv): not an error here.
have=$({ "$py" -m pip show "$name" 2>/dev/null || true; } | sed -n 's/^Version: //p')
if [ "$have" != "$version" ] || [ ! -x "$(dirname "$py")/mooncake_master" ]; then
  echo "install_mooncake: installing $name==$version into $(dirname "$py")"
  "$py" -m pip install -q "$name==$version"
fi
"$py" -c "import mooncake.store"
