"""Named fault-injection points in the real code paths (like etcd's gofail).

Inert until :func:`load` installs a table: ``kvsvc serve`` loads the environment
variable ``KVSVC_FAILPOINTS`` at start-up (:func:`load_from_env`), e.g.
``transfer.before_copy=raise;store.put=sleep(2000)``. Importing this module reads
nothing, so importing the server never fails on a bad table and an embedded server
(tests, the demo) injects nothing. No request can enable one.

Actions: ``raise`` (a RuntimeError), ``sleep(MS)``, ``hang`` (blocks the thread
for good), ``kill-thread`` (raises a BaseException: a transfer worker dies of it).
An action may be prefixed with a probability, ``0.01*raise``, and with a tag
that limits it to one rank or RPC, ``map.rank=2@raise``, ``handler.enter=Lookup@raise``.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time

POINTS: dict[str, str] = {
    "handler.enter": "start of every RPC handler, before dispatch; sleep and hang delay only "
    "that request (tag: the RPC name)",
    "loop.stall": "start of every RPC handler; sleep and hang block the whole event loop "
    "(tag: the RPC name)",
    "transfer.before_copy": "transfer worker, after the deadline check, before any byte moves",
    "transfer.copy": "transfer worker, in the middle of a copy (after the first chunk)",
    "transfer.after_copy": "transfer worker, after the copy, before the reply",
    "store.put": "chunk store, before a chunk is reserved (event loop)",
    "map.rank": "Map, before each rank is opened (tag: the rank index)",
    "remote.resolve": "remote tier, its DNS lookup of --remote's host name (its own thread; "
    "sleep and hang: a DNS server that answers late or never)",
}

TAGGED = frozenset({"handler.enter", "loop.stall", "map.rank"})
_ACTION = re.compile(
    r"^(?:(?P<p>[0-9.]+)\*)?(?P<name>raise|hang|kill-thread|sleep\((?P<ms>\d+)\))$"
)


class FailpointError(RuntimeError):
    """Raised by a ``raise`` failpoint."""


class FailpointThreadKill(BaseException):
    """Raised by ``kill-thread``: not an Exception, so it kills the thread it hits."""


def parse(spec: str) -> dict[str, tuple[float, str, int, str]]:
    """``name=[TAG@][p*]action;...`` -> {name: (probability, action, ms, tag)}."""
    table: dict[str, tuple[float, str, int, str]] = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, action = item.partition("=")
        name = name.strip()
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(POINTS))}")
        if name in table:
            raise ValueError(f"failpoint {name} is set twice; give each point one action")
        tag = ""
        if "@" in action:
            tag, _, action = action.partition("@")
        m = _ACTION.match(action.strip())
        if not m:
            raise ValueError(f"failpoint {name}: bad action {action!r}")
        prob = float(m["p"]) if m["p"] else 1.0
        if not 0.0 < prob <= 1.0:
            raise ValueError(f"failpoint {name}: probability {prob} is not in (0, 1]")
        if tag and name not in TAGGED:
            raise ValueError(f"failpoint {name} takes no tag (only {', '.join(sorted(TAGGED))} do)")
        kind = m["name"].split("(")[0]
        table[name] = (prob, kind, int(m["ms"] or 0), tag.strip())
    return table


ENV = "KVSVC_FAILPOINTS"

_TABLE: dict[str, tuple[float, str, int, str]] = {}
#: False in production: callers on hot paths read ``failpoints.ENABLED`` at call time
#: and skip the failpoint calls entirely.
ENABLED = False


def load(spec: str) -> None:
    """Install the table ``spec`` describes ("" turns every point off). A bad spec
    raises ValueError and leaves the table as it was; call it before serving."""
    global _TABLE, ENABLED
    table = parse(spec)
    _TABLE, ENABLED = table, bool(table)


def load_from_env() -> None:
    """:func:`load` the ``KVSVC_FAILPOINTS`` table (unset: nothing)."""
    load(os.environ.get(ENV, ""))


def active() -> dict[str, tuple[float, str, int, str]]:
    return dict(_TABLE)


def _entry(name: str, tag: object) -> tuple[str, int] | None:
    entry = _TABLE.get(name)
    if entry is None:
        return None
    prob, kind, ms, only_tag = entry
    if only_tag and str(tag) != only_tag:
        return None
    if prob < 1.0 and random.random() >= prob:
        return None
    if kind == "raise":
        raise FailpointError(f"failpoint {name} fired")
    if kind == "kill-thread":
        raise FailpointThreadKill(f"failpoint {name} killed its thread")
    return kind, ms


def only_raises(prefix: str) -> bool:
    """True when no loaded point whose name starts with ``prefix`` sleeps, hangs or
    kills its thread: a thread that must never block (the event loop's) may then
    run those points."""
    return all(
        kind == "raise" for name, (_, kind, _, _) in _TABLE.items() if name.startswith(prefix)
    )


async def hit_async(name: str, tag: object = None) -> None:
    """Like :func:`hit`, for the event loop: sleep and hang delay only the caller."""
    action = _entry(name, tag)
    if action is None:
        return
    kind, ms = action
    if kind == "sleep":
        await asyncio.sleep(ms / 1000)
    elif kind == "hang":
        await asyncio.Event().wait()


def hit(name: str, tag: object = None) -> None:
    """Run the action configured for ``name``; a no-op (one dict lookup) when inert."""
    action = _entry(name, tag)
    if action is None:
        return
    kind, ms = action
    if kind == "sleep":
        time.sleep(ms / 1000)
    elif kind == "hang":
        threading.Event().wait()
