"""The tiers' circuit breaker (kvsvc.server.tiers.breaker), shared by Redis and S3:
closed until ``failures`` in a row, then open with one probe every ``open_s``; each
transition one log line in the tier's words."""

from __future__ import annotations

import logging

import pytest

from kvsvc.server.tiers import breaker as breaker_module
from kvsvc.server.tiers.breaker import CLOSED, HALF_OPEN, OPEN, Breaker


def breaker(failures: int, open_s: float) -> Breaker:
    return Breaker(failures, open_s, tier="remote", what="Redis", meanwhile="reads are misses")


class Clock:
    """The breaker's clock, moved by the test: no real time passes, so a busy
    machine cannot make a wait look longer than it was."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_it_opens_after_failures_and_lets_one_probe_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(breaker_module.time, "monotonic", clock)
    b = breaker(3, 5.0)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == CLOSED
    b.failure()
    assert b.state == OPEN and b.blocked() and not b.allow()
    clock.now += 5.0
    assert not b.blocked()  # asking does not take the probe's turn
    assert b.allow() and b.state == HALF_OPEN and b.blocked()
    assert not b.allow()  # one probe at a time
    b.failure()
    assert b.state == OPEN and not b.allow()
    clock.now += 5.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow()
    assert b.opened_total == 1  # reopened after a failed probe is the same outage


def test_each_transition_is_one_line_in_the_tiers_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = breaker(2, 0.0)
    with caplog.at_level(logging.WARNING, logger="kvsvc.server.tiers"):
        b.failure()
        b.failure()
        b.failure()  # already open: no second line
        assert b.allow()
        b.success()
        b.success()  # already closed: no line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "remote tier: 2 Redis failures in a row; breaker open, probing every 0 s "
        "(reads are misses)",
        "remote tier: Redis answers again; breaker closed",
    ]
