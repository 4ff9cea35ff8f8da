"""Requests that do not parse: the server's request deserializer never raises, so a
peer sending garbage gets the method's own response with a MALFORMED_REQUEST
envelope, and the log a bounded number of lines (:class:`BoundedLog`, which other
modules use for the same reason)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from google.protobuf.message import Message

from kvsvc.errors.classes import NO_TRANSFER, NOT_STARTED, KVServiceError, MalformedRequest
from kvsvc.errors.envelope import to_remote_error
from kvsvc.v1 import error_pb2


class _NoHeader:
    """The header of a request that could not be read: the wrapper assigns an id."""

    request_id = ""
    envelope_version = 0


class Unparsed:
    """What the server's request deserializer hands the handler for bytes that do not
    parse, or that the server refused to parse (too large: see
    kvsvc.server.data.budget). grpc would answer a deserializer exception with
    UNKNOWN and an ERROR traceback per request (a log flood); this way the handler
    answers the method's own response with the error's envelope (MALFORMED_REQUEST:
    INVALID_ARGUMENT). ``ids``: a session message's request ids, each answered."""

    __slots__ = ("error", "ids")
    header = _NoHeader()

    def __init__(self, error: KVServiceError, ids: Sequence[int] = ()) -> None:
        self.error = error
        self.ids = list(ids)

    def envelope(self, request_id: str, transfer: bool) -> error_pb2.RemoteError:
        """The reply's error; a transfer that did not parse never started."""
        return to_remote_error(self.error, request_id, NOT_STARTED if transfer else NO_TRANSFER)


class BoundedLog:
    """At most ``lines`` lines per ``interval_s``, counting what it held back (said
    in the next line it lets through): a peer sending garbage, or a flood of
    failing requests, must not be able to fill the log or spend the server's time
    writing it (a log line costs tens of microseconds, a Lookup a hundred or so)."""

    def __init__(self, logger: logging.Logger, interval_s: float, lines: int = 1) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.lines = lines
        self._since = -math.inf  # when the current interval began
        self._used = 0
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: object) -> None:
        self.log(logging.WARNING, msg, *args)

    def log(
        self, level: int, msg: str, *args: object, extra: dict[str, object] | None = None
    ) -> None:
        """``extra``: the line's structured fields (kvsvc.logs.FIELDS)."""
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            if now - self._since >= self.interval_s:
                self._since, self._used = now, 0
            if self._used >= self.lines:
                self._held += 1
                return
            self._used += 1
            held, self._held = self._held, 0
        if held:
            msg += f" ({held} more such messages not logged since the last one)"
        self.logger.log(level, msg, *args, extra=extra)


MALFORMED_LOG_INTERVAL_S = 10.0
_malformed_log = BoundedLog(
    logging.getLogger("kvsvc.server.rpc.servicer"), MALFORMED_LOG_INTERVAL_S
)


def request_parser(message_cls: type[Message]) -> Callable[[bytes], Message | Unparsed]:
    """A request deserializer for ``message_cls`` that never raises: bytes that do not
    parse become :class:`Unparsed`, logged at a bounded rate."""
    name = message_cls.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Message | Unparsed:
        try:
            return message_cls.FromString(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or worse: still a reply
            _malformed_log.warning(
                "a request of %d bytes does not parse as %s: %s", len(raw), name, exc
            )
            return Unparsed(
                MalformedRequest(
                    f"the request bytes do not parse as {name}",
                    metadata={
                        "messageType": name,
                        "sizeBytes": len(raw),
                        "error": type(exc).__name__,
                    },
                )
            )

    return parse
