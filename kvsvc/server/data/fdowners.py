"""Who owns a memfd passed over the fd socket, so that a dead engine's KV memory
is not kept alive by the server's mapping: a lease connection (``Lease``: it owns
what was passed over it until it closes), else the passing process through a
pidfd (``PidOwner``, one per region; ``SharedPidfd``, the broker's own, shared by
every fd that process passed). A peer in another pid namespace has pid 0 here and
no pidfd: no owner. Pidfds themselves (opening one, whether its process exited)
are kvsvc.pidfds', shared with the client, which watches the server the same way."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Protocol

from kvsvc.pidfds import exited


class Owner(Protocol):
    """What a mapped memfd region asks about the engine that passed it."""

    def gone(self) -> bool: ...

    def close(self) -> None: ...


class Lease:
    """An engine's lease connection on the fd socket: it owns every fd passed over
    it until it closes (the broker calls ``end``). Shared by the regions that use
    those fds; their ``close`` leaves it alone."""

    def __init__(self, pid: int, uid: int) -> None:
        self.pid = pid  # as SO_PEERCRED shows it: 0 from another pid namespace
        self.uid = uid
        self._ended = threading.Event()

    def gone(self) -> bool:
        return self._ended.is_set()

    def close(self) -> None:
        """A region let go of it; the lease lives on while its connection does."""

    def end(self) -> None:
        self._ended.set()


class PidOwner:
    """A region's own pidfd of the process that passed its fd (one-shot passes)."""

    def __init__(self, pidfd: int) -> None:
        self.fd = pidfd

    def gone(self) -> bool:
        return exited(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class SharedPidfd:
    """A pidfd of a process that passed fds, shared by all the fds it passed."""

    pid: int
    fd: int
    refs: int = 0
