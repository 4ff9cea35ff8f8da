"""A failed call's log line carries its facts as fields (kvsvc.logs.FIELDS): in JSON
their own keys, in text ``key=value`` after the message; a denial names the tenant
and the namespace it was refused, never the token."""

from __future__ import annotations

import json
import secrets
import signal
from pathlib import Path
from typing import Any

import pytest

from kvsvc.client import KVCacheClient
from kvsvc.errors import PermissionDenied

BOB = secrets.token_hex(16)


def tenant_file(path: Path) -> Path:
    path.write_text(json.dumps({"tenants": {"bob": {"tokens": [BOB], "namespaces": ["bob/*"]}}}))
    path.chmod(0o600)
    return path


def denied_output(spawn: Any, tmp_path: Path, fmt: str) -> str:
    """The server's whole log after bob is refused ``alice/secret``."""
    srv = spawn("--log-format", fmt, "--auth-token-file", str(tenant_file(tmp_path / "t.json")))
    with KVCacheClient(srv.address, token=BOB) as bob, pytest.raises(PermissionDenied):
        bob.put("alice/secret", [(b"k", b"v")], timeout=10)
    srv.signal(signal.SIGTERM)
    assert srv.wait(60) == 0
    out: str = srv.output()
    assert BOB not in out
    return out


def test_a_denial_in_json_names_rpc_reason_tenant_namespace_and_duration(
    spawn: Any, tmp_path: Path
) -> None:
    out = denied_output(spawn, tmp_path, "json")
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    (denial,) = [r for r in records if r.get("reason") == "PERMISSION_DENIED"]
    assert denial["rpc"] == "Store", denial
    assert denial["tenant"] == "bob"
    assert denial["namespace"] == "alice/secret"
    assert isinstance(denial["duration_ms"], float) and denial["duration_ms"] >= 0
    assert denial["request_id"] and denial["request_id"] in denial["msg"]


def test_a_denial_in_text_appends_the_same_fields(spawn: Any, tmp_path: Path) -> None:
    out = denied_output(spawn, tmp_path, "text")
    (line,) = [ln for ln in out.splitlines() if "reason=PERMISSION_DENIED" in ln]
    assert "Store " in line and "failed:" in line
    assert "rpc=Store" in line and "tenant=bob" in line and "namespace=alice/secret" in line
    assert "duration_ms=" in line
