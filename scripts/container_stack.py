"""The assertions of `make test-container`: build docker/Dockerfile and run the
project's own docker/compose.yaml with podman, and check what a user relies on.

scripts/test_container.sh prepares the machine (podman, the local base image, podman's
Docker API socket, the health-check driver) and tears everything down; this file
builds the image and runs three stacks under the compose project it is given:

1. ``up --exit-code-from DEMO``: the server turns healthy and gates the demo
   (``service_healthy``); the demo, in its own container, stores, retrieves and
   verifies bit-exact and exits 0; compose's stop ends the server with exit 0.
2. ``up -d SERVER``: the image's health check and a gRPC health call from the host
   (on the health-only port, without credentials) say SERVING; a call without the
   token is refused UNAUTHENTICATED, one with the token the stack made answers;
   the server runs as the image's non-root uid on a read-only root;
   its ports answer on 127.0.0.1 only; ``down`` stops it with SIGTERM and exit 0
   well inside its grace period.
3. ``run SERVER`` with a fatal failpoint: a failing copy from the host turns the
   container unhealthy.

The server and demo services are found in the compose file (the service another
one waits for with ``service_healthy``, and that one), not by name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from kvsvc.cli.healthprobe import SERVING, UNHEALTHY, parse_duration, probe
from kvsvc.client import KVCacheClient
from kvsvc.errors import FatalServerError, KVServiceError, Unauthenticated
from kvsvc.server.ops.health import SERVICE_NAME

# The container's ports (docker/Dockerfile): gRPC (credentials), health only, metrics.
GRPC_PORT, HEALTH_PORT, METRICS_PORT = 50051, 50052, 9400
FAILPOINT = "transfer.before_copy=raise"


class Failed(Exception):
    """A step the later ones depend on did not happen."""


class Run:
    """Compose and podman for one compose project, and the tally of checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.compose_bin: str = args.compose
        self.file: str = args.file
        self.project: str = args.project
        self.logs = Path(args.logs)
        self.env = dict(os.environ)
        self.env["KVSVC_IMAGE"] = args.image
        if args.redis_image:
            self.env["KVSVC_REDIS_IMAGE"] = args.redis_image
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.health_port = free_port()
        self.env["KVSVC_GRPC_HOST_PORT"] = str(self.grpc_port)
        self.env["KVSVC_HEALTH_HOST_PORT"] = str(self.health_port)
        self.env["KVSVC_METRICS_HOST_PORT"] = str(self.metrics_port)
        self.passed = self.failed = 0
        self.figures: dict[str, str] = {}
        self.token_file = ""  # the demo's --token-file, from the compose file

    def token(self, cid: str) -> str:
        """The token the stack made (`kvsvc init-auth`), read as a user does."""
        r = self.podman("exec", cid, "cat", self.token_file)
        token = r.stdout.strip()
        if r.returncode != 0 or not token:
            raise Failed(f"cannot read the token {self.token_file}: {r.stderr.strip()[-200:]}")
        return token

    # --- commands ---------------------------------------------------------------
    def compose(
        self, *args: str, timeout: float = 300, log: str = ""
    ) -> subprocess.CompletedProcess[str]:
        argv = [self.compose_bin, "-f", self.file, "-p", self.project, *args]
        r = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if log:
            (self.logs / log).write_text(f"$ {' '.join(argv)}\n{r.stdout}{r.stderr}")
        return r

    def podman(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    def inspect(self, cid: str) -> dict[str, Any]:
        r = self.podman("inspect", "--type", "container", cid)
        if r.returncode != 0:
            raise Failed(f"podman inspect {cid}: {r.stderr.strip()}")
        info: dict[str, Any] = json.loads(r.stdout)[0]
        return info

    def container(self, service: str, oneoff: bool = False) -> str | None:
        r = self.podman(
            "ps", "-a", "-q", "--no-trunc",
            "--filter", f"label=com.docker.compose.project={self.project}",
            "--filter", f"label=com.docker.compose.service={service}",
            "--filter", f"label=com.docker.compose.oneoff={'True' if oneoff else 'False'}",
        )  # fmt: skip
        ids = r.stdout.split()
        return ids[0] if len(ids) == 1 else None

    def health(self, cid: str) -> dict[str, Any]:
        state = self.inspect(cid)["State"]
        h = state.get("Health") or state.get("Healthcheck") or {}
        return dict(h)

    def wait_health(self, cid: str, want: str, timeout: float) -> float:
        """Seconds until the container's health status is ``want`` (it must keep
        running meanwhile: an exited container stays 'starting' for good)."""
        t0 = time.monotonic()
        while True:
            state = self.inspect(cid)["State"]
            status = (state.get("Health") or state.get("Healthcheck") or {}).get("Status")
            if status == want:
                return time.monotonic() - t0
            if not state.get("Running"):
                tail = self.podman("logs", "--tail", "5", cid)
                raise Failed(
                    f"container {cid[:12]} exited ({state.get('ExitCode')}) before it was "
                    f"{want}: {(tail.stdout + tail.stderr).strip()[-600:]}"
                )
            if time.monotonic() - t0 > timeout:
                raise Failed(f"container {cid[:12]} still {status!r} after {timeout:.0f} s")
            time.sleep(0.5)

    # --- the tally ----------------------------------------------------------------
    def check(self, ok: bool, what: str, detail: object = "") -> bool:
        if ok:
            self.passed += 1
            print(f"ok: {what}", flush=True)
        else:
            self.failed += 1
            print(f"FAIL: {what}" + (f": {detail}" if detail != "" else ""), flush=True)
        return ok

    def figure(self, name: str, value: str) -> None:
        self.figures[name] = value
        print(f"figure: {name}: {value}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def epoch(stamp: str) -> float:
    """podman's RFC 3339 times (nanoseconds, Z or an offset) as epoch seconds."""
    m = re.match(r"(.*T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", stamp)
    if not m:
        raise Failed(f"unreadable time {stamp!r}")
    base, frac, zone = m.groups()
    dt = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone))
    return dt.timestamp() + float(f"0.{frac or 0}")


