"""Pidfds of processes and whether they exited: how the server learns an engine
that passed it memory died, and how an engine learns the server that copied its
memory died (a dead process copies nothing: its exit proves its copies ended).

A pidfd names one process, never a later one that reuses its pid; one can be had
only for a pid this pid namespace sees (a peer in another shows as pid 0) and
where the kernel has them (Linux 5.3+): elsewhere there is no pidfd, and callers
treat the process as not known to have exited."""

from __future__ import annotations

import os
import select
import weakref


def pidfd(pid: int) -> int:
    """A pidfd of ``pid``, or -1 where it cannot be had (a peer in another pid
    namespace shows as pid 0; it may also have exited already; no pidfds here)."""
    open_pidfd = getattr(os, "pidfd_open", None)
    if pid <= 0 or open_pidfd is None:
        return -1
    try:
        return int(open_pidfd(pid))
    except OSError:
        return -1


def exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (its pidfd is readable).
    poll, not select: a server holding many fds has pidfds past FD_SETSIZE."""
    if pidfd < 0:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class ProcessWatch:
    """A pidfd this object owns: closed by ``close`` or once the watch is dropped,
    so a watch kept by whoever may need it (several held tasks) needs no owner."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    def exited(self) -> bool:
        """Whether the process has exited (False once the watch is closed: unknown)."""
        return self._close.alive and exited(self._fd)

    def close(self) -> None:
        self._close()
