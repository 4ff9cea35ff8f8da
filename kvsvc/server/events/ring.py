"""The bounded ring of recent events: what a watcher with a cursor resumes from.

Bounded by count and by bytes (the oldest events leave first); a cursor it can no
longer serve is answered ``None`` and the watcher resyncs from a snapshot. Appending
and finding a cursor are O(1) (a list with a moving head, compacted now and then),
so publishing never costs the event loop more than a Store's own bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

#: What an event holds in the ring beside its keys' bytes (the object, its tuple).
EVENT_OVERHEAD_BYTES = 120
#: What one key costs beside its bytes (a bytes object's header, a tuple slot).
KEY_OVERHEAD_BYTES = 41

STORED, REMOVED, CLEARED = 1, 2, 3


@dataclass(frozen=True, slots=True)
class Event:
    """One event as published: ``namespace`` is the store's (tenant-scoped) name;
    ``value`` is the bytes of a stored event, or the pb reason of a removed or
    cleared one; ``tier`` a pb Tier."""

    seq: int
    kind: int
    namespace: str
    keys: tuple[bytes, ...]
    layout: str
    value: int
    tier: int

    @property
    def cost(self) -> int:
        """Bytes of server memory this event holds while in the ring."""
        return (
            EVENT_OVERHEAD_BYTES
            + len(self.namespace)
            + len(self.layout)
            + sum(len(k) + KEY_OVERHEAD_BYTES for k in self.keys)
        )


class EventRing:
    """Events ``first..last`` (numbered from 1), at most ``max_events`` of them and
    at most ``max_bytes`` of memory (one event is always kept, however big)."""

    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._events: list[Event] = []
        self._costs: list[int] = []
        self._head = 0  # index of the oldest event kept
        self.bytes = 0
        #: sequence of the newest event (0: none yet)
        self.last = 0
        #: events that left the ring for its bounds (how often a slow cursor loses)
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._events) - self._head

    @property
    def first(self) -> int:
        """Sequence of the oldest event kept (last + 1 when empty)."""
        return self.last - len(self) + 1

    def append(self, event: Event) -> None:
        if event.seq != self.last + 1:
            raise ValueError(f"event {event.seq} after {self.last}: sequences have no gaps")
        cost = event.cost
        self._events.append(event)
        self._costs.append(cost)
        self.bytes += cost
        self.last = event.seq
        while len(self) > 1 and (len(self) > self.max_events or self.bytes > self.max_bytes):
            self.bytes -= self._costs[self._head]
            self._head += 1
            self.dropped += 1
        if self._head > 1024 and self._head * 2 > len(self._events):
            del self._events[: self._head]
            del self._costs[: self._head]
            self._head = 0

    def after(self, seq: int, most: int) -> list[Event] | None:
        """Up to ``most`` events after ``seq`` (the last one applied), oldest first;
        None when the ring no longer holds the one right after it (or ``seq`` is
        ahead of the ring: a cursor this incarnation never gave out)."""
        if seq > self.last or seq < self.first - 1:
            return None
        start = self._head + (seq - self.first + 1)
        return self._events[start : start + most]
