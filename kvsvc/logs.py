"""Logging: text or one JSON object per line, each record carrying the id of the
request it belongs to (set by the RPC wrapper), so a RemoteError's request_id
finds its traceback."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import datetime, timezone

#: The request being handled in the current task; "" outside a request.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvsvc_request_id", default="")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = REQUEST_ID.get()
        return True


def iso_time(created: float) -> str:
    """ISO-8601 in UTC with its offset and milliseconds (2026-01-02T03:04:05.678+00:00),
    which log pipelines parse without guessing the server's time zone."""
    return datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="milliseconds")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "")
        if request_id:
            out["request_id"] = request_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


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
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
