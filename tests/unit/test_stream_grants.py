"""kvsvc.server.security.credentials: open streams' grants against a real Authenticator and
tenant file -- revoked on reload when the token goes or names another tenant, a
watch's grant ended (UNAVAILABLE) when its tenant's namespaces change, a Session's
grant following the new tables, and expiry by one timer (or by the per-request
check when a request comes first); and the races of issue 40, set up on purpose: a
reload between a stream's read of the tables and its register, and one that ends a
stream while its first send is in flight. No sockets: the grants and the interceptor,
with a call that keeps grpc's rules for ending it, on a real loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvsvc.server.security.auth import (
    REVOKE_DRAIN_S,
    Authenticator,
    AuthInterceptor,
    Tenant,
    current_tenant,
)
from kvsvc.server.security.credentials import Credentials

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
        session, _ = auth.streams.open(creds, watch=False)
        watch, _ = auth.streams.open(creds, watch=True)
        b_session, _ = auth.streams.open(other, watch=False)
        assert session and watch and b_session
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
        other = auth.credentials([("authorization", f"Bearer {OTHER}")], [])
        timed, _ = auth.streams.open(creds, watch=True)
        lasting, _ = auth.streams.open(other, watch=False)
        assert timed and lasting and timed.expires == soon and lasting.expires == float("inf")
        code, why = await asyncio.wait_for(asyncio.shield(timed.ended), 30)
        assert (code, why) == (grpc.StatusCode.UNAUTHENTICATED, "expired")
        assert time.time() >= soon and not lasting.revoked
        # A request read after the expiry but before a timer ran is refused by check().
        assert auth.streams.open(creds, watch=False) == (None, "expired")  # not opened
        late, _ = auth.streams.open(other, watch=False)
        assert late is not None
        late.expires = time.time() - 0.001  # as if read just after its expiry
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


# --- the races of issue 40: a reload against a stream that opens or is writing -------
class Aborted(Exception):
    """What grpc's abort raises once its status is on the way."""


class FakeCall:
    """A server call as grpc.aio keeps it, as far as ending it goes: a send stays in
    flight until the transport takes it (``take``), cancelling its writer does not
    take it back, and the initial metadata count as sent only once the first send
    returned to its writer. An abort that would send them again while they are
    still on the way is refused (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), and grpc
    then sends no status at all: that call's client would wait for good."""

    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.in_flight: list[asyncio.Future[None]] = []
        self.started = False  # a send carrying the initial metadata was started
        self.metadata_sent = False
        self.aborts: list[grpc.StatusCode] = []
        self.status: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def _send(self) -> None:
        op = asyncio.get_running_loop().create_future()
        self.in_flight.append(op)
        self.started = True
        await asyncio.shield(op)
        self.in_flight.remove(op)
        self.metadata_sent = True

    async def write(self, message: object) -> None:
        await self._send()

    async def send_initial_metadata(self, metadata: object) -> None:
        await self._send()

    def take(self) -> None:
        """The client reads: the transport takes what is in flight."""
        for op in self.in_flight:
            if not op.done():
                op.set_result(None)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.aborts.append(code)
        if self.started and not self.metadata_sent:
            raise RuntimeError("GRPC_CALL_ERROR_TOO_MANY_OPERATIONS: no status is ever sent")
        self.status = code
        raise Aborted(details)


