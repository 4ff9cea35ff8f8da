"""What every engine plug-in shares, engine-free: settings parsed from the engine's
extra config (else ``KVSVC_<ENGINE>_<KEY>`` variables), the bearer token's file, the
client built from those settings, and the ``Link``: a client that a failure
replaces, with a "down until" time during which the plug-in skips kvsvc (a miss, no
stores) instead of waiting on a dead server in an engine thread."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar

from kvsvc.client import ClientTLS, KVCacheClient
from kvsvc.errors import (
    Cancelled,
    DeadlineExceeded,
    MappingLost,
    ServiceNotServing,
    ServiceUnavailable,
    TransferUnprovable,
)
from kvsvc.limits import validate_deadline

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# Failures after which the mapping may be gone (kvsvc down, restarted, stuck): map again.
LINK_ERRORS = (
    MappingLost,
    ServiceUnavailable,
    ServiceNotServing,
    DeadlineExceeded,
    Cancelled,
    TransferUnprovable,
    ConnectionError,
)

S = TypeVar("S")


@dataclass(frozen=True)
class ConnectionSettings:
    """What every plug-in needs to reach kvsvc, named as the Python client names it;
    an engine's settings class adds its own keys (and its namespace's default)."""

    target: str = "127.0.0.1:50051"
    # A tenant prefix; a fingerprint of the deployment is appended to it.
    namespace: str = "kvsvc"
    # An engine thread waits at most this long for a Lookup; then a miss.
    lookup_timeout_s: float = 0.05
    load_timeout_s: float = 10.0
    store_timeout_s: float = 10.0
    # Map, memfd passing, Fence.
    fence_timeout_s: float = 10.0
    # After a failure, kvsvc counts as down (0 hits, stores skipped) this long,
    # then the plug-in reconnects on a fresh channel.
    reconnect_interval_s: float = 2.0
    log_level: str = "INFO"
    # Security: the bearer token's file (read at each connect, so a rotated token is
    # picked up), TLS (on when any tls_* is set, or ``tls``: the system's roots), and
    # the fd socket as this process sees it.
    token_file: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    fd_socket: str = ""
    # The identity of the model's weights in the namespace fingerprint, when the
    # files' own (identity.py: config digest, weight files' sizes and mtimes, hub
    # commit) should not decide: e.g. the same release copied to hosts with other
    # mtimes. Deployments with different weights must never set the same value.
    model_identity: str = ""
    # Lookups answered from a presence index that follows kvsvc's events stream (no
    # RPC while it is fresh); False: a Lookup RPC each time.
    presence: bool = True

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")

    @property
    def uses_tls(self) -> bool:
        return self.tls or any((self.tls_ca, self.tls_cert, self.tls_server_name))


def parse_settings(
    cls: type[S],
    extra: dict[str, Any] | None,
    env_prefix: str,
    where: str,
    env: Mapping[str, str] | None = None,
) -> S:
    """A frozen settings dataclass from ``extra`` (unknown keys are an error, so a
    typo is not ignored), else ``<env_prefix><KEY>`` variables of ``env`` (default:
    the process environment)."""
    env = os.environ if env is None else env
    extra = dict(extra or {})
    names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(extra) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(names)}")
    values: dict[str, Any] = {}
    for name, f in names.items():
        raw = extra.get(name, env.get(f"{env_prefix}{name.upper()}"))
        if raw is None:
            continue
        if name.endswith("_s"):
            values[name] = validate_deadline(float(raw) if isinstance(raw, str) else raw, name)
        elif f.type in ("int", int):
            if isinstance(raw, bool) or int(raw) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {raw!r}")
            values[name] = int(raw)
        elif f.type in ("bool", bool):
            values[name] = parse_bool(name, raw)
        else:
            values[name] = str(raw)
    return cls(**values)


def parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{name} must be true or false, got {raw!r}")


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace dropped); the message
    names the file, never its content. (The server's ``read_token_file`` does the
    same for the CLI; integrations may not import the server.)"""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"token_file {path}: cannot read it ({type(exc).__name__})") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"token_file {path}: must hold one token, without spaces")
    return token


class ClientSettings(Protocol):
    """The settings a plug-in's client is made from (the same names in every engine)."""

    @property
    def target(self) -> str: ...
    @property
    def token_file(self) -> str: ...
    @property
    def tls_ca(self) -> str: ...
    @property
    def tls_cert(self) -> str: ...
    @property
    def tls_key(self) -> str: ...
    @property
    def tls_server_name(self) -> str: ...
    @property
    def fd_socket(self) -> str: ...
    @property
    def load_timeout_s(self) -> float: ...
    @property
    def reconnect_interval_s(self) -> float: ...
    @property
    def uses_tls(self) -> bool: ...


def make_client(cfg: ClientSettings, control_timeout: float) -> KVCacheClient:
    """A client with the plug-in's target, token, TLS and fd socket. Raises
    ValueError when the token file cannot be read (the caller counts kvsvc as down)."""
    tls = None
    if cfg.uses_tls:
        tls = ClientTLS(
            ca=cfg.tls_ca or None,
            cert=cfg.tls_cert or None,
            key=cfg.tls_key or None,
            server_name=cfg.tls_server_name or None,
        )
    # Over the client's Session stream (unary where the server lacks it): a
    # Lookup per request costs about half a unary call's.
    return KVCacheClient(
        cfg.target,
        token=read_token(cfg.token_file) if cfg.token_file else None,
        tls=tls,
        fd_socket=cfg.fd_socket or None,
        control_timeout=control_timeout,
        transfer_timeout=cfg.load_timeout_s,
    )


class Link:
    """A client that is replaced by a fresh channel after a failure, at most
    once per ``reconnect_interval_s`` (gRPC's own reconnect backoff grows to
    minutes), and a "down until" time during which callers skip kvsvc."""

    log = logging.getLogger("kvsvc.integrations")

    def __init__(self, cfg: ClientSettings, control_timeout: float) -> None:
        self.cfg = cfg
        self.control_timeout = control_timeout
        self.client: KVCacheClient | None = None
        self.down_until = 0.0
        self.old: list[KVCacheClient] = []

    def get(self) -> KVCacheClient | None:
        """The client, or None while kvsvc counts as down."""
        if time.monotonic() < self.down_until:
            return None
        if self.client is None:
            try:
                self.client = make_client(self.cfg, self.control_timeout)
            except ValueError as exc:  # the token file: kvsvc counts as down, told why
                self.log.error(
                    "kvsvc: %s; kvsvc skipped for %.1f s", exc, self.cfg.reconnect_interval_s
                )
                self.down_until = time.monotonic() + self.cfg.reconnect_interval_s
                return None
        return self.client

    def failed(self) -> None:
        self.down_until = time.monotonic() + self.cfg.reconnect_interval_s
        if self.client is not None:
            # In-flight futures may still use it: closed later, not now. A call
            # still running on one closed here ends as Cancelled (UNKNOWN: fenced).
            self.old.append(self.client)
            self.client = None
            while len(self.old) > 4:
                with contextlib.suppress(Exception):
                    self.old.pop(0).close()

    def close(self) -> None:
        for c in [*self.old, *([self.client] if self.client else [])]:
            with contextlib.suppress(Exception):
                c.close()
        self.old.clear()
        self.client = None
