"""Runs, outside Docker, the commands that docker/Dockerfile and docker/compose.yaml
run inside containers, taken from those files (not copied into this test):

- the kvsvc service's command (image ENTRYPOINT + CMD, or compose's override) with
  the image's ENV and the service's environment, except that it listens on
  127.0.0.1 and free ports and maps regions from a temporary directory;
- the image's HEALTHCHECK, with the same address and service name;
- a scrape of the metrics port the image turns on;
- the demo service's command, with its --target pointed at the local server
  (skipped until ``kvsvc demo`` exists);
- SIGTERM, after which the server must exit 0.

It also checks that the image, the compose file and the Kubernetes manifests
agree with each other and with the server's settings (ports, health service
names, KVSVC_* names, memory arithmetic). No Docker engine is needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from kvsvc.cli.healthprobe import SERVING, probe
from kvsvc.server.config import (
    SETTINGS,
    ServerConfig,
    check_security,
    env_name,
    is_local_address,
    parse_server_config,
    read_token_file,
)
from kvsvc.server.config.host import metrics_address
from kvsvc.server.ops.health import SERVICE_NAME
from kvsvc.server.security.auth import TOKEN_FILE_NAME

pytestmark = pytest.mark.slow  # starts servers or subprocesses

try:
    import yaml
except ImportError as exc:  # pragma: no cover - a missing test dependency
    raise ImportError(
        "tests/e2e/test_container_commands.py needs PyYAML to read compose.yaml and the "
        "Kubernetes manifests: pip install pyyaml (scripts/check_deploy.sh installs it)"
    ) from exc

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = ROOT / "deploy" / "kubernetes"
SERVER_SERVICE = "kvsvc"
DEMO_SERVICE = "demo"
VENV_BIN = Path(sys.executable).parent  # stands in for the image's /opt/kvsvc/bin
KNOWN_ENV = {env_name(f) for f in SETTINGS}

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
DEMO_TIMEOUT_S = 240.0


# --- reading the Dockerfile ------------------------------------------------------
@dataclass
class Stage:
    name: str | None
    parent: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Image:
    """The configuration the final stage of a Dockerfile gives its image."""

    env: dict[str, str]
    entrypoint: list[str] | None
    cmd: list[str] | None
    healthcheck: list[str] | None
    healthcheck_options: dict[str, str]
    user: str | None
    exposed: set[int]


def _logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined; comments dropped."""
    lines: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            lines.append(buf.strip())
        buf = ""
    if buf.strip():
        lines.append(buf.strip())
    return lines


def parse_stages(text: str) -> list[Stage]:
    stages: list[Stage] = []
    for line in _logical_lines(text):
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(name=name, parent=parts[0]))
        elif stages:
            stages[-1].instructions.append((word, rest))
    return stages


def _expand(value: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return env.get(name, m.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, value)


def _exec_form(rest: str, what: str) -> list[str]:
    # Exec form only: in shell form /bin/sh is PID 1 and SIGTERM never reaches kvsvc.
    assert rest.startswith("["), f"{what} must use the exec (JSON) form, got {rest!r}"
    argv = json.loads(rest)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), rest
    return argv


def image_config(text: str) -> Image:
    stages = parse_stages(text)
    assert stages, "no FROM in the Dockerfile"
    by_name = {s.name: s for s in stages if s.name}
    chain = [stages[-1]]
    while chain[-1].parent in by_name:  # FROM <earlier stage>: its config carries over
        chain.append(by_name[chain[-1].parent])
    img = Image({}, None, None, None, {}, None, set())
    for stage in reversed(chain):
        for word, rest in stage.instructions:
            if word == "ENV":
                tokens = shlex.split(rest)
                if tokens and "=" not in tokens[0]:  # legacy "ENV KEY value"
                    tokens = [f"{tokens[0]}={' '.join(tokens[1:])}"]
                for tok in tokens:
                    key, _, value = tok.partition("=")
                    img.env[key] = _expand(value, img.env)
            elif word == "ENTRYPOINT":
                img.entrypoint = _exec_form(rest, "ENTRYPOINT")
                img.cmd = None  # Docker resets an inherited CMD when ENTRYPOINT is set
            elif word == "CMD":
                img.cmd = _exec_form(rest, "CMD")
            elif word == "USER":
                img.user = rest
            elif word == "EXPOSE":
                img.exposed |= {int(p.split("/")[0]) for p in rest.split()}
            elif word == "HEALTHCHECK":
                tokens = rest.split(" ")
                options = {}
                while tokens and tokens[0].startswith("--"):
                    key, _, value = tokens.pop(0)[2:].partition("=")
                    options[key] = value
                    while tokens and not tokens[0]:
                        tokens.pop(0)
                assert tokens and tokens[0].upper() == "CMD", f"HEALTHCHECK {rest!r}"
                img.healthcheck = _exec_form(" ".join(tokens[1:]).strip(), "HEALTHCHECK CMD")
                img.healthcheck_options = options
    return img


