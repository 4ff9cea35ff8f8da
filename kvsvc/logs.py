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


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
