"""Logging: text or one JSON object per line, each record carrying the id of the
request it belongs to (set by the RPC wrapper), so a RemoteError's request_id
finds its traceback, and the structured fields a record was given (``FIELDS``,
through logging's ``extra``): their own keys in JSON, ``key=value`` after the
message in text, so a log pipeline filters by reason or tenant without parsing
messages."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime

#: The request being handled in the current task; "" outside a request.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvsvc_request_id", default="")


#: The fields a record may carry beside its message (logging's ``extra``): the RPC,
#: the error's reason, the caller's tenant, the namespace concerned, the call's
#: duration in milliseconds. Never a token or a key's bytes.
FIELDS = ("rpc", "reason", "tenant", "namespace", "duration_ms")


def _fields(record: logging.LogRecord) -> dict[str, object]:
    out: dict[str, object] = {}
    for name in FIELDS:
        value = getattr(record, name, None)
        if value is not None and value != "":
            out[name] = value
    return out


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = REQUEST_ID.get()
        return True


def iso_time(created: float) -> str:
    """ISO-8601 in UTC with its offset and milliseconds (2026-01-02T03:04:05.678+00:00),
    which log pipelines parse without guessing the server's time zone."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "")
        if request_id:
            out["request_id"] = request_id
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _TextFormatter(logging.Formatter):
    """The classic line, then each structured field as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = _fields(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{k}={v}" for k, v in fields.items())


class ClientGoneFilter(logging.Filter):
    """grpc's aio server logs at ERROR, with a traceback, a stream's final status that
    it could not send because the client had already hung up (ExecuteBatchError on
    SendStatusFromServerOperation). Nothing failed on the server's side, and the
    request was answered or abandoned by its client, so it becomes one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (
            exc is not None
            and type(exc).__name__ == "ExecuteBatchError"
            and "SendStatusFromServerOperation" in str(exc)
        ):
            record.msg = "%s: its final status was not sent (the client had gone)"
            record.args = (record.getMessage(),)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


#: The logger grpc's Cython core logs its server errors to.
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"


def setup_logging(level: str, fmt: str) -> None:
    grpc_core = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, ClientGoneFilter) for f in grpc_core.filters):
        grpc_core.addFilter(ClientGoneFilter())
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