# --- reading compose.yaml --------------------------------------------------------
def _as_argv(value: object) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value)
    assert isinstance(value, list), value
    return [str(v) for v in value]


def service_argv(image: Image, service: dict) -> list[str]:
    """What Docker runs for a compose service: entrypoint + command, with compose's
    entrypoint/command replacing the image's (a new entrypoint drops the image CMD)."""
    if "entrypoint" in service:
        return _as_argv(service["entrypoint"]) + _as_argv(service.get("command", []))
    command = _as_argv(service["command"]) if "command" in service else image.cmd or []
    return (image.entrypoint or []) + command


def service_env(image: Image, service: dict) -> dict[str, str]:
    env = dict(image.env)
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    env.update({k: "" if v is None else compose_default(str(v)) for k, v in environment.items()})
    return env


def compose_default(value: str) -> str:
    """A value as compose interpolates it where none of its variables is set (as in
    CI): ${VAR:-default} and ${VAR-default} give the default, ${VAR} nothing."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


# --- health, as grpc_health_probe does it ---------------------------------------
def probe_flags(argv: list[str]) -> dict[str, str]:
    """grpc_health_probe's -name=value flags."""
    flags = {}
    for arg in argv[1:]:
        assert arg.startswith("-") and "=" in arg, f"unexpected probe argument {arg!r}"
        key, _, value = arg.lstrip("-").partition("=")
        flags[key] = value
    return flags


def health_probe(addr: str, service: str, connect_timeout: float = 1.0, rpc_timeout: float = 1.0):
    """grpc_health_probe's semantics (its defaults: -connect-timeout=1s,
    -rpc-timeout=1s): success iff grpc.health.v1.Health/Check for `service`
    answers SERVING. grpc_health_probe is a Go binary fetched from GitHub, which
    cannot be installed here; kvsvc.cli.healthprobe (the image's probe where that
    download fails) makes the same call."""
    return probe(addr, service, connect_timeout, rpc_timeout)[0] == SERVING


# --- helpers ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def k8s_quantity(q: str | int) -> int:
    """Bytes from a Kubernetes quantity such as 10Gi, 512Mi, 1G or 1024."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    units |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(q))
    assert m and (not m.group(2) or m.group(2) in units), f"not a quantity: {q!r}"
    return int(float(m.group(1)) * units.get(m.group(2), 1))


def base_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without KVSVC_* settings, plus the container's
    variables; the image's PATH (/opt/kvsvc/bin first) becomes the venv's bin."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    env.update({k: v for k, v in extra.items() if k != "PATH"})
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return env


@contextlib.contextmanager
def only_kvsvc_env(env: dict[str, str]) -> Iterator[None]:
    """os.environ with exactly the KVSVC_* variables of `env`, for the duration."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVSVC_")}
    for k in saved:
        del os.environ[k]
    os.environ.update({k: v for k, v in env.items() if k.startswith("KVSVC_")})
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("KVSVC_")]:
            del os.environ[k]
        os.environ.update(saved)


def check_security_offline(config: ServerConfig) -> None:
    """check_security, with the files the container mounts (a volume, a Secret)
    stood in for by a readable file here."""
    files = ("auth_token_file", "tls_cert", "tls_key", "tls_client_ca")
    with tempfile.NamedTemporaryFile() as stand_in:
        check_security(
            config.replace(**{f: stand_in.name for f in files if getattr(config.security, f)})
        )


