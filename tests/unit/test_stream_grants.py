"""kvsvc.server.security.credentials: open streams' grants against a real Authenticator and
tenant file -- revoked on reload when the token goes or names another tenant, a
watch's grant ended (UNAVAILABLE) when its tenant's namespaces change, a Session's
grant following the new tables, and expiry by one timer (or by the per-request
check when a request comes first). No sockets: the grants alone, on a real loop."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path

import grpc

from kvsvc.server.security.auth import Authenticator

TOKEN = secrets.token_hex(16)
OTHER = secrets.token_hex(16)


def tenant_file(path: Path, tenants: dict) -> Path:
    path.write_text(json.dumps({"tenants": tenants}))
    path.chmod(0o600)
    return path


def test_reload_revokes_gone_tokens_and_follows_the_rest(tmp_path: Path) -> None:
    path = tenant_file(
        tmp_path / "t.json",
        {"a": {"tokens": [TOKEN], "namespaces": ["x/*"]}, "b": {"tokens": [OTHER]}},
    )
    auth = Authenticator(str(path), client_certs=False)

    async def go() -> None:
        creds = auth.credentials([("authorization", f"Bearer {TOKEN}")], [])
        other = auth.credentials([("authorization", f"Bearer {OTHER}")], [])
        tenant, _, expires = auth.resolve(creds)
        assert tenant is not None
        session = auth.streams.open(creds, tenant, expires, watch=False)
        watch = auth.streams.open(creds, tenant, expires, watch=True)
        b_tenant, _, b_expires = auth.resolve(other)
        assert b_tenant is not None
        b_session = auth.streams.open(other, b_tenant, b_expires, watch=False)
        stopped: list[str] = []
        session.stops.append(lambda: stopped.append("session"))
        # a's namespaces change: the session follows, the watch must reopen.
        tenant_file(
            path, {"a": {"tokens": [TOKEN], "namespaces": ["y/*"]}, "b": {"tokens": [OTHER]}}
        )
        assert auth.reload()
        assert not session.revoked and session.check() is not None
        assert session.check().namespaces == ("y/*",)  # type: ignore[union-attr]
        assert watch.ended.result()[0] == grpc.StatusCode.UNAVAILABLE
        # The token now names another tenant: revoked, and the stream told to stop.
        tenant_file(path, {"c": {"tokens": [TOKEN]}, "b": {"tokens": [OTHER]}})
        assert auth.reload()
        assert session.ended.result() == (grpc.StatusCode.UNAUTHENTICATED, "another tenant")
        assert stopped == ["session"] and session.check() is None
        # Gone altogether: unknown. b's grant went through both reloads untouched.
        tenant_file(path, {"b": {"tokens": [OTHER]}})
        assert auth.reload()
        assert not b_session.revoked and b_session.check() is b_session.tenant
        for g in (session, watch, b_session):
            auth.streams.close(g)
        assert len(auth.streams) == 0

    asyncio.run(go())


def test_one_timer_expires_grants_and_a_request_first_is_refused(tmp_path: Path) -> None:
    soon = time.time() + 0.3
    path = tenant_file(
        tmp_path / "t.json",
        {"a": {"tokens": [{"token": TOKEN, "expires": soon}, OTHER]}},
    )
    auth = Authenticator(str(path), client_certs=False)

    async def go() -> None:
        creds = auth.credentials([("authorization", f"Bearer {TOKEN}")], [])
        tenant, _, expires = auth.resolve(creds)
        assert tenant is not None and expires == soon
        timed = auth.streams.open(creds, tenant, expires, watch=True)
        lasting = auth.streams.open(
            auth.credentials([("authorization", f"Bearer {OTHER}")], []),
            tenant,
            float("inf"),
            watch=False,
        )
        code, why = await asyncio.wait_for(asyncio.shield(timed.ended), 30)
        assert (code, why) == (grpc.StatusCode.UNAUTHENTICATED, "expired")
        assert time.time() >= soon and not lasting.revoked
        # A request read after the expiry but before a timer ran is refused by check().
        late = auth.streams.open(creds, tenant, time.time() - 0.001, watch=False)
        assert late.check() is None and late.ended.result()[1] == "expired"
        for g in (timed, lasting, late):
            auth.streams.close(g)

    asyncio.run(go())


def test_malformed_missing_and_certificate_credentials_resolve_as_identify_does(
    tmp_path: Path,
) -> None:
    path = tenant_file(tmp_path / "t.json", {"a": {"tokens": [TOKEN], "cert_names": ["eng"]}})
    auth = Authenticator(str(path), client_certs=True)
    assert auth.resolve(auth.credentials([("authorization", TOKEN)], []))[:2] == (None, "malformed")
    assert auth.resolve(auth.credentials([], []))[:2] == (None, "missing")
    tenant, _, expires = auth.resolve(auth.credentials([], [b"eng"]))
    assert tenant is not None and tenant.name == "a" and expires == float("inf")
    assert auth.resolve(auth.credentials([], [b"who"]))[1] == "certificate-unlisted"
    # The credentials keep the token's digest, never the token.
    assert TOKEN not in repr(auth.credentials([("authorization", f"Bearer {TOKEN}")], []))
