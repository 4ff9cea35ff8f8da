"""The events stream (WatchEvents): EventLog, where server code publishes what
became present or left (kvsvc.server.events.log), the bounded ring a cursor resumes
from (ring), and the stream's handler with its paged snapshot (stream)."""

from kvsvc.server.events.log import REMOVAL_REASONS, EventLog, StoreEvents
from kvsvc.server.events.stream import Watchers

__all__ = ["REMOVAL_REASONS", "EventLog", "StoreEvents", "Watchers"]
