"""Stores and loads on the direct path: kvsvc's server copies between its store and
LMCache's L1 objects in place (arena.py maps the arena), one chunk per object,
``piece_mib`` MiB of objects per Store/Retrieve, the pieces in flight together.

Each function returns, per object, whether it was stored / loaded and verified,
and the transfers whose end is not proven (the task is then held, held.py). A
Retrieve verifies each chunk's CRC-32C segment by segment as it writes the
object: a chunk that fails is reported not loaded (its object then holds
undefined bytes, and LMCache deletes an object whose bit is 0 without reading it),
and the objects after it in the piece are tried again, up to ``max_skips`` times
a task."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from kvsvc.client import KVCacheClient, MappingHandle
from kvsvc.errors import KVServiceError, Miss
from kvsvc.integrations.lmcache.arena import Arena
from kvsvc.integrations.lmcache.config import BACKSTOP_S, MAX_SKIPS
from kvsvc.integrations.lmcache.held import Unproven
from kvsvc.integrations.lmcache.keys import chunk_key
from kvsvc.integrations.lmcache.lanes import object_bytes
from kvsvc.integrations.lmcache.staging import Host


@dataclass
class Outcome:
    """Per object, whether it moved; the unproven transfers; the first error."""

    done: list[bool]
    unproven: list[Unproven]
    error: BaseException | None = None


def _settle(
    client: KVCacheClient,
    mapping: MappingHandle,
    futures: list[tuple[int, int, Future[Any]]],
    deadline: float,
    backstop_s: float,
    on_result: Callable[[int, int, Any], None],
) -> tuple[list[Unproven], BaseException | None]:
    """Waits for every piece (a piece's copy may still read or write its objects
    until its reply, or a Fence, proves it ended); the unproven transfers after it."""
    error: BaseException | None = None
    timed_out = False
    for a, b, f in futures:
        try:
            r = f.result(max(deadline - time.monotonic(), 0) + backstop_s)
        except (KVServiceError, FutureTimeout) as exc:
            error = error or exc
            timed_out |= isinstance(exc, FutureTimeout)
            continue
        on_result(a, b, r)
    ids = client.unproven_transfers(mapping)
    if ids or timed_out:
        return [Unproven(mapping, ids)], error
    return [], error


def store(
    client: KVCacheClient,
    mapping: MappingHandle,
    ns: str,
    keys: list[Any],
    blocks: list[int],
    per_piece: int,
    timeout_s: float,
    backstop_s: float,
) -> Outcome:
    """Stores the objects at ``blocks`` under ``keys`` (one chunk each)."""
    out = [False] * len(keys)
    deadline = time.monotonic() + timeout_s
    futures = []
    for a in range(0, len(keys), per_piece):
        b = min(a + per_piece, len(keys))
        chunks = [(chunk_key(keys[j]), [blocks[j]]) for j in range(a, b)]
        left = max(deadline - time.monotonic(), 0.001)
        futures.append((a, b, client.store_async(mapping, chunks, namespace=ns, timeout=left)))

    def stored(a: int, b: int, r: Any) -> None:
        if int(r.stored_chunks) + int(r.present_chunks) == b - a:
            out[a:b] = [True] * (b - a)

    unproven, error = _settle(client, mapping, futures, deadline, backstop_s, stored)
    return Outcome(out, unproven, error)


def load(
    client: KVCacheClient,
    mapping: MappingHandle,
    ns: str,
    keys: list[Any],
    blocks: list[int],
    per_piece: int,
    timeout_s: float,
    backstop_s: float,
    max_skips: int,
) -> tuple[Outcome, bool]:
    """Retrieves ``keys`` into the objects at ``blocks``; also whether the task was
    cut short (more than ``max_skips`` misses)."""
    out = [False] * len(keys)
    deadline = time.monotonic() + timeout_s
    todo = list(range(len(keys)))
    skips = 0
    while todo and time.monotonic() < deadline:
        futures = []
        for a in range(0, len(todo), per_piece):
            b = min(a + per_piece, len(todo))
            chunks = [(chunk_key(keys[todo[s]]), [blocks[todo[s]]]) for s in range(a, b)]
            left = max(deadline - time.monotonic(), 0.001)
            f = client.retrieve_async(mapping, chunks, namespace=ns, timeout=left)
            futures.append((a, b, f))
        retry: list[int] = []

        def loaded(
            a: int, b: int, r: Any, todo: list[int] = todo, retry: list[int] = retry
        ) -> None:
            nonlocal skips
            n = min(int(r.loaded_chunks), b - a)
            for s in range(a, a + n):
                out[todo[s]] = True
            if a + n < b:
                skips += 1
                retry.extend(todo[a + n + 1 : b])

        unproven, error = _settle(client, mapping, futures, deadline, backstop_s, loaded)
        if unproven or error is not None:
            return Outcome(out, unproven, error), False
        if skips > max_skips:
            return Outcome(out, []), True
        todo = retry
    return Outcome(out, []), False


class DirectPath:
    """Routes each (namespace, size) group's objects: those the arena addresses
    move here, the rest go to the staging lanes."""

    def __init__(self, host: Host, arena: Arena) -> None:
        self.host = host
        self.arena = arena

    def run(
        self,
        direction: str,
        ns: str,
        size: int,
        idx: list[int],
        keys: list[Any],
        objects: list[Any],
        out: list[bool],
        unproven: list[Unproven],
    ) -> list[int]:
        """Moves the objects at ``idx`` that the L1 arena addresses on the direct
        path (their results into ``out``, unproven transfers into ``unproven``);
        returns the positions left for the staging lanes."""
        arena = self.arena
        if arena.refused:
            return idx
        staged: list[int] = []
        mine: list[int] = []
        blocks: list[int] = []
        for i in idx:
            view = object_bytes(objects[i])
            block = None if view is None else arena.block(view.data_ptr(), view.numel())
            if block is None:
                staged.append(i)
            else:
                mine.append(i)
                blocks.append(block)
        if not mine:
            return staged
        sizes = arena.sizes(direction)
        if size not in sizes and len(sizes) >= self.host.cfg.max_object_sizes:
            self.host._count("objects_of_unstaged_size")
            self.host.warn.warning(
                "kvsvc: objects of %d bytes: the L1 arena is mapped for %d sizes already "
                "(max_object_sizes): failed stores, misses",
                size,
                len(sizes),
            )
            return staged
        got = self._group(direction, ns, size, [keys[i] for i in mine], blocks)
        if got is None:  # kvsvc refused the file just now: these go through staging
            return sorted(staged + mine)
        for i, ok in zip(mine, got.done, strict=True):
            out[i] = ok
        unproven.extend(got.unproven)
        return staged

    def _group(
        self, direction: str, ns: str, size: int, keys: list[Any], blocks: list[int]
    ) -> Outcome | None:
        """One group's Stores or Retrieves on the arena; None when kvsvc refused it."""
        arena, cfg = self.arena, self.host.cfg
        entry = arena.entry(direction, size)
        per_piece = max(1, (cfg.piece_mib << 20) // size)
        with entry.lock:
            got = arena.mapped(
                entry, self.host.link, self.host.namespaces.staging(), cfg.fence_timeout_s
            )
            if got is None:
                if arena.refused:
                    return None
                return Outcome([False] * len(keys), [])
            client, mapping = got
            if direction == "store":
                outcome = store(
                    client, mapping, ns, keys, blocks, per_piece, cfg.store_timeout_s, BACKSTOP_S
                )
            else:
                outcome, cut = load(
                    client, mapping, ns, keys, blocks, per_piece, cfg.load_timeout_s,
                    BACKSTOP_S, MAX_SKIPS,
                )  # fmt: skip
                if cut:
                    self.host._count("loads_cut_short")
            if outcome.unproven:
                for u in outcome.unproven:
                    u.server = entry.server  # the process that may still copy them
                self.host._count("transfers_unproven")
                entry.mapping = None
                self.host._failed(
                    f"{direction} (unproven: its task held until a Fence)", outcome.error
                )
            elif outcome.error is not None and not isinstance(outcome.error, Miss):
                entry.mapping = None
                self.host._failed(direction, outcome.error)
        return outcome
