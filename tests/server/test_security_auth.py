"""Authentication and tenants (issue 15, items 2, 3, 5 and 6): real servers with a
tenant file, tokens in call metadata, mTLS with real certificates (openssl), a
health-only plaintext listener, SIGHUP reloads, secure-by-default refusals."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from certs import make_ca, make_cert
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import SERVING, ServerThread, health_status, make_cache

from kvsvc.client import AsyncKVCacheClient, ClientTLS, KVCacheClient
from kvsvc.errors import MappingLost, PermissionDenied, Unauthenticated
from kvsvc.ids import new_request_id
from kvsvc.limits import MiB
from kvsvc.server.config import ServerConfig
from kvsvc.server.security.auth import Authenticator, TenantFileError, parse_tables
from kvsvc.v1 import kv_cache_service_pb2 as pb
from kvsvc.v1 import kv_cache_service_pb2_grpc as pb_grpc

TOKEN_A = secrets.token_hex(16)
TOKEN_B = secrets.token_hex(16)
TOKEN_C = secrets.token_hex(16)
EXPIRED = secrets.token_hex(16)


def tenant_file(path: Path, **extra: dict) -> Path:
    tenants = {
        "team-a": {
            "tokens": [TOKEN_A, {"token": EXPIRED, "expires": "2020-01-01T00:00:00Z"}],
            "cert_names": ["engine-a"],
            "namespaces": ["a/*"],
        },
        "team-b": {"tokens": [TOKEN_B], "namespaces": ["b/*", "a/shared"]},
        # every namespace, but still its own: the same names as a's are another store
        "team-c": {
            "tokens": [{"sha256": __import__("hashlib").sha256(TOKEN_C.encode()).hexdigest()}],
            "namespaces": ["*"],
        },
        **extra,
    }
    path.write_text(json.dumps({"tenants": tenants}))
    return path


@pytest.fixture
def auth_server(make_server, tmp_path) -> ServerThread:
    return make_server(auth_token_file=str(tenant_file(tmp_path / "tenants.json")))


def test_missing_wrong_expired_and_malformed_tokens_are_unauthenticated_alike(auth_server):
    answers = set()
    for token in (None, secrets.token_hex(16), EXPIRED, TOKEN_A[:-1]):
        with KVCacheClient(auth_server.address, token=token) as c:
            with pytest.raises(Unauthenticated) as ei:
                c.lookup([b"k"], namespace="a/x", timeout=10)
            assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED
            answers.add(ei.value.message)
    # A malformed header (not "Bearer ...") too.
    with grpc.insecure_channel(auth_server.address) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        with pytest.raises(grpc.RpcError) as raw:
            stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=[("authorization", TOKEN_A)])
        assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answers.add(f"{raw.value.details()}")
        # Health and reflection on the main port need credentials too.
        with pytest.raises(grpc.RpcError) as health:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # One answer for every case: it reveals nothing of what exists.
    assert len({a.split(" [")[0] for a in answers}) == 1, answers
    with KVCacheClient(auth_server.address, token=TOKEN_A) as c:
        assert c.lookup([b"k"], namespace="a/x", timeout=10) == 0


def test_a_namespace_of_another_tenant_is_permission_denied(auth_server):
    with KVCacheClient(auth_server.address, token=TOKEN_A) as a:
        a.put("a/x", [(b"k", b"secret")], timeout=10)
        for call in (
            lambda: a.put("b/x", [(b"k", b"v")], timeout=10),
            lambda: a.lookup([b"k"], namespace="b/x", timeout=10),
            lambda: a.get("other", b"k", timeout=10),
        ):
            with pytest.raises(PermissionDenied) as ei:
                call()
            assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    with KVCacheClient(auth_server.address, token=TOKEN_B) as b:
        with pytest.raises(PermissionDenied):
            b.lookup([b"k"], namespace="a/x", timeout=10)
        # b may use the name a/shared, but it is b's own: a's chunks are not there.
        assert b.lookup([b"k"], namespace="a/shared", timeout=10) == 0
    with KVCacheClient(auth_server.address, token=TOKEN_C) as c:
        # Granted every name, c still sees only its own chunks.
        assert c.lookup([b"k"], namespace="a/x", timeout=10) == 0
        c.put("a/x", [(b"k", b"c's own")], timeout=10)
    with KVCacheClient(auth_server.address, token=TOKEN_A) as a:
        assert a.get("a/x", b"k", timeout=10) == b"secret"


def test_another_tenants_mapping_id_is_not_found_and_ids_are_unguessable(auth_server, shm_dir):
    cache = make_cache(shm_dir, "engine-a", seed=3)
    with KVCacheClient(auth_server.address, token=TOKEN_A) as a:
        ma = a.map("a/m", [cache.rank_region()], timeout=10)
        ma2 = a.map("a/m2", [make_cache(shm_dir, "engine-a2").rank_region()], timeout=10)
        assert re.fullmatch(r"[0-9a-f]{32}", ma.mapping_id)
        assert ma.mapping_id[:8] != ma2.mapping_id[:8]  # no shared prefix, no counter
        a.store(ma, [(b"k0", [0, 1])], timeout=10)
    with KVCacheClient(auth_server.address, token=TOKEN_C) as c:
        # c re-sends a's very Map: it gets a mapping of its own, not a's id.
        mc = c.map("a/m", [cache.rank_region()], timeout=10)
        assert mc.mapping_id != ma.mapping_id
        for call in (
            lambda: c.lookup([b"k0"], mapping=ma, timeout=10),
            lambda: c.store(ma, [(b"x", [0])], timeout=10),
            lambda: c.retrieve(ma, [(b"k0", [0, 1])], timeout=10),
            lambda: c.fence(ma, timeout=10),
            lambda: c.unmap(ma, timeout=10),
        ):
            with pytest.raises(MappingLost) as ei:
                call()
            assert ei.value.code == grpc.StatusCode.NOT_FOUND
    with KVCacheClient(auth_server.address, token=TOKEN_A) as a:
        # a's mapping is untouched: it still stores and retrieves.
        assert a.store(ma, [(b"k1", [2])], timeout=10).stored_chunks == 1


def raw_store(address: str, token: str, namespace: str, request_id: str) -> pb.StoreResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.KVCacheServiceStub(ch).Store(
            pb.StoreRequest(
                header=pb.RequestHeader(envelope_version=1, request_id=request_id),
                inline=pb.InlineChunks(
                    namespace=namespace, chunks=[pb.InlineChunk(key=b"k", data=b"v" * 64)]
                ),
            ),
            metadata=[("authorization", f"Bearer {token}")],
            timeout=10,
        )


def raw_fence(address: str, token: str, transfer_ids: list[str]) -> pb.FenceResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.KVCacheServiceStub(ch).Fence(
            pb.FenceRequest(
                header=pb.RequestHeader(envelope_version=1, request_id=new_request_id()),
                transfer_ids=transfer_ids,
            ),
            metadata=[("authorization", f"Bearer {token}")],
            timeout=10,
        )


def test_a_fence_bars_only_its_own_tenants_transfer_ids(auth_server):
    tid = new_request_id()
    # b fences the id a is about to use: that bars b's id of that name, not a's.
    assert raw_fence(auth_server.address, TOKEN_B, [tid]).result.barred_transfers == 1
    stored = raw_store(auth_server.address, TOKEN_A, "a/f", tid)
    assert stored.WhichOneof("outcome") == "result", stored.error
    assert stored.result.stored_chunks == 1 and stored.result.transfer_id == tid
    # a's own fence of its own id: the copy is known to it (finished, not barred).
    assert raw_fence(auth_server.address, TOKEN_A, [tid]).result.barred_transfers == 0
    # b's own Store under the id it barred is refused.
    refused = raw_store(auth_server.address, TOKEN_B, "b/f", tid)
    assert refused.error.reason == "TRANSFER_BARRED"


# --- tenant file parsing --------------------------------------------------------------
@pytest.mark.parametrize(
    ("tenants", "match"),
    [
        ({"bad/name": {}}, "a name is"),
        ({"t": {"tokens": ["short"]}}, "at least 22 characters"),
        ({"t": {"tokens": [{"sha256": "zz"}]}}, "64 hex"),
        ({"t": {"tokens": [TOKEN_A]}, "u": {"tokens": [TOKEN_A]}}, "listed twice"),
        ({"t": {"quota": {"store_share": 2}}}, "store_share"),
        ({"t": {"colour": "red"}}, "unknown keys"),
        ({"t": {"tokens": [{"token": TOKEN_A, "expires": "soon"}]}}, "ISO 8601"),
    ],
)
def test_a_bad_tenant_file_is_refused_with_the_entry_named(tenants, match):
    with pytest.raises(TenantFileError, match=match):
        parse_tables({"tenants": tenants})


def test_a_bad_tenant_file_stops_kvsvc_serve_in_one_line(tmp_path, shm_dir):
    bad = tmp_path / "t.json"
    bad.write_text('{"tenants": {"t": {"tokens": ["short"]}}}')
    proc = serve_once(shm_dir, "--listen", "127.0.0.1:0", "--auth-token-file", str(bad))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--auth-token-file" in lines[0] and "22 characters" in lines[0]


def test_reload_keeps_the_old_tables_when_the_new_file_is_bad(tmp_path):
    path = tenant_file(tmp_path / "t.json")
    auth = Authenticator(str(path), client_certs=False)
    path.write_text("{not json")
    assert not auth.reload()
    tenant, _ = auth.identify([("authorization", f"Bearer {TOKEN_A}")], [])
    assert tenant is not None and tenant.name == "team-a"


# --- SIGHUP, bounded logs, never a token in the log: the command users run --------
def test_sighup_swaps_tokens_without_dropping_calls(spawn, tmp_path):
    path = tenant_file(tmp_path / "t.json")
    proc = spawn("--auth-token-file", str(path))
    new_a = secrets.token_hex(16)
    failures: list[BaseException] = []
    done = threading.Event()
    calls = 0

    def keep_calling() -> None:  # tenant b's token is in both files
        nonlocal calls
        with KVCacheClient(proc.address, token=TOKEN_B) as b:
            while not done.is_set():
                try:
                    b.lookup([b"k"], namespace="b/x", timeout=10)
                    calls += 1
                except BaseException as exc:  # noqa: BLE001 - collected for the assert
                    failures.append(exc)

    worker = threading.Thread(target=keep_calling)
    worker.start()
    try:
        with KVCacheClient(proc.address, token=TOKEN_A) as a:
            a.lookup([b"k"], namespace="a/x", timeout=10)
        data = json.loads(path.read_text())
        data["tenants"]["team-a"]["tokens"] = [new_a]
        path.write_text(json.dumps(data))
        proc.signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "tenant file reloaded" not in proc.output():
            assert time.monotonic() < deadline, proc.output()
            time.sleep(0.05)
        with KVCacheClient(proc.address, token=TOKEN_A) as a, pytest.raises(Unauthenticated):
            a.lookup([b"k"], namespace="a/x", timeout=10)
        with KVCacheClient(proc.address, token=new_a) as a:
            assert a.lookup([b"k"], namespace="a/x", timeout=10) == 0
    finally:
        done.set()
        worker.join(30)
    assert not failures and calls > 0
    assert proc.proc.poll() is None  # SIGHUP did not stop it


def test_auth_failures_are_all_counted_and_logged_at_a_bounded_rate(spawn, tmp_path):
    path = tenant_file(tmp_path / "t.json")
    proc = spawn("--auth-token-file", str(path))
    wrong = secrets.token_hex(16)
    for _ in range(200):
        with KVCacheClient(proc.address, token=wrong) as c, pytest.raises(Unauthenticated):
            c.lookup([b"k"], namespace="a/x", timeout=10)
    out = proc.output()
    refusals = [line for line in out.splitlines() if "unauthenticated call" in line]
    assert 1 <= len(refusals) <= 10, refusals
    for secret in (wrong, TOKEN_A, TOKEN_B, EXPIRED):
        assert secret not in out


def test_metrics_count_every_refusal(make_server, tmp_path):
    st = make_server(auth_token_file=str(tenant_file(tmp_path / "t.json")))
    for _ in range(25):
        with KVCacheClient(st.address) as c, pytest.raises(Unauthenticated):
            c.lookup([b"k"], namespace="a/x", timeout=10)
    registry = st.server.servicer.metrics.registry
    assert registry.get_sample_value("kvsvc_auth_failures_total", {"reason": "missing"}) == 25


# --- secure by default and the health listener ------------------------------------
def serve_once(shm_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", "serve", "--shm-dir", str(shm_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plaintext_without_auth_beyond_loopback_refuses_to_start_in_one_line(shm_dir):
    proc = serve_once(shm_dir, "--listen", "0.0.0.0:0")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "refusing to serve plaintext without authentication on 0.0.0.0:0" in lines[0]
    assert "--allow-insecure" in lines[0]


def test_allow_insecure_and_tokens_each_let_it_listen_beyond_loopback(spawn, tmp_path):
    p1 = spawn("--allow-insecure", host="0.0.0.0")
    assert health_status(p1.address) == SERVING
    p2 = spawn("--auth-token-file", str(tenant_file(tmp_path / "t.json")), host="0.0.0.0")
    with KVCacheClient(p2.address, token=TOKEN_A) as a:
        assert a.lookup([b"k"], namespace="a/x", timeout=10) == 0


def test_health_listener_answers_probes_while_the_main_port_refuses_them(make_server, tmp_path):
    st = make_server(
        auth_token_file=str(tenant_file(tmp_path / "t.json")), health_listen="127.0.0.1:0"
    )
    probe = st.server.health_address
    assert probe and probe != st.address
    for service in ("", "kvsvc.v1.KVCacheService"):
        assert health_status(probe, service) == SERVING
    with pytest.raises(grpc.RpcError) as ei:
        health_status(st.address)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The health listener serves health only.
    with grpc.insecure_channel(probe) as ch, pytest.raises(grpc.RpcError) as other:
        pb_grpc.KVCacheServiceStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED


# --- mTLS with real certificates ---------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "ca", "server", "localhost", "DNS:localhost,IP:127.0.0.1")
    make_cert(d, "ca", "engine-a", "engine-a")
    make_cert(d, "ca", "stranger", "stranger")
    make_cert(d, "other-ca", "forged", "engine-a")
    return d


def tls_for(pki: Path, name: str | None) -> ClientTLS:
    if name is None:
        return ClientTLS(ca=str(pki / "ca.pem"), server_name="localhost")
    return ClientTLS(
        ca=str(pki / "ca.pem"),
        cert=str(pki / f"{name}.pem"),
        key=str(pki / f"{name}.key"),
        server_name="localhost",
    )


@pytest.fixture
def mtls_server(make_server, tmp_path, pki) -> ServerThread:
    return make_server(
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem"),
        auth_token_file=str(tenant_file(tmp_path / "t.json")),
    )


def test_mtls_cert_names_its_tenant_and_others_are_refused(mtls_server, pki):
    addr = mtls_server.address
    with KVCacheClient(addr, tls=tls_for(pki, "engine-a")) as a:
        a.put("a/x", [(b"k", b"by cert")], timeout=10)
        with pytest.raises(PermissionDenied):
            a.lookup([b"k"], namespace="b/x", timeout=10)
    # A token over mTLS names its tenant too (the certificate got it through TLS).
    with KVCacheClient(addr, tls=tls_for(pki, "stranger"), token=TOKEN_A) as a:
        assert a.get("a/x", b"k", timeout=10) == b"by cert"
    # A valid certificate the tenant file does not list, and no token: unauthenticated.
    with KVCacheClient(addr, tls=tls_for(pki, "stranger")) as s, pytest.raises(Unauthenticated):
        s.lookup([b"k"], namespace="a/x", timeout=10)
    # No client certificate, or one from another CA: the handshake fails.
    for tls in (tls_for(pki, None), tls_for(pki, "forged")):
        with KVCacheClient(addr, tls=tls, token=TOKEN_A) as c, pytest.raises(Exception) as ei:
            c.lookup([b"k"], namespace="a/x", timeout=10)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    # Plaintext to a TLS port: no answer either.
    with KVCacheClient(addr, token=TOKEN_A) as p, pytest.raises(Exception) as plain:
        p.lookup([b"k"], namespace="a/x", timeout=10)
    assert plain.value.code == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_tls_without_client_certs_with_tokens(make_server, tmp_path, pki):
    st = make_server(
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        auth_token_file=str(tenant_file(tmp_path / "t.json")),
        store_bytes=8 * MiB,
    )
    with KVCacheClient(st.address, tls=tls_for(pki, None), token=TOKEN_B) as b:
        assert b.lookup([b"k"], namespace="b/x", timeout=10) == 0
    with KVCacheClient(st.address, tls=tls_for(pki, None)) as n, pytest.raises(Unauthenticated):
        n.lookup([b"k"], namespace="b/x", timeout=10)


def test_server_config_knows_when_calls_need_credentials():
    assert not ServerConfig().security.authenticated
    assert ServerConfig.from_settings(auth_token_file="t").security.authenticated
    assert ServerConfig.from_settings(tls_client_ca="ca").security.authenticated


def test_the_async_client_takes_a_token_and_tls(mtls_server, pki):
    addr = mtls_server.address

    async def go() -> None:
        async with AsyncKVCacheClient(addr, tls=tls_for(pki, "engine-a")) as a:
            await a.put("a/async", [(b"k", b"v")], timeout=10)
            with pytest.raises(PermissionDenied):
                await a.lookup([b"k"], namespace="b/x", timeout=10)
        async with AsyncKVCacheClient(addr, tls=tls_for(pki, "stranger"), token=TOKEN_A) as t:
            assert await t.get("a/async", b"k", timeout=10) == b"v"
        async with AsyncKVCacheClient(addr, tls=tls_for(pki, "stranger")) as s:
            with pytest.raises(Unauthenticated):
                await s.lookup([b"k"], namespace="a/async", timeout=10)

    asyncio.run(go())
