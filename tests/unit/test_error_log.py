"""The error path's log costs one line, not a traceback per failure: a handler
failure's traceback is logged in full once per kind (and its repeats name the
request whose log holds it), request errors are bounded per second, and the
envelope's text for a foreign exception is what traceback would have said."""

from __future__ import annotations

import logging
import traceback

import pytest

from kvsvc.errors import BoundedLog
from kvsvc.errors.envelope import describe
from kvsvc.server.rpc.wrapper import Tracebacks


def _fail(where: int) -> BaseException:
    try:
        if where == 0:
            raise RuntimeError("disk on fire")
        raise RuntimeError("disk on fire")  # another line: another traceback
    except RuntimeError as exc:
        return exc


def test_a_repeated_traceback_is_logged_in_full_once(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.tracebacks")
    caplog.set_level(logging.INFO, logger=log.name)
    tb = Tracebacks(log)
    tb.error("Lookup", "req-1", _fail(0))
    tb.error("Lookup", "req-2", _fail(0))
    tb.error("Lookup", "req-3", _fail(1))
    first, repeat, other = caplog.records
    assert first.exc_info and "req-1" in first.getMessage()
    assert not repeat.exc_info
    assert "req-2" in repeat.getMessage() and "as logged for request req-1" in repeat.getMessage()
    assert "disk on fire" in repeat.getMessage()
    assert other.exc_info and "req-3" in other.getMessage()


def test_a_traceback_is_logged_in_full_again_after_its_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test.tracebacks.interval")
    caplog.set_level(logging.INFO, logger=log.name)
    tb = Tracebacks(log, interval_s=0.0)
    tb.error("Lookup", "req-1", _fail(0))
    tb.error("Lookup", "req-2", _fail(0))
    assert all(r.exc_info for r in caplog.records) and len(caplog.records) == 2


def test_bounded_log_lets_n_lines_a_window_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test.bounded")
    caplog.set_level(logging.INFO, logger=log.name)
    bounded = BoundedLog(log, interval_s=3600.0, lines=3)
    for i in range(10):
        bounded.log(logging.INFO, "request %d failed", i)
    assert [r.getMessage() for r in caplog.records] == [f"request {i} failed" for i in range(3)]
    bounded._since -= 3600.0  # the window has passed
    bounded.log(logging.INFO, "request %d failed", 10)
    assert caplog.records[-1].getMessage() == (
        "request 10 failed (7 more such messages not logged since the last one)"
    )


def test_bounded_log_skips_a_level_the_logger_does_not_log() -> None:
    log = logging.getLogger("test.bounded.level")
    log.setLevel(logging.WARNING)
    bounded = BoundedLog(log, interval_s=3600.0, lines=1)
    bounded.log(logging.INFO, "quiet")
    assert bounded._used == 0 and bounded._held == 0


class _Custom(Exception):
    pass


class _BadStr(Exception):
    def __str__(self) -> str:
        raise ValueError("no")


@pytest.mark.parametrize(
    "exc",
    [KeyError("missing"), RuntimeError(), _Custom("x: y"), ValueError("ü" * 5), _BadStr()],
    ids=lambda e: type(e).__name__,
)
def test_describe_says_what_traceback_says(exc: BaseException) -> None:
    assert describe(exc) == "".join(traceback.format_exception_only(type(exc), exc)).strip()


def test_grpc_final_status_to_a_gone_client_is_one_info_line(capsys) -> None:
    """grpc's own ERROR + traceback for a status it could not send to a client that
    hung up becomes one INFO line; grpc's other errors keep their traceback."""
    import logging

    from grpc._cython import cygrpc

    from kvsvc.logs import GRPC_CORE_LOGGER, setup_logging

    setup_logging("INFO", "text")
    core = logging.getLogger(GRPC_CORE_LOGGER)
    gone = cygrpc.ExecuteBatchError(
        'Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation>,)'
    )
    try:
        raise gone
    except cygrpc.ExecuteBatchError:
        core.exception("ExecuteBatchError raised in core by servicer method [/x/WatchEvents]")
    err = capsys.readouterr().err
    assert "INFO grpc._cython.cygrpc" in err and "the client had gone" in err, err
    assert "Traceback" not in err and "ERROR" not in err, err
    try:
        raise RuntimeError("something else")
    except RuntimeError:
        core.exception("a real failure")
    err = capsys.readouterr().err
    assert "ERROR grpc._cython.cygrpc: a real failure" in err and "Traceback" in err, err