def config_from_env(env: dict[str, str]) -> ServerConfig:
    """The ServerConfig `kvsvc serve` builds from these KVSVC_* variables alone."""
    with only_kvsvc_env(env):
        return parse_server_config([])


def resolve(argv: list[str], env: dict[str, str]) -> list[str]:
    exe = shutil.which(argv[0], path=env["PATH"])
    assert exe, f"{argv[0]!r} (the container's command) is not on PATH"
    return [exe, *argv[1:]]


IMAGE = image_config((DOCKER / "Dockerfile").read_text())
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def _demo_available() -> bool:
    argv = service_argv(IMAGE, SERVICES[DEMO_SERVICE])
    env = base_env({})
    exe = shutil.which(argv[0], path=env["PATH"])
    if exe is None or len(argv) < 2:
        return False
    try:
        done = subprocess.run(
            [exe, argv[1], "--help"], env=env, capture_output=True, timeout=60, check=False
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


DEMO_AVAILABLE = _demo_available()


# --- static agreement between the files -------------------------------------------
def test_image_and_compose_agree_with_the_server():
    server_svc = SERVICES[SERVER_SERVICE]
    demo_svc = SERVICES[DEMO_SERVICE]
    env = service_env(IMAGE, server_svc)

    for name in [k for k in env if k.startswith("KVSVC_")]:
        assert name in KNOWN_ENV, f"{name} is not a kvsvc serve setting (typo?)"
    assert IMAGE.user and IMAGE.user.split(":")[0] not in ("0", "root"), IMAGE.user

    config = config_from_env(env)
    check_security_offline(config)  # else `kvsvc serve` refuses to start in the container
    listen_host, listen_port = host_port(config.network.listen)
    assert listen_host == "0.0.0.0", "the container must listen on all its interfaces"
    # ... and so needs credentials: a tenant file, made by `kvsvc init-auth` first.
    assert config.security.auth_token_file and not config.security.allow_insecure
    assert config.security.auth_token_file.startswith("/run/")
    entry = service_argv(IMAGE, server_svc)
    assert entry[:2] == ["sh", "-c"] and entry[2].startswith("kvsvc init-auth && exec kvsvc serve")
    assert config.observability.metrics_port > 0, "metrics must be on in the image"
    # Health only, plaintext, for probes without credentials.
    health_host, health_port = host_port(config.network.health_listen)
    assert health_host == "0.0.0.0" and health_port != listen_port
    assert {listen_port, health_port, config.observability.metrics_port} <= IMAGE.exposed

    # The HEALTHCHECK probes the health-only port, for the server's service name.
    assert IMAGE.healthcheck and IMAGE.healthcheck[0] == "grpc_health_probe"
    flags = probe_flags(IMAGE.healthcheck)
    probe_host, probe_port = host_port(flags["addr"])
    assert probe_host in ("127.0.0.1", "localhost") and probe_port == health_port
    assert flags["service"] == SERVICE_NAME

    # compose: published ports reach the server; the demo targets it, after it is
    # healthy, and shares nothing else with it but the socket volume: no IPC
    # namespace, no /dev/shm. Its memory goes over the fd socket as sealed memfds.
    targets = {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in server_svc["ports"]}
    assert targets == {listen_port, health_port, config.observability.metrics_port}
    assert all(str(p).startswith("127.0.0.1:") for p in server_svc["ports"])
    demo_argv = service_argv(IMAGE, demo_svc)
    target = demo_argv[demo_argv.index("--target") + 1]
    assert host_port(target) == (SERVER_SERVICE, listen_port)
    assert "--memfd" in demo_argv
    # The demo's token: the one init-auth writes beside the server's tenant file.
    token_file = demo_argv[demo_argv.index("--token-file") + 1]
    assert token_file == os.path.join(
        os.path.dirname(config.security.auth_token_file), TOKEN_FILE_NAME
    )
    assert demo_svc["depends_on"][SERVER_SERVICE]["condition"] == "service_healthy"
    for svc in (server_svc, demo_svc):
        assert "ipc" not in svc and "shm_size" not in svc, "only the socket volume is shared"
        assert svc.get("pid") is None and not svc.get("privileged")
    assert config.network.socket_dir, "the server's sockets must be in a shared directory"
    mounts = [
        {str(v).split(":")[1]: str(v).split(":")[0] for v in svc.get("volumes", [])}
        for svc in (server_svc, demo_svc)
    ]
    volume = mounts[0][config.network.socket_dir]
    auth_dir = os.path.dirname(config.security.auth_token_file)
    auth = mounts[0][auth_dir]
    assert mounts[1] == {config.network.socket_dir: volume, auth_dir: auth}, (
        "the demo mounts the socket volume and the token's only"
    )
    assert f"{auth}:{auth_dir}:ro" in demo_svc["volumes"], "the demo reads the token only"
    assert {volume, auth} <= set(COMPOSE["volumes"]), "named volumes, not host paths"
    assert config.data.shm_dir == "/dev/shm"
    # The sockets are 0660 for the server's uid/gid: the demo runs as the same user.
    assert demo_svc.get("user", IMAGE.user) == server_svc.get("user", IMAGE.user)


def k8s_docs(topology: str) -> dict[str, list[dict]]:
    """The manifests of deploy/kubernetes/<topology>, by kind."""
    docs: dict[str, list[dict]] = {}
    for path in sorted((K8S / topology).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                docs.setdefault(doc["kind"], []).append(doc)
    return docs


def pod_env(container: dict, docs: dict[str, list[dict]]) -> dict[str, str]:
    """A container's variables: its envFrom ConfigMaps, then its env."""
    env: dict[str, str] = {}
    maps = {m["metadata"]["name"]: m["data"] for m in docs.get("ConfigMap", [])}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    env.update({e["name"]: str(e["value"]) for e in container.get("env", [])})
    return env


def secret_mount(container: dict, pod: dict, path: str) -> dict:
    """The Secret volume ``path`` is read from, mounted read-only into ``container``."""
    mounts = [
        m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert len(mounts) == 1 and mounts[0].get("readOnly") is True, mounts
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    assert "secret" in volume, f"{path} must come from a Secret, not {volume}"
    return volume


#: Seconds before the health port answers, beside the store (imports, torch's
#: first: a few seconds, a slow node's margin), and per GiB of store touched at start
#: (~0.5 s measured on a loaded 2-core host): deploy/README.md "Probes".
START_S = 30
TOUCH_S_PER_GIB = 1.0


def check_server_container(container: dict, pod: dict, config: ServerConfig) -> None:
    """What every kvsvc server container must be: probes on its port, memory for
    its store, locked down."""
    check_security_offline(config)  # else `kvsvc serve` refuses to start in the pod
    assert not config.security.allow_insecure
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert host_port(config.network.listen)[1] == ports["grpc"]
    # Beyond loopback, credentials: a tenant file from a Secret, read-only.
    if not is_local_address(config.network.listen):
        assert config.security.auth_token_file, (
            "the server listens beyond loopback without a tenant file"
        )
        secret_mount(container, pod, config.security.auth_token_file)
    # The kubelet's gRPC probes call the pod IP on the health-only port, no credentials.
    assert host_port(config.network.health_listen) == ("0.0.0.0", ports["health"])
    # Metrics on the port named metrics (--metrics-listen, or --metrics-port on --listen's host).
    metrics_at = metrics_address(config)
    assert metrics_at is not None and metrics_at[1] == ports["metrics"]
    assert container["readinessProbe"]["grpc"] == {"port": ports["health"], "service": SERVICE_NAME}
    assert container["livenessProbe"]["grpc"].get("service", "") == ""
    assert container["livenessProbe"]["grpc"]["port"] == ports["health"]
    assert container["startupProbe"]["grpc"]["port"] == ports["health"]
    # "" answers SERVING while the disk index rebuilds (only readiness waits), so no
    # restarting probe asks the service's name; the startup probe's budget covers
    # the start before the health port answers: imports, and the store touched whole.
    assert container["startupProbe"]["grpc"].get("service", "") == ""
    startup = container["startupProbe"]
    budget = startup.get("initialDelaySeconds", 0) + (
        startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    )
    assert budget >= START_S + TOUCH_S_PER_GIB * config.data.store_bytes / (1 << 30), budget
    assert pod["terminationGracePeriodSeconds"] > config.limits.shutdown_grace
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc.get("runAsUser", pod["securityContext"].get("runAsUser")) == 10001
    limit = k8s_quantity(container["resources"]["limits"]["memory"])
    request = k8s_quantity(container["resources"]["requests"]["memory"])
    # the store + >= 1 GiB for Python, torch, gRPC messages; requests = limits
    assert limit >= config.data.store_bytes + (1 << 30)
    assert request == limit
    # The socket dir is a volume the engine can share; nothing else is shared.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert config.network.socket_dir in mounts, "the socket dir must be a volume"
    assert not pod.get("hostIPC") and not pod.get("hostPID") and not pod.get("hostNetwork")
    assert not sc.get("privileged")


def test_node_topology_serves_engines_in_other_pods_through_a_host_path():
    docs = k8s_docs("node")
    (configmap,) = docs["ConfigMap"]
    for name in configmap["data"]:
        assert name in KNOWN_ENV, f"ConfigMap key {name} is not a kvsvc serve setting"
    (ds,) = docs["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = config_from_env(pod_env(container, docs))
    check_server_container(container, pod, config)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    host_dir = volumes[mounts[config.network.socket_dir]]["hostPath"]["path"]
    # the init container hands the host directory to the server's uid, 0750
    (init,) = pod["initContainers"]
    assert (
        init["command"][:2] == ["install", "-d"]
        and init["command"][-1] == config.network.socket_dir
    )
    assert init["securityContext"]["capabilities"]["add"] == ["CHOWN", "FOWNER"]
    assert not init["securityContext"].get("privileged")
    (svc,) = docs["Service"]
    assert svc["spec"]["selector"].items() <= ds["spec"]["selector"]["matchLabels"].items()
    ports = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports

    # The example engine: another pod, another uid, the same host directory, the
    # server's group, and nothing else shared.
    (engine,) = k8s_docs("examples")["Deployment"]
    epod = engine["spec"]["template"]["spec"]
    evolumes = {v["name"]: v for v in epod["volumes"] if "hostPath" in v}
    (emount,) = [m for c in epod["containers"] for m in c["volumeMounts"] if m["name"] in evolumes]
    assert evolumes[emount["name"]]["hostPath"]["path"] == host_dir
    assert emount["mountPath"] == config.network.socket_dir
    assert epod["securityContext"]["runAsUser"] != 10001
    assert 10001 in epod["securityContext"]["supplementalGroups"]
    assert not epod.get("hostIPC") and not epod.get("hostPID")
    (ec,) = epod["containers"]
    command = " ".join(ec["command"] + ec["args"])
    assert f"unix:{config.network.socket_dir}/grpc.sock" in command
    # grpc.sock wants a token too: the engine's own, from another Secret than the
    # server's tenant file.
    token_file = re.search(r"--token-file (\S+)", command)
    assert token_file, command
    token_secret = secret_mount(ec, epod, token_file[1])["secret"]["secretName"]
    tenants = secret_mount(container, pod, config.security.auth_token_file)["secret"]["secretName"]
    assert token_secret != tenants


def sidecar_pod(topology: str) -> tuple[dict, dict, dict, ServerConfig]:
    (dep,) = k8s_docs(topology)["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (server,) = pod["initContainers"]
    (engine,) = pod["containers"]
    assert server["restartPolicy"] == "Always", "a native sidecar: starts first, stops last"
    return pod, server, engine, config_from_env(pod_env(server, {}))


def _settings(text: str) -> str:
    """A manifest's text without its comments."""
    return "\n".join(
        line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#")
    )


def test_no_manifest_allows_insecure():
    """Secure by default: the image, compose and every Kubernetes manifest serve
    beyond loopback only with credentials, never through --allow-insecure."""
    files = [DOCKER / "Dockerfile", DOCKER / "compose.yaml", *sorted(K8S.glob("*/*.yaml"))]
    assert len(files) > 8
    for path in files:
        found = re.findall(r"ALLOW_INSECURE|allow[-_]insecure", _settings(path.read_text()), re.I)
        assert not found, f"{path.relative_to(ROOT)} sets {found[0]}"
    assert "KVSVC_ALLOW_INSECURE" not in IMAGE.env
    for svc in SERVICES.values():
        assert "KVSVC_ALLOW_INSECURE" not in service_env(IMAGE, svc)


def test_sidecar_topology_shares_only_a_socket_volume():
    pod, server, engine, config = sidecar_pod("sidecar")
    check_server_container(server, pod, config)
    volumes = {v["name"]: v for v in pod["volumes"]}
    smounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    emounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    sockets = smounts[config.network.socket_dir]
    assert "emptyDir" in volumes[sockets]
    assert emounts[sockets] == config.network.socket_dir
    shared = set(smounts.values()) & set(emounts)
    assert shared == {sockets}, f"server and engine share {shared}, not only the sockets"
    assert pod["securityContext"]["fsGroup"] == 10001  # the group that may connect
    assert engine["securityContext"]["runAsUser"] != 10001
    assert not pod.get("shareProcessNamespace")


def test_gpu_topology_says_what_cuda_ipc_needs():
    pod, server, engine, config = sidecar_pod("gpu")
    check_server_container(server, pod, config)
    assert config.data.device == "cuda"
    assert server["image"].endswith(":cuda")
    # (1) one GPU seen by both, (2) one PID namespace, (3) one /dev/shm
    (claim,) = pod["resourceClaims"]
    for c in (server, engine):
        assert {"name": claim["name"]} in c["resources"]["claims"]
        assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    assert pod["shareProcessNamespace"] is True
    (template,) = k8s_docs("gpu")["ResourceClaimTemplate"]
    assert template["metadata"]["name"] == claim["resourceClaimTemplateName"]
    text = (K8S / "gpu" / "deployment.yaml").read_text()
    assert "nvidia.com/gpu" in text and "BASE_IMAGE=nvidia/cuda" in text


# --- the container commands, run here ---------------------------------------------
@dataclass
class RunningServer:
    proc: subprocess.Popen
    addr: str
    health_addr: str
    metrics_url: str
    shm_dir: str
    env: dict[str, str]
    log: Path

    @property
    def token_file(self) -> str:
        return str(Path(self.env["KVSVC_AUTH_TOKEN_FILE"]).with_name(TOKEN_FILE_NAME))

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def _terminate(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise
    return proc.returncode


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory):
    svc = SERVICES[SERVER_SERVICE]
    container_env = service_env(IMAGE, svc)
    _, health_container_port = host_port(container_env["KVSVC_HEALTH_LISTEN"])
    port, metrics_port, health_port = free_port(), free_port(), free_port()
    shm_root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    shm_dir = tempfile.mkdtemp(prefix="kvsvc-test-", dir=shm_root)
    env = base_env(container_env)
    env.update(
        KVSVC_LISTEN=f"127.0.0.1:{port}",
        KVSVC_HEALTH_LISTEN=f"127.0.0.1:{health_port}",
        KVSVC_METRICS_PORT=str(metrics_port),
        KVSVC_SHM_DIR=shm_dir,
    )
    # The auth volume's mount point, here an empty directory of ours (0700).
    auth_dir = tmp_path_factory.mktemp("auth")
    auth_dir.chmod(0o700)
    env["KVSVC_AUTH_TOKEN_FILE"] = str(auth_dir / Path(container_env["KVSVC_AUTH_TOKEN_FILE"]).name)
    if env.get("KVSVC_SOCKET_DIR"):  # the volume's mount point, here a directory of ours
        env["KVSVC_SOCKET_DIR"] = str(tmp_path_factory.mktemp("sockets") / "run-kvsvc")
    argv = resolve(service_argv(IMAGE, svc), env)
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    # The HEALTHCHECK's address, with the container port mapped to the local one.
    probe_host, probe_port = host_port(probe_flags(IMAGE.healthcheck or ["-"])["addr"])
    assert probe_port == health_container_port
    running = RunningServer(
        proc=proc,
        addr=f"127.0.0.1:{port}",
        health_addr=f"{probe_host}:{health_port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        shm_dir=shm_dir,
        env=env,
        log=log,
    )
    try:
        wait_healthy(running)
        yield running
    finally:
        try:
            _terminate(proc)
        finally:
            shutil.rmtree(shm_dir, ignore_errors=True)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def wait_healthy(srv: RunningServer) -> None:
    """Run the HEALTHCHECK until it passes, as Docker does during --start-period."""
    service = probe_flags(IMAGE.healthcheck or [])["service"]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not health_probe(srv.health_addr, service):
        assert srv.proc.poll() is None, f"server exited {srv.proc.returncode}:\n{srv.output()}"
        assert time.monotonic() < deadline, f"not SERVING in {START_TIMEOUT_S}s:\n{srv.output()}"
        time.sleep(0.25)


def test_healthcheck_semantics(kv_server):
    flags = probe_flags(IMAGE.healthcheck or [])
    assert health_probe(kv_server.health_addr, flags["service"])
    assert health_probe(kv_server.health_addr, "")  # what the Kubernetes liveness probe asks
    # The probe can fail: a service the server does not know is not SERVING, and
    # nothing listens on a free port.
    assert not health_probe(kv_server.health_addr, "no.such.Service")
    host, _ = host_port(kv_server.health_addr)
    assert not health_probe(f"{host}:{free_port()}", flags["service"])


def test_metrics_endpoint(kv_server):
    from kvsvc.v1 import kv_cache_service_pb2 as pb
    from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

    token = read_token_file(kv_server.token_file)
    with grpc.insecure_channel(kv_server.addr) as channel:
        info = pb_grpc.KVCacheServiceStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {token}"),)
        )
    assert info.WhichOneof("outcome") != "error", info
    samples = scrape(kv_server.metrics_url)
    store_bytes = config_from_env(kv_server.env).data.store_bytes
    assert samples["kvsvc_store_capacity_bytes"] >= store_bytes  # aligned up to 4 KiB
    assert samples["kvsvc_store_capacity_bytes"] == info.result.capacity_bytes
    assert samples["kvsvc_serving"] == 1.0
    assert samples['kvsvc_requests_total{outcome="result",rpc="GetServerInfo"}'] >= 1.0


@pytest.mark.skipif(not DEMO_AVAILABLE, reason="`kvsvc demo --help` fails: demo not there yet")
@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_compose_demo_command(kv_server):
    argv = service_argv(IMAGE, SERVICES[DEMO_SERVICE])
    i = argv.index("--target") + 1
    argv[i] = kv_server.addr  # kvsvc:50051 inside compose's network
    argv[argv.index("--token-file") + 1] = kv_server.token_file  # in the auth volume there
    # In compose the demo passes memfds through the socket volume; --shm-dir only
    # matters to a demo that maps files, and here those are in the server's dir.
    if "--shm-dir" in argv:
        argv[argv.index("--shm-dir") + 1] = kv_server.shm_dir
    else:
        argv += ["--shm-dir", kv_server.shm_dir]
    demo_env = base_env(service_env(IMAGE, SERVICES[DEMO_SERVICE]))
    demo_env["KVSVC_SHM_DIR"] = kv_server.shm_dir
    before = scrape(kv_server.metrics_url)
    done = subprocess.run(
        resolve(argv, demo_env),
        env=demo_env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (
        f"{argv} exited {done.returncode}\n{done.stdout}\n{done.stderr}\n"
        f"server log:\n{kv_server.output()}"
    )
    if "--memfd" in argv:  # its memory went over the fd socket, not through a shared dir
        assert "map source cache (memfd)" in done.stdout, done.stdout
    after = scrape(kv_server.metrics_url)
    for rpc in ("Map", "Store", "Retrieve"):
        key = f'kvsvc_requests_total{{outcome="result",rpc="{rpc}"}}'
        assert after.get(key, 0.0) > before.get(key, 0.0), f"demo made no successful {rpc}"


def test_sigterm_exits_0(kv_server):
    assert kv_server.proc.poll() is None, kv_server.output()
    rc = _terminate(kv_server.proc)
    assert rc == 0, f"exit status {rc} after SIGTERM:\n{kv_server.output()}"