async def until(condition: Callable[[], object], limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        await asyncio.sleep(0.005)


async def parked(context: object) -> None:
    """A stream handler after its first send: it waits for more to say."""
    await asyncio.Event().wait()


@pytest.mark.parametrize("watch", [True, False], ids=["watch", "session"])
def test_a_stream_revoked_with_its_first_send_in_flight_ends_after_it(
    tmp_path: Path, watch: bool
) -> None:
    """The flake of issue 40: WatchEvents' first batch was still in flight (its
    client had it; the server loop had not yet seen the send complete) when a reload
    ended the stream. The stream's task was cancelled and the status sent at once:
    grpc refused it and the stream never ended. The status now waits for the send."""
    path = tenant_file(tmp_path / "t.json", {"a": {"tokens": [TOKEN], "namespaces": ["x/*"]}})
    auth = Authenticator(str(path), client_certs=False)
    interceptor = AuthInterceptor(auth)

    async def watch_handler(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.write(b"lost")
        await parked(context)

    async def session_handler(requests: object, context: grpc.aio.ServicerContext) -> None:
        await context.send_initial_metadata(())
        await parked(context)

    async def go() -> None:
        call = FakeCall(TOKEN)
        if watch:
            handler = interceptor._watch(grpc.unary_stream_rpc_method_handler(watch_handler))
            served = asyncio.create_task(handler.unary_stream(None, call))
        else:
            handler = interceptor._session(grpc.stream_stream_rpc_method_handler(session_handler))
            served = asyncio.create_task(handler.stream_stream(None, call))
        await until(lambda: call.in_flight)
        # The view narrows (a watch ends, to reopen) or the token goes (both end).
        tenants = {"a": {"tokens": [TOKEN], "namespaces": ["x/y/*"]}} if watch else {}
        tenant_file(path, {"b": {"tokens": [OTHER]}, **tenants})
        assert auth.reload()
        # However long the send stays in flight, no status is tried beside it.
        drain = 0.0 if watch else REVOKE_DRAIN_S
        with contextlib.suppress(AssertionError):
            await until(lambda: call.aborts or served.done(), limit=drain + 0.5)
        assert call.aborts == [] and not served.done(), call.aborts
        call.take()  # the client reads: the send completes, then the status goes out
        with pytest.raises(Aborted):
            await asyncio.wait_for(served, 10)
        assert call.status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
        assert len(auth.streams) == 0

    asyncio.run(go())


def test_a_reload_between_a_streams_table_read_and_its_register_is_not_missed(
    tmp_path: Path,
) -> None:
    """The check-then-register race: a stream reads the tenant file in force, a
    reload (here on another thread, as Authenticator.reload may be called) swaps it
    and looks for open streams before the stream registered. The stream must not
    run under the grants the reload took away: it runs under the new file's."""
    path = tenant_file(tmp_path / "t.json", {"a": {"tokens": [TOKEN], "namespaces": ["x/*"]}})
    auth = Authenticator(str(path), client_certs=False)
    interceptor = AuthInterceptor(auth)
    resolve = auth.resolve
    landed: list[bool] = []

    def read_then_reload(creds: Credentials) -> tuple[Tenant | None, str, float]:
        answer = resolve(creds)  # the old file's answer
        if not landed:  # the reload lands here, between the read and the register
            tenant_file(path, {"a": {"tokens": [TOKEN], "namespaces": ["x/y/*"]}})
            reloader = threading.Thread(target=lambda: landed.append(auth.reload()))
            reloader.start()
            reloader.join(30)
            assert landed == [True]
        return answer

    auth.resolve = read_then_reload  # type: ignore[method-assign]
    auth.streams.resolve = read_then_reload
    runs_as: list[tuple[str, ...]] = []

    async def watch_handler(request: object, context: grpc.aio.ServicerContext) -> None:
        runs_as.append(current_tenant().namespaces)
        await context.write(b"lost")
        await parked(context)

    async def go() -> None:
        call = FakeCall(TOKEN)
        handler = interceptor._watch(grpc.unary_stream_rpc_method_handler(watch_handler))
        served = asyncio.create_task(handler.unary_stream(None, call))
        await until(lambda: runs_as)
        call.take()
        # It runs under the new file's grants, or it ends to reopen under them.
        if runs_as != [("x/y/*",)]:
            with contextlib.suppress(AssertionError):
                await until(served.done, limit=1.0)
        assert runs_as == [("x/y/*",)] or call.status == grpc.StatusCode.UNAVAILABLE, runs_as
        served.cancel()
        with contextlib.suppress(asyncio.CancelledError, Aborted):
            await served

    asyncio.run(go())
