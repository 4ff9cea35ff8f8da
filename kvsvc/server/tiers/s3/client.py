"""The S3 tier's connection to its endpoint: the boto3 client (its settings,
credentials from --s3-credentials-file or the standard AWS environment, no
retries), what kind each failure was (the label of kvsvc_s3_errors_total), and
the circuit breaker that stops calling an endpoint that keeps failing."""

from __future__ import annotations

import configparser
import logging
from typing import Any

from kvsvc.errors import BoundedLog
from kvsvc.server.config import ConfigError, ServerConfig

log = logging.getLogger("kvsvc.server.tiers.s3")
#: at most one such warning per 10 s for the whole tier (a failing endpoint fails every call)
warn = BoundedLog(log, 10.0)

# Failures in a row that open the breaker; then one probe call after this long.
BREAKER_FAILURES = 3
BREAKER_OPEN_S = 2.0

# Error kinds. MISSING is not a failure (a miss); the others feed the breaker.
MISSING, AUTH, BUCKET, TIMEOUT, CONNECTION, SERVER, BREAKER_OPEN, BUSY, OTHER = (
    "missing",
    "auth",
    "bucket",
    "timeout",
    "connection",
    "server",
    "breaker_open",
    "busy",
    "other",
)

_AUTH_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "403",
}


def require_boto3() -> Any:
    """boto3, or a ConfigError saying how to install it (the ``s3`` extra)."""
    try:
        import boto3
    except ImportError:
        raise ConfigError(
            "--s3-endpoint needs boto3: pip install 'kvsvc[s3]' (or pip install boto3)"
        ) from None
    return boto3


def credentials(config: ServerConfig) -> dict[str, str]:
    """Keys from --s3-credentials-file's ``[default]`` profile; {} leaves them to
    boto3's standard chain (AWS_ACCESS_KEY_ID..., ~/.aws, an instance role)."""
    path = config.tiers.s3_credentials_file
    if not path:
        return {}
    parser = configparser.ConfigParser()
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except OSError as exc:
        raise ConfigError(f"--s3-credentials-file {path}: {exc.strerror}") from None
    except configparser.Error as exc:
        raise ConfigError(f"--s3-credentials-file {path}: not an AWS credentials file") from exc
    if not parser.has_section("default"):
        raise ConfigError(f"--s3-credentials-file {path}: no [default] profile")
    section = parser["default"]
    out = {}
    for option in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
        if section.get(option):
            out[option] = section[option].strip()
    if "aws_access_key_id" not in out or "aws_secret_access_key" not in out:
        raise ConfigError(
            f"--s3-credentials-file {path}: [default] needs aws_access_key_id and "
            "aws_secret_access_key"
        )
    return out


def make_client(config: ServerConfig, connections: int) -> Any:
    """A thread-safe boto3 S3 client: path-style addressing (what S3-compatible
    servers take), one attempt per call (the tier's breaker decides what to try
    again), checksums only where S3 requires them (every object carries its own
    CRC-32C per segment, checked as it is read)."""
    boto3 = require_boto3()
    from botocore.config import Config

    tiers = config.tiers
    session = boto3.session.Session(region_name=tiers.s3_region, **credentials(config))
    return session.client(
        "s3",
        endpoint_url=tiers.s3_endpoint,
        config=Config(
            connect_timeout=tiers.s3_timeout,
            read_timeout=tiers.s3_timeout,
            retries={"max_attempts": 1, "mode": "standard"},
            max_pool_connections=connections,
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def error_kind(exc: BaseException) -> str:
    """What kind of failure ``exc`` (raised by boto3, or by a body read) was."""
    from botocore import exceptions as bx

    if isinstance(exc, bx.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("NoSuchKey", "404", "NotFound"):
            return MISSING
        if code == "NoSuchBucket":
            return BUCKET
        if code in _AUTH_CODES or status == 403:
            return AUTH
        if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError"):
            return SERVER
        return OTHER
    if isinstance(exc, bx.ReadTimeoutError | bx.ConnectTimeoutError | TimeoutError):
        return TIMEOUT
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return AUTH
    if isinstance(
        exc,
        bx.EndpointConnectionError
        | bx.ConnectionClosedError
        | bx.ResponseStreamingError
        | bx.IncompleteReadError
        | bx.HTTPClientError
        | OSError,
    ):
        return CONNECTION
    return OTHER
