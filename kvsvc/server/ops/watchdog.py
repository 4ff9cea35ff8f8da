"""The watchdog: a thread (not the event loop, which it watches) that declares the
server stalled when a copy runs past ``--stall-timeout``, a copy worker is dead,
or the loop misses its heartbeat because of what runs on it.

A late heartbeat is not always the loop's doing. On a host with more runnable
threads than CPUs the loop's thread can wait on a run queue for seconds while
nothing in kvsvc blocks it; restarting the server then only adds load. So the
lateness is split with the kernel's counters of the loop's thread
(``/proc/self/task/TID/schedstat``: nanoseconds on a CPU, and waiting on a run
queue), read at each heartbeat and again when the heartbeat is late: what the
thread spent waiting for a CPU is the host's; the rest (computing, or blocked in a
syscall, a lock, a sleep, the GIL: all asleep to the kernel, which is why the CPU
time alone cannot tell) is the loop's own. Only the loop's own lateness past the
timeout is fatal. A heartbeat late past the timeout mostly by the host is host
starvation: logged (once per episode, with the split) and counted, and health
stays as it is. Where the kernel keeps no such counters,
all of the lateness counts as the loop's, as it must: a stall is never excused
without evidence."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvsvc.errors import FatalServerError, KVServiceError

if TYPE_CHECKING:
    from kvsvc.server.data.engine import TransferEngine

log = logging.getLogger(__name__)

#: (nanoseconds on a CPU, nanoseconds runnable and waiting on a run queue)
Counters = tuple[int, int]


class SchedCounters(Protocol):
    """One thread's scheduler counters."""

    def read(self) -> Counters | None: ...

    def close(self) -> None: ...


class ThreadSched:
    """The kernel's counters of thread ``tid`` of this process, read without a new
    open each time (a few microseconds); None where the kernel keeps none."""

    def __init__(self, tid: int) -> None:
        try:
            self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1

    def read(self) -> Counters | None:
        if self._fd < 0:
            return None
        try:
            on_cpu, waiting = os.pread(self._fd, 128, 0).split()[:2]
            return int(on_cpu), int(waiting)
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Fatal(Protocol):
    """Where a verdict goes without the loop (kvsvc.server.ops.health.Health)."""

    def fatal_from_thread(self, reason: str, detail: str) -> None: ...


@dataclass(frozen=True)
class Beat:
    """A heartbeat: when the loop ran it, and its thread's counters then."""

    at: float
    counters: Counters | None


@dataclass(frozen=True)
class Lateness:
    """How a late heartbeat's ``late`` seconds were spent by the loop's thread;
    ``waiting`` is None where the kernel keeps no counters."""

    late: float
    computing: float
    waiting: float | None

    @property
    def own(self) -> float:
        """What the loop itself is late by: all but its wait for a CPU."""
        return self.late - (self.waiting or 0.0)

    def describe(self) -> str:
        if self.waiting is None:
            return "no run-queue counters on this kernel: all of it counted as the loop's"
        blocked = max(self.own - self.computing, 0.0)
        return (
            f"{self.computing:.1f} s computing, {blocked:.1f} s blocked (a syscall, a lock, "
            f"a sleep, the GIL), {self.waiting:.1f} s runnable but waiting for a CPU"
        )


