#!/usr/bin/env bash
# Installs redis-server and redis-tools from Debian's packages when missing: the
# remote-tier tests (tests/server/test_remote*.py) start real Redis servers and a Redis
# Cluster with them. `make pytest` runs this first, so CI machines get them too.
# Usage: scripts/install_redis.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/apt.sh
source scripts/apt.sh
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
apt_install_missing "$logs" redis-server redis-tools
# The package may start a system-wide server; the tests start their own.
command -v redis-server >/dev/null && command -v redis-cli >/dev/null