def stack_services(run: Run) -> tuple[str, str, str, float, list[str]]:
    """(server, demo, the condition the demo waits for, the server's stop grace in
    seconds, one service to build per image) from the compose file: the demo is the
    service that runs `kvsvc demo`, the server the one of the image built here that
    it depends on."""
    r = run.compose("config", "--format", "json")
    if r.returncode != 0:
        raise Failed(f"compose config: {r.stderr.strip()}")
    services: dict[str, Any] = json.loads(r.stdout)["services"]
    deps = [
        (server, name, str(dep.get("condition")))
        for name, svc in services.items()
        if (svc.get("command") or [""])[0] == "demo"
        for server, dep in (svc.get("depends_on") or {}).items()
        if services[server].get("build")
    ]
    if len(deps) != 1:
        raise Failed(f"expected one demo service waiting for one kvsvc server, found {deps}")
    server, demo, condition = deps[0]
    demo_argv = [str(a) for a in services[demo]["command"]]
    if "--token-file" not in demo_argv:
        raise Failed(f"the {demo} service has no --token-file: {demo_argv}")
    run.token_file = demo_argv[demo_argv.index("--token-file") + 1]
    grace = parse_duration(str(services[server].get("stop_grace_period", "10s")))
    # Services sharing an image share its build: building each would hash the
    # image's 1 GB venv again for the cache check (about 20 s apiece here).
    builds = {svc.get("image", name): name for name, svc in services.items() if svc.get("build")}
    return server, demo, condition, grace, sorted(builds.values())


@contextmanager
def health_history(run: Run, service: str) -> Iterator[list[dict[str, Any]]]:
    """Every health check of ``service``'s container while the block runs (podman
    keeps only the last five in its state)."""
    seen: dict[str, dict[str, Any]] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(1.0):
            cid = run.container(service)
            if cid is None:
                continue
            try:
                for entry in run.health(cid).get("Log") or []:
                    seen[entry["Start"]] = entry
            except Failed:
                continue  # removed between ps and inspect; the next round sees the new one

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    history: list[dict[str, Any]] = []
    try:
        yield history
    finally:
        stop.set()
        thread.join(30)
        history.extend(sorted(seen.values(), key=lambda e: epoch(e["Start"])))


