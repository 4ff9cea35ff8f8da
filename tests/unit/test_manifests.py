"""What the Kubernetes manifests and the compose file promise an operator beyond
schema validity (scripts/check_deploy.sh validates them; tests/e2e checks them
against the server's settings): a PodDisruptionBudget and a priority for the node
DaemonSet, tolerations for tainted GPU nodes, and a disk-tier volume where
KVSVC_DISK_DIR points, writable by the server's uid."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def docs(topology: str) -> dict[str, list[dict[str, Any]]]:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((K8S / topology).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def test_the_node_daemonset_has_a_disruption_budget_and_a_priority() -> None:
    node = docs("node")
    (ds,) = node["DaemonSet"]
    (pdb,) = node["PodDisruptionBudget"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    (pc,) = node["PriorityClass"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == pc["metadata"]["name"]
    assert 0 < pc["value"] < 1_000_000_000 and not pc.get("globalDefault")


def test_the_gpu_pods_tolerate_the_gpu_taint() -> None:
    (ds,) = docs("node")["DaemonSet"]
    assert GPU_TAINT in ds["spec"]["template"]["spec"]["tolerations"]
    (gpu,) = docs("gpu")["Deployment"]
    assert GPU_TAINT in gpu["spec"]["template"]["spec"]["tolerations"]


def test_the_node_disk_tier_is_a_host_path_the_server_owns() -> None:
    node = docs("node")
    (cm,) = node["ConfigMap"]
    disk_dir = cm["data"]["KVSVC_DISK_DIR"]
    (ds,) = node["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[disk_dir]]
    assert volume["hostPath"]["path"] and not volume.get("emptyDir")
    # The kubelet makes a missing hostPath root-owned: the init container hands it
    # to uid 10001 (it mounts the same volume at the same path).
    (init,) = pod["initContainers"]
    assert init["command"][:2] == ["install", "-d"] and disk_dir in init["command"]
    assert init["command"][2:4] == ["-o", "10001"]
    assert {"name": mounts[disk_dir], "mountPath": disk_dir} in init["volumeMounts"]


def test_the_compose_disk_tier_is_a_named_volume_the_image_owns() -> None:
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    server = compose["services"]["kvsvc"]
    disk_dir = server["environment"]["KVSVC_DISK_DIR"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in server["volumes"]}
    assert volumes[disk_dir] in compose["volumes"], "a named volume, not a host path"
    # A named volume starts as a copy of the image's directory: it must exist there,
    # owned by the server's uid (else `kvsvc serve` refuses --disk-dir at start).
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    made = re.findall(r"install -d -o 10001 -g 10001 -m 0\d{3} ([^\n\\]+)", dockerfile)
    assert any(disk_dir in line.split() for line in made), made
