"""The client's TLS settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS settings (PEM file paths). ``ca``: the CA that signed the
    server's certificate (None: the system's roots); ``cert``/``key``: the client's
    own certificate for mTLS; ``server_name``: the name to verify when it differs
    from the target's host."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("ClientTLS: cert and key go together")

    def options(self) -> list[tuple[str, str]]:
        return (
            []
            if self.server_name is None
            else [("grpc.ssl_target_name_override", self.server_name)]
        )
