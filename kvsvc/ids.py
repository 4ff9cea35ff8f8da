"""Request ids: 32 lowercase hex characters, unique without a syscall per call.

An id is a random 64-bit prefix drawn once per process (again in a forked child)
followed by a 64-bit counter, so ids never repeat within a process and collide
across processes or restarts only if two draws of ``os.urandom(8)`` do.
``uuid.uuid4()`` costs a ``getrandom`` call (about 2 µs) on every request; this
costs a counter increment and a format (about 0.15 µs).

The ids are unique, not secret: like the request ids they replace, they appear in
logs and error replies; unlike uuid4 they are predictable from one another.
"""

from __future__ import annotations

import itertools
import os

_prefix = ""
_counter = itertools.count()


def _reseed() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count()


_reseed()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed)


def new_request_id() -> str:
    """A fresh request id (the same shape as ``uuid.uuid4().hex``)."""
    return "%s%016x" % (_prefix, next(_counter) & 0xFFFF_FFFF_FFFF_FFFF)  # noqa: UP031 - fastest
