"""The vLLM connector's tests need real vLLM (CPU build) in their own venv:
``make vllm`` (scripts/check_vllm.sh) makes it and runs them with
KVSVC_VLLM_REQUIRED=1, under which a missing vLLM fails instead of skipping.
The main venv's pytest skips its modules (``pytest.importorskip("vllm")``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from support import EngineVenv

VENV = EngineVenv("KVSVC_VLLM_REQUIRED", "vLLM", module="vllm", target="vllm")
HAVE_VLLM = VENV.present
pytest_runtest_makereport = VENV.runtest_makereport
pytest_collectreport = VENV.collectreport
# check_vllm.sh runs test_tier.py again with vLLM 0.33 first on PYTHONPATH: it says so.
EXPECT = os.environ.get("KVSVC_VLLM_EXPECT", "")
if EXPECT and HAVE_VLLM:
    import vllm

    if not str(vllm.__version__).startswith(EXPECT + "."):
        raise RuntimeError(f"KVSVC_VLLM_EXPECT={EXPECT} but vLLM {vllm.__version__} imported")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server started as docker/compose.yaml starts it: a tenant file made by
    ``kvsvc init-auth`` (every call needs its token), a socket directory (the fd
    socket as another container mounts it), a plaintext health port, TLS on the
    gRPC port. Yields its port and the connector/tier keys that reach it."""
    yield from _secured_server(tmp_path_factory.mktemp("secured"), mtls=False)


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """As ``secured``, with mTLS (``--tls-client-ca``): every client shows a
    certificate the CA signed. ``init-auth``'s tenant also lists the certificate
    name ``engine-a``, which then identifies it without a token. Yields, beside port
    and keys (token + engine-a's certificate), the folder of the other certificates:
    ``engine-b`` (signed, not listed) and ``forged`` (named engine-a, another CA)."""
    yield from _secured_server(tmp_path_factory.mktemp("mtls"), mtls=True)


def _secured_server(tmp_path: Any, *, mtls: bool) -> Iterator[dict[str, Any]]:
    from certs import make_ca, make_cert
    from driver import KvsvcProcess
    from vllm_helpers import free_port

    from kvsvc.client import ClientTLS

    tenants = tmp_path / "auth" / "tenants.json"
    tenants.parent.mkdir()
    subprocess.run(
        [sys.executable, "-m", "kvsvc", "init-auth", "--tenant-file", str(tenants)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    token_file = tenants.parent / "token"
    make_ca(tmp_path, "ca")
    make_cert(tmp_path, "ca", "server", "localhost", "DNS:localhost")
    keys = {
        "token_file": str(token_file),
        "tls_ca": str(tmp_path / "ca.pem"),
        "tls_server_name": "localhost",
    }
    args: list[str] = []
    if mtls:
        make_ca(tmp_path, "other-ca")
        make_cert(tmp_path, "ca", "engine-a", "engine-a")
        make_cert(tmp_path, "ca", "engine-b", "engine-b")
        make_cert(tmp_path, "other-ca", "forged", "engine-a")
        table = json.loads(tenants.read_text())
        (tenant,) = table["tenants"].values()  # init-auth's one tenant
        tenant["cert_names"] = ["engine-a"]
        tenants.write_text(json.dumps(table))
        keys |= {
            "tls_cert": str(tmp_path / "engine-a.pem"),
            "tls_key": str(tmp_path / "engine-a.key"),
        }
        args = ["--tls-client-ca", str(tmp_path / "ca.pem")]
    sockets = tempfile.mkdtemp(prefix="kvs")  # a socket path must fit in 108 bytes
    server = KvsvcProcess(
        free_port(),
        "",
        str(tmp_path),
        "--auth-token-file",
        str(tenants),
        "--socket-dir",
        sockets,
        "--health-listen",
        f"127.0.0.1:{free_port()}",
        "--tls-cert",
        str(tmp_path / "server.pem"),
        "--tls-key",
        str(tmp_path / "server.key"),
        *args,
        client={
            "token": token_file.read_text().strip(),
            "tls": ClientTLS(
                ca=keys["tls_ca"],
                cert=keys.get("tls_cert"),
                key=keys.get("tls_key"),
                server_name="localhost",
            ),
        },
    )
    try:
        yield {
            "port": int(server.address.rsplit(":", 1)[1]),
            "keys": {**keys, "fd_socket": f"{sockets}/fd.sock"},
            "certs": str(tmp_path),
        }
    finally:
        server.kill()
        shutil.rmtree(sockets, ignore_errors=True)