class Watchdog:
    """A thread that declares the server stalled (see the module docstring). A
    polling deadline on the client cannot see a worker that is stuck rather than
    failed; this can.

    Its verdict goes to ``on_fatal`` (which hands it to the loop) and, without the
    loop, to ``health`` (:meth:`Health.fatal_from_thread`): a hung loop would never
    run what ``on_fatal`` queued, yet the health port must say NOT_SERVING."""

    PERIOD_S = 0.02
    #: How long ``stop`` waits for the thread; a check takes microseconds.
    STOP_JOIN_S = 5.0

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        engine: TransferEngine,
        stall_timeout: float,
        on_fatal: Callable[[KVServiceError], None],
        health: Fatal | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sched: Callable[[int], SchedCounters] = ThreadSched,
    ) -> None:
        self.loop = loop
        self.health = health
        self.engine = engine
        self.stall_timeout = stall_timeout
        self.on_fatal = on_fatal
        self._clock = clock
        self._sched = sched
        #: the loop thread's counters, once the first heartbeat ran on it
        self.loop_sched: SchedCounters | None = None
        self.beat = Beat(clock(), None)
        #: episodes of host starvation: the heartbeat late past the timeout, mostly
        #: waiting for a CPU, the loop's own part not past it (logged once each;
        #: health untouched)
        self.starved = 0
        self._starved_beat: Beat | None = None  # the episode being logged
        self._stop = threading.Event()
        # Held for a whole check-and-report, so once ``stop`` has taken it no verdict
        # can follow (a shutdown that stops the workers next must not read as a death).
        self._lock = threading.Lock()
        self._workers = engine.workers_alive()
        self._thread = threading.Thread(target=self._run, name="kvsvc-watchdog", daemon=True)
        self._beat_task: asyncio.Task[None] | None = None

    async def _heartbeat(self) -> None:
        self.loop_sched = self._sched(threading.get_native_id())
        while True:
            self.heartbeat()
            await asyncio.sleep(self.PERIOD_S)

    def heartbeat(self) -> None:
        """On the loop: it answers now."""
        sched = self.loop_sched
        self.beat = Beat(self._clock(), sched.read() if sched is not None else None)

    def start(self) -> None:
        self._beat_task = self.loop.create_task(self._heartbeat())
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, for good, before what it watches is torn down: after this
        returns no verdict is reported, and the thread has ended (bounded wait).
        Called on the loop."""
        with self._lock:
            self._stop.set()
        if self._beat_task is not None:
            self._beat_task.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.STOP_JOIN_S)
            if self._thread.is_alive():  # pragma: no cover - it only waits on the event
                log.warning("watchdog thread still running %.0f s after stop", self.STOP_JOIN_S)
                return
        if self.loop_sched is not None:
            self.loop_sched.close()

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            if self.look():
                return

    def look(self) -> bool:
        """One check; a verdict is reported (True: the watch is over)."""
        with self._lock:
            if self._stop.is_set():
                return True
            exc = self.check()
            if exc is None:
                return False
            log.critical("watchdog: %s", exc.message)
            try:
                self.on_fatal(exc)  # queued copies stop starting at once, then the loop
            except RuntimeError as err:  # the loop closed under us: nobody to tell
                log.warning("watchdog verdict not delivered: %s", err)
            if self.health is not None:  # not through the loop, which may hang
                self.health.fatal_from_thread(exc.reason, exc.message)
            return True

    def check(self) -> KVServiceError | None:
        now = self._clock()
        stalled = self.engine.stalled(self.stall_timeout)
        if stalled:
            thread, tid, seconds = stalled[0]
            return FatalServerError(
                f"copy {tid} on {thread} has run {seconds:.1f} s, "
                f"past the {self.stall_timeout:g} s stall timeout",
                reason="TRANSFER_STALLED",
                metadata={"transferId": tid, "thread": thread, "stallTimeoutS": self.stall_timeout},
            )
        if self.engine.workers_alive() < self._workers:
            return FatalServerError("a transfer worker thread died", reason="TRANSFER_WORKER_DIED")
        beat = self.beat
        if now - beat.at <= self.stall_timeout:
            self._answered(beat, now)
            return None
        late = self.lateness(beat, now)
        if late.own > self.stall_timeout:
            return FatalServerError(
                f"the event loop missed its heartbeat for {late.late:.1f} s ({late.describe()})",
                reason="EVENT_LOOP_STALLED",
                metadata={
                    "stalledS": f"{late.late:.1f}",
                    "ownS": f"{late.own:.1f}",
                    "waitingForCpuS": "unknown" if late.waiting is None else f"{late.waiting:.1f}",
                },
            )
        if late.waiting is not None and late.waiting > late.own:
            self._starving(beat, late)
        # else the loop's own part may still reach the timeout: no word yet
        return None

    def lateness(self, beat: Beat, now: float) -> Lateness:
        """How the loop's thread spent the time since ``beat``."""
        sched = self.loop_sched
        counters = sched.read() if sched is not None else None
        if beat.counters is None or counters is None:
            return Lateness(now - beat.at, 0.0, None)
        computing = (counters[0] - beat.counters[0]) / 1e9
        waiting = (counters[1] - beat.counters[1]) / 1e9
        return Lateness(now - beat.at, computing, waiting)

    def _starving(self, beat: Beat, late: Lateness) -> None:
        """The heartbeat is late past the timeout, but by the host: logged once an
        episode (health is left as it is)."""
        if self._starved_beat is beat:
            return
        self._starved_beat = beat
        self.starved += 1
        log.warning(
            "watchdog: the event loop's heartbeat is %.1f s late, but the host is "
            "starving it of CPU, not kvsvc blocking it (%s): health stays as it is; "
            "give the server more CPU or fewer neighbours (episode %d)",
            late.late,
            late.describe(),
            self.starved,
        )

    def _answered(self, beat: Beat, now: float) -> None:
        """A starvation episode is over: the loop answers again."""
        if self._starved_beat is not None and self._starved_beat is not beat:
            log.warning(
                "watchdog: the event loop answers again after %.1f s of host starvation",
                beat.at - self._starved_beat.at,
            )
            self._starved_beat = None
