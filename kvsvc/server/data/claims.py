"""How the tasks of one chunk's copy share its segments (``Claims``): each task
copies its own range from the front and then helps with the others' from their
back, so every copy thread ends within about a segment of the others."""

from __future__ import annotations

import ctypes
import threading

from kvsvc.server.data.checksum import SEGMENT_BYTES


class Claims:
    """One chunk's segments split into a range per task, each claimed a segment at a
    time: from its front by its own task, from its back by a task that has finished
    its own (only once the owner has claimed its first, so each range's first
    segment is always its owner's). Every thread ends within about a segment of the
    others, however late a copy thread woke; each segment is copied once. The
    native loop claims in C (one GIL-free call per task); the Python loop under a
    lock. ``owner[s]`` is the task (+1) that copied segment s; ``digests`` the
    segments' CRCs (a Store's results, a Retrieve's expected values)."""

    def __init__(self, bounds: list[tuple[int, int]], expected: list[int] | None) -> None:
        n = bounds[-1][1]
        self.bounds = bounds
        self.ranges = (ctypes.c_uint64 * len(bounds))(*(a | b << 32 for a, b in bounds))
        self.starts = (ctypes.c_uint32 * len(bounds))(*(a for a, _ in bounds))
        self.owner = (ctypes.c_uint8 * n)()
        self.digests = (ctypes.c_uint32 * n)(*(expected or []))
        self._lock = threading.Lock()

    def share(self, me: int) -> int:
        a, b = self.bounds[me]
        return (b - a) * SEGMENT_BYTES

    def next(self, me: int) -> int | None:
        """(Python loop) The next segment task ``me`` copies, or None: all are taken."""
        with self._lock:
            order = [me, *(k for k in range(len(self.bounds)) if k != me)]
            for k in order:
                v = self.ranges[k]
                front, back = v & 0xFFFFFFFF, v >> 32
                if front >= back or (k != me and front == self.starts[k]):
                    continue
                if k == me:
                    self.ranges[k] = (front + 1) | back << 32
                    s = front
                else:
                    self.ranges[k] = front | (back - 1) << 32
                    s = back - 1
                self.owner[s] = me + 1
                return s
            return None

    def stop(self) -> None:
        """(Python loop) A check failed: nobody claims another segment."""
        with self._lock:
            for k in range(len(self.bounds)):
                back = self.ranges[k] >> 32
                self.ranges[k] = back | back << 32

    def mine(self, me: int) -> list[int]:
        """The segments task ``me`` copied (once every task has ended)."""
        return [s for s, o in enumerate(self.owner) if o == me + 1]