# --- the three stacks ------------------------------------------------------------------
def build(run: Run, build_args: list[str], services: list[str]) -> None:
    argv = ["build"]
    for arg in build_args:
        argv += ["--build-arg", arg]
    argv += services
    image = run.env["KVSVC_IMAGE"]
    before = run.podman("image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
    t0 = time.monotonic()
    r = run.compose(*argv, timeout=1800, log="build.log")
    if not run.check(r.returncode == 0, "docker/Dockerfile builds", f"see {run.logs}/build.log"):
        raise Failed("the image did not build")
    run.figure(f"build (compose build {' '.join(services)})", f"{time.monotonic() - t0:.1f} s")
    after = run.podman("image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
    if before and before != after:
        # The image this build replaced (over 1 GB, now untagged): not kept as cache.
        run.podman("rmi", before)
    size = run.podman("image", "inspect", "--format", "{{.Size}}", run.env["KVSVC_IMAGE"])
    run.figure("image size", f"{int(size.stdout.strip()) / 1e6:.0f} MB")


def demo_stack(run: Run, server: str, demo: str) -> None:
    print(f"== 1. up --exit-code-from {demo}", flush=True)
    t0 = time.time()
    with health_history(run, server) as history:
        r = run.compose("up", "--exit-code-from", demo, timeout=600, log="up-demo.log")
    run.check(r.returncode == 0, f"`up --exit-code-from {demo}` exits 0", f"rc {r.returncode}")
    server_id, demo_id = run.container(server), run.container(demo)
    if server_id is None or demo_id is None:
        raise Failed(f"containers not found: {server}={server_id}, {demo}={demo_id}")
    d, s = run.inspect(demo_id), run.inspect(server_id)
    run.check(d["State"]["ExitCode"] == 0, f"{demo} exits 0", d["State"]["ExitCode"])
    out = run.podman("logs", demo_id).stdout
    (run.logs / "demo.log").write_text(out)
    run.check(
        re.search(r"^verify bit-exact\s+identical\b", out, re.M) is not None
        and re.search(r"^demo: OK$", out, re.M) is not None,
        f"{demo} stored, retrieved and verified bit-exact through the server",
        f"see {run.logs}/demo.log",
    )
    passes = [e for e in history if e["ExitCode"] == 0]
    if run.check(bool(passes), f"{server}'s image health check passed", history[-3:]):
        healthy_at = epoch(passes[0]["End"])
        demo_started = epoch(d["State"]["StartedAt"])
        run.check(
            demo_started > healthy_at,
            f"{demo} started after {server}'s first passing health check (service_healthy)",
            f"{demo} started {healthy_at - demo_started:.2f} s before",
        )
        run.figure("up -> healthy (compose up, cached image)", f"{healthy_at - t0:.1f} s")
        failing = [e for e in history if epoch(e["End"]) <= healthy_at and e["ExitCode"] != 0]
        print(f"   ({len(failing)} failing check(s) while the server started)")
    run.check(
        s["State"]["ExitCode"] == 0,
        f"{server} exits 0 when compose stops it after the demo",
        s["State"]["ExitCode"],
    )
    down(run, "down-demo.log")


def down(run: Run, log: str) -> float:
    """compose down; 'network is being used' right after up needs a second one."""
    t0 = time.monotonic()
    r = run.compose("down", "-v", "--remove-orphans", log=log)  # the services' own grace
    if r.returncode != 0:
        print(f"   compose down failed once ({r.stderr.strip()[-200:]}); again")
        r = run.compose("down", "-v", "--remove-orphans", log="again-" + log)
    run.check(r.returncode == 0, "compose down", r.stderr.strip()[-300:])
    return time.monotonic() - t0


def server_stack(run: Run, server: str, grace: float) -> None:
    print(f"== 2. up -d {server}", flush=True)
    t0 = time.monotonic()
    r = run.compose("up", "-d", server, log="up-server.log")
    if not run.check(r.returncode == 0, f"`up -d {server}`", r.stderr.strip()[-300:]):
        raise Failed("the server did not start")
    cid = run.container(server)
    if cid is None:
        raise Failed(f"no container for {server}")
    run.wait_health(cid, "healthy", 240)
    run.figure("up -d -> healthy (server only)", f"{time.monotonic() - t0:.1f} s")
    logs = run.podman("logs", cid)
    start = [x for x in (logs.stdout + logs.stderr).splitlines() if "serving on" in x]
    run.check(
        bool(start) and "copy loop native:" in start[0],
        "the image's server copies with the native loop its package build made",
        start[:1] or "no start line",
    )

    hc = run.podman("healthcheck", "run", cid, timeout=60)
    run.check(
        hc.returncode == 0 and run.health(cid).get("Status") == "healthy",
        "the image's health check, run now, passes",
        (hc.returncode, hc.stdout + hc.stderr),
    )
    for service in (SERVICE_NAME, ""):
        code, line = probe(f"127.0.0.1:{run.health_port}", service, 5.0, 5.0)
        run.check(
            code == SERVING,
            f"gRPC health from the host for {service!r}, no credentials: SERVING",
            line,
        )
    try:
        with KVCacheClient(f"127.0.0.1:{run.grpc_port}") as client:
            client.server_info(timeout=30)
        run.check(False, "a call from the host without a token is refused", "it answered")
    except Unauthenticated as exc:
        run.check(True, f"a call from the host without a token is refused UNAUTHENTICATED [{exc}]")
    except KVServiceError as exc:
        run.check(False, "a call from the host without a token is refused UNAUTHENTICATED", exc)
    with KVCacheClient(f"127.0.0.1:{run.grpc_port}", token=run.token(cid)) as client:
        stored = client.put("ci", [(b"token-key", b"x" * 4096)], timeout=30)
    run.check(stored.stored_chunks == 1, "a Put from the host with the stack's token", stored)
    # What init-auth left in the auth volume: the tenant file and the token, each
    # readable by the server's uid only, the token >= 128 random bits (base64url).
    auth_dir = os.path.dirname(run.token_file)
    listing = run.podman("exec", cid, "find", auth_dir, "-type", "f", "-printf", "%m %U %f\n")
    files = sorted(line.split() for line in listing.stdout.splitlines())
    server_uid = (
        run.podman("image", "inspect", "--format", "{{.Config.User}}", run.env["KVSVC_IMAGE"])
        .stdout.strip()
        .split(":")[0]
    )
    run.check(
        len(files) == 2
        and all(mode in ("600", "640") and owner == server_uid for mode, owner, _ in files)
        and len(run.token(cid)) >= 22,
        f"the auth volume holds a tenant file and a token, 0600/0640, owned by {server_uid}",
        (files, listing.stderr.strip()),
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10) as resp:
        run.check(b"kvsvc_" in resp.read(), "metrics answer on the published port")

    info = run.inspect(cid)
    bindings = {
        port: [(b["HostIp"], b["HostPort"]) for b in (binds or [])]
        for port, binds in (info["NetworkSettings"].get("Ports") or {}).items()
    }
    published = [hb for binds in bindings.values() for hb in binds]
    run.check(
        {f"{GRPC_PORT}/tcp", f"{HEALTH_PORT}/tcp", f"{METRICS_PORT}/tcp"} <= set(bindings)
        and bool(published)
        and all(ip == "127.0.0.1" for ip, _ in published),
        "ports are published on 127.0.0.1 only",
        bindings,
    )
    for ip in host_addresses():
        for port in (run.grpc_port, run.health_port, run.metrics_port):
            run.check(not connects(ip, port), f"nothing answers on {ip}:{port}")

    image_user = run.podman(
        "image", "inspect", "--format", "{{.Config.User}}", run.env["KVSVC_IMAGE"]
    ).stdout.strip()
    uid = image_user.split(":")[0]
    status = Path(f"/proc/{info['State']['Pid']}/status").read_text()
    uids = re.search(r"^Uid:\s+(.*)$", status, re.M)
    run.check(
        uid not in ("", "0", "root") and uids is not None and set(uids[1].split()) == {uid},
        f"the server process runs as the image's non-root uid {uid} (real, effective, saved, fs)",
        uids[1] if uids else status[:200],
    )
    who = run.podman("exec", cid, "id", "-u")
    run.check(who.stdout.strip() == uid, f"podman exec runs as {uid}", who.stdout + who.stderr)
    run.check(info["HostConfig"].get("ReadonlyRootfs") is True, "ReadonlyRootfs is set")
    # As uid 0, and only EROFS counts: a permission error is not a read-only root.
    w = run.podman("exec", "--user", "0", cid, "touch", "/.kvsvc-rw-probe")
    run.check(
        w.returncode != 0 and "Read-only file system" in w.stderr,
        "the root filesystem refuses a write, even from uid 0",
        (w.returncode, w.stderr.strip()),
    )
    t = run.podman("exec", cid, "touch", "/tmp/.kvsvc-rw-probe")
    run.check(t.returncode == 0, "/tmp (tmpfs) is writable", t.stderr.strip())

    # stop, then down: the server must get SIGTERM, drain, and exit 0 long before the
    # grace ends. Its log is read once it has exited: `podman logs --follow` can end
    # at the exit before it has read the last lines.
    since = time.time()
    t0 = time.monotonic()
    r = run.compose("stop", server, log="stop-server.log")
    run.check(r.returncode == 0, f"compose stop {server}", r.stderr.strip()[-300:])
    run.figure("compose stop (server only)", f"{time.monotonic() - t0:.1f} s")
    logs = run.podman("logs", cid)
    out = logs.stdout + logs.stderr
    (run.logs / "server-down.log").write_text(out)
    down(run, "down-server.log")
    messages = [rec.get("msg", "") for rec in json_lines(out)]
    run.check(
        any(m.startswith("signal received") for m in messages) and "stopped" in messages,
        "the server logged the signal, drained and stopped",
        messages[-3:],
    )
    died = [e for e in events(run, since) if e.get("Status") == "died" and e.get("ID") == cid]
    if run.check(len(died) == 1, "one 'died' event for the server", len(died)):
        stopped_in = epoch(died[0]["Time"]) - since
        # podman leaves the field out when it is 0 (omitempty); SIGKILL would be 137.
        code = died[0].get("ContainerExitCode", 0)
        run.check(code == 0, "the server exits 0 on stop", died[0])
        # Ignoring SIGTERM would mean the full grace, then SIGKILL (137); a loaded
        # host adds seconds to podman's stop and the interpreter's exit.
        run.check(
            stopped_in < grace * 2 / 3,
            f"the server exited {stopped_in:.1f} s into stop, within 2/3 of its {grace:g} s grace",
        )
        run.figure("stop -> server exited", f"{stopped_in:.1f} s (grace {grace:g} s)")


def failpoint_stack(run: Run, server: str) -> None:
    print(f"== 3. run {server} with {FAILPOINT}", flush=True)
    r = run.compose(
        "run", "-d", "--service-ports", "-e", f"KVSVC_FAILPOINTS={FAILPOINT}", server,
        log="run-failpoint.log",
    )  # fmt: skip
    cid = run.container(server, oneoff=True)
    if not run.check(r.returncode == 0 and cid is not None, f"`run -d {server}`", r.stderr[-300:]):
        raise Failed("the failpoint server did not start")
    assert cid is not None
    run.wait_health(cid, "healthy", 240)
    target = f"127.0.0.1:{run.grpc_port}"
    try:
        with KVCacheClient(target, token=run.token(cid)) as client:
            client.put("ci", [(b"fatal", bytes(4096))], timeout=30)
        run.check(
            False, "a Put through the failing copy path raises FatalServerError", "it succeeded"
        )
    except FatalServerError as exc:
        run.check(
            True, f"a Put through the failing copy path raises FatalServerError [{exc.reason}]"
        )
    except KVServiceError as exc:
        run.check(False, "a Put through the failing copy path raises FatalServerError", repr(exc))
    code, line = probe(f"127.0.0.1:{run.health_port}", SERVICE_NAME, 5.0, 5.0)
    run.check(code == UNHEALTHY, "gRPC health from the host: NOT_SERVING", line)
    # podman 4.3 ignores failing checks for the whole --start-period (60 s from the
    # container's start); Docker counts them once one check has passed.
    took = run.wait_health(cid, "unhealthy", 240)
    run.figure("fatal failure -> unhealthy", f"{took:.1f} s")
    hc = run.podman("healthcheck", "run", cid, timeout=60)
    run.check(
        hc.returncode != 0 and hc.stdout.strip() == "unhealthy",
        "the image's health check, run now, says unhealthy",
        (hc.returncode, hc.stdout + hc.stderr),
    )
    run.podman("rm", "-f", "-t", "30", cid, timeout=90)
    down(run, "down-failpoint.log")


def redis_stack(run: Run, server: str) -> None:
    """The shared tier: one node stores, a second node (a fresh process with an
    empty store) reads it back from Redis, bit-exact."""
    print(f"== 4. --profile redis: {server} + redis, then a second {server} node", flush=True)
    run.env["KVSVC_REMOTE"] = "redis://redis:6379"
    profile = ("--profile", "redis")
    try:
        r = run.compose(*profile, "up", "-d", server, "redis", log="up-redis.log")
        node1 = run.container(server)
        if not run.check(r.returncode == 0 and node1 is not None, f"`up -d {server} redis`"):
            raise Failed(f"the redis stack did not start: {r.stderr.strip()[-300:]}")
        assert node1 is not None
        run.wait_health(node1, "healthy", 240)
        port2 = free_port()
        r = run.compose(
            # Its own socket dir (none): node 1 owns the shared volume's sockets.
            *profile, "run", "-d", "--publish", f"127.0.0.1:{port2}:{GRPC_PORT}",
            "-e", "KVSVC_SOCKET_DIR=", server,
            log="run-node2.log",
        )  # fmt: skip
        node2 = run.container(server, oneoff=True)
        if not run.check(r.returncode == 0 and node2 is not None, f"a second {server} node"):
            raise Failed(f"the second node did not start: {r.stderr.strip()[-300:]}")
        assert node2 is not None
        run.wait_health(node2, "healthy", 240)

        key, data = b"ci-redis-key", os.urandom(256 << 10)
        token = run.token(node1)  # both nodes read the one tenant file in the volume
        with KVCacheClient(f"127.0.0.1:{run.grpc_port}", token=token) as one:
            stored = one.put("ci", [(key, data)], timeout=30)
        run.check(stored.stored_chunks == 1, "node 1 stored the chunk", stored)
        # Node 1 writes to Redis behind its reply: node 2 may miss it for a moment.
        got, t0, last = b"", time.monotonic(), None
        with KVCacheClient(f"127.0.0.1:{port2}", token=token) as two:
            while time.monotonic() - t0 < 60:
                try:
                    got = two.get("ci", key, timeout=30)
                    break
                except KVServiceError as exc:
                    last = exc
                    time.sleep(1)
            else:
                run.check(False, "node 2 reads the chunk node 1 stored", repr(last))
                return
        run.check(got == data, "node 2 reads, from Redis, what node 1 stored, bit-exact")
        run.figure("node 1 Put -> node 2 Get hit", f"{time.monotonic() - t0:.1f} s")
    finally:
        run.podman("rm", "-f", "-t", "30", *filter(None, [run.container(server, oneoff=True)]))
        r = run.compose(*profile, "down", "-v", "--remove-orphans", log="down-redis.log")
        run.check(r.returncode == 0, "compose --profile redis down", r.stderr.strip()[-300:])
        del run.env["KVSVC_REMOTE"]


def json_lines(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec


def events(run: Run, since: float) -> list[dict[str, Any]]:
    r = run.podman(
        "events", "--since", f"{since - 1:.0f}", "--until", f"{time.time() + 1:.0f}",
        "--filter", "type=container", "--format", "json",
    )  # fmt: skip
    return list(json_lines(r.stdout))


def host_addresses() -> list[str]:
    """The host's non-loopback IPv4 addresses."""
    r = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=False
    )
    addrs = re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", r.stdout)
    return [a for a in addrs if not a.startswith("127.")]


def connects(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=3):
            return True
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compose", required=True, help="the Compose v2 binary")
    p.add_argument("--file", default="docker/compose.yaml")
    p.add_argument(
        "--project", required=True, help="compose project name (everything is labelled with it)"
    )
    p.add_argument("--image", required=True, help="image name for KVSVC_IMAGE")
    p.add_argument("--redis-image", default="", help="KVSVC_REDIS_IMAGE (empty: no redis run)")
    p.add_argument("--logs", required=True, help="folder for the command logs")
    p.add_argument("--build-arg", action="append", default=[], dest="build_args")
    p.add_argument(
        "--health-services", action="store_true", help="print the gated service and exit"
    )
    args = p.parse_args()
    run = Run(args)
    try:
        server, demo, condition, grace, builds = stack_services(run)
        if args.health_services:
            print(server)
            return 0
        print(
            f"test-container: server service {server!r}, demo service {demo!r}, grace {grace:g} s"
        )
        run.check(
            condition == "service_healthy", f"{demo} waits for {server}: service_healthy", condition
        )
        build(run, args.build_args, builds)
        demo_stack(run, server, demo)
        server_stack(run, server, grace)
        failpoint_stack(run, server)
        if args.redis_image:
            redis_stack(run, server)
    except (Failed, subprocess.TimeoutExpired) as exc:
        run.check(False, "the run went on to the end", exc)
    print(f"test-container: {run.passed} passed, {run.failed} failed")
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
