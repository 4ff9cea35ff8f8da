"""The watchdog's verdict on a late heartbeat, driven by a fake clock and fake
scheduler counters of the loop's thread (no timing): lateness the loop spent
waiting for a CPU is the host's (logged, counted, health left alone); computing
or blocked (a syscall, a lock, a sleep) is the loop's own, fatal past the
timeout; without counters all of it is the loop's."""

from __future__ import annotations

import logging
import threading

import pytest

from kvsvc.server.ops.watchdog import ThreadSched, Watchdog

TIMEOUT = 10.0
S = 1_000_000_000  # nanoseconds


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counters:
    """The loop thread's (on-CPU ns, run-queue wait ns), as the test sets them."""

    def __init__(self, available: bool = True) -> None:
        self.on_cpu = 5 * S
        self.waiting = 7 * S
        self.available = available
        self.closed = False

    def read(self) -> tuple[int, int] | None:
        return (self.on_cpu, self.waiting) if self.available and not self.closed else None

    def close(self) -> None:
        self.closed = True


class Engine:
    def stalled(self, timeout: float) -> list[tuple[str, str, float]]:
        return []

    def workers_alive(self) -> int:
        return 2


class Health:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []

    def fatal_from_thread(self, reason: str, detail: str) -> None:
        self.failed.append((reason, detail))


def watchdog(counters: Counters) -> tuple[Watchdog, Clock, Health, list]:
    clock, health, verdicts = Clock(), Health(), []
    wd = Watchdog(None, Engine(), TIMEOUT, verdicts.append, health, clock=clock)  # type: ignore[arg-type]
    wd.loop_sched = counters  # as the first heartbeat on the loop sets it
    wd.heartbeat()
    return wd, clock, health, verdicts


def late_by(clock: Clock, counters: Counters, *, computing: float, waiting: float, late: float):
    clock.now += late
    counters.on_cpu += int(computing * S)
    counters.waiting += int(waiting * S)


def test_a_loop_late_only_by_waiting_for_a_cpu_is_host_starvation_not_a_stall(caplog) -> None:
    counters = Counters()
    wd, clock, health, verdicts = watchdog(counters)
    late_by(clock, counters, computing=0.3, waiting=11.5, late=12.0)
    with caplog.at_level(logging.WARNING, "kvsvc.server.ops.watchdog"):
        assert wd.check() is None
        assert wd.look() is False  # the same episode: logged once
    assert (health.failed, verdicts, wd.starved) == ([], [], 1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "12.0 s late" in line and "starving it of CPU" in line, line
    assert "0.3 s computing" in line and "11.5 s runnable but waiting for a CPU" in line, line

    caplog.clear()
    wd.heartbeat()  # the loop ran again
    with caplog.at_level(logging.WARNING, "kvsvc.server.ops.watchdog"):
        assert wd.check() is None
    assert ["answers again after 12.0 s" in r.getMessage() for r in caplog.records] == [True]

    late_by(clock, counters, computing=0.0, waiting=10.5, late=10.6)  # a second episode
    assert wd.look() is False
    assert (health.failed, verdicts, wd.starved) == ([], [], 2)


def test_a_loop_late_by_its_own_computation_is_a_stall() -> None:
    counters = Counters()
    wd, clock, _, _ = watchdog(counters)
    late_by(clock, counters, computing=11.0, waiting=0.5, late=11.5)
    exc = wd.check()
    assert exc is not None and exc.reason == "EVENT_LOOP_STALLED"
    assert "missed its heartbeat for 11.5 s" in exc.message
    assert "11.0 s computing, 0.0 s blocked" in exc.message, exc.message
    assert exc.metadata["waitingForCpuS"] == "0.5"


def test_a_loop_blocked_in_a_syscall_uses_no_cpu_and_is_still_a_stall() -> None:
    """A blocking read (or a lock, or a sleep) on the loop: neither on a CPU nor
    waiting for one. CPU time alone would excuse it; the run-queue wait does not."""
    counters = Counters()
    wd, clock, health, verdicts = watchdog(counters)
    late_by(clock, counters, computing=0.0, waiting=0.1, late=10.5)
    assert wd.look() is True
    (exc,) = verdicts
    assert exc.reason == "EVENT_LOOP_STALLED" and "10.4 s blocked" in exc.message
    assert [reason for reason, _ in health.failed] == ["EVENT_LOOP_STALLED"]


def test_only_the_loops_own_part_counts_against_the_timeout() -> None:
    counters = Counters()
    wd, clock, _, _ = watchdog(counters)
    late_by(clock, counters, computing=2.0, waiting=14.0, late=23.0)  # own: 9 s
    assert wd.check() is None and wd.starved == 1
    late_by(clock, counters, computing=0.0, waiting=0.0, late=1.5)  # own: 10.5 s
    exc = wd.check()
    assert exc is not None and exc.reason == "EVENT_LOOP_STALLED"
    assert exc.metadata["ownS"] == "10.5"


def test_a_loop_late_mostly_by_itself_is_no_starvation_while_it_is_under_the_timeout(
    caplog,
) -> None:
    counters = Counters()
    wd, clock, health, verdicts = watchdog(counters)
    late_by(clock, counters, computing=6.0, waiting=4.5, late=10.5)  # own: 6 s
    with caplog.at_level(logging.WARNING, "kvsvc.server.ops.watchdog"):
        assert wd.look() is False
    assert (caplog.records, health.failed, verdicts, wd.starved) == ([], [], [], 0)
    late_by(clock, counters, computing=4.5, waiting=0.0, late=4.5)  # own: 10.5 s
    assert wd.look() is True
    assert [v.reason for v in verdicts] == ["EVENT_LOOP_STALLED"]


def test_without_the_kernels_counters_all_the_lateness_is_the_loops() -> None:
    counters = Counters(available=False)
    wd, clock, _, _ = watchdog(counters)
    late_by(clock, counters, computing=0.0, waiting=11.0, late=11.0)
    exc = wd.check()
    assert exc is not None and exc.reason == "EVENT_LOOP_STALLED"
    assert "no run-queue counters" in exc.message
    assert exc.metadata["waitingForCpuS"] == "unknown"


def test_a_heartbeat_within_the_timeout_is_no_verdict() -> None:
    counters = Counters()
    wd, clock, health, verdicts = watchdog(counters)
    late_by(clock, counters, computing=9.9, waiting=0.0, late=9.9)
    assert wd.look() is False
    assert (health.failed, verdicts, wd.starved) == ([], [], 0)


def test_the_counters_of_a_thread_are_the_kernels() -> None:
    sched = ThreadSched(threading.get_native_id())
    try:
        first = sched.read()
        if first is None:
            pytest.skip("this kernel keeps no /proc/self/task/TID/schedstat")
        sum(range(200_000))  # some CPU: the on-CPU counter does not go back
        second = sched.read()
        assert second is not None and second[0] >= first[0] > 0 and second[1] >= first[1] >= 0
    finally:
        sched.close()
    assert sched.read() is None
    assert ThreadSched(-1).read() is None  # no such thread
