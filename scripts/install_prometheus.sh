#!/usr/bin/env bash
# Installs prometheus (with promtool) from Debian's packages when missing:
# tests/server/test_monitoring.py checks deploy/monitoring/ with promtool and runs a
# real Prometheus against a live kvsvc. `make pytest` runs this first, so CI
# machines get it too.
# Usage: scripts/install_prometheus.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/apt.sh
source scripts/apt.sh
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
apt_install_missing "$logs" prometheus
# The package may start a system-wide server (with systemd); the tests start their own.
command -v prometheus >/dev/null && command -v promtool >/dev/null
