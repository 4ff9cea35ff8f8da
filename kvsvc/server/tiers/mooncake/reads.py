"""Retrieve's reads from Mooncake Store, two calls per load, each through the
gate (a Mooncake thread, bounded): the values' sizes from the master
(``batch_get_replica_desc``), then, once the loop reserved the chunks, one
``batch_get_into_multi_buffers`` putting each value's header in a registered
slot and its bytes straight into the reserved chunk (no copy), checked on the
same thread. Chunks are committed in key order up to the first that failed; a
call given up on (the budget) frees its chunks only once it ended."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Container
from dataclasses import dataclass, field

from kvsvc.errors import CapacityExhausted
from kvsvc.server.data.store import Chunk, ChunkStore
from kvsvc.server.tiers.mooncake.client import (
    FAILURES,
    HEADER_SLOT_BYTES,
    NOT_FOUND,
    TIMEOUT,
    Failed,
    code_kind,
    warn,
)
from kvsvc.server.tiers.mooncake.gate import BUDGET, Gate
from kvsvc.server.tiers.mooncake.values import (
    BAD_HEADER,
    Rejected,
    chunk_bytes,
    key_name,
    verify,
)

#: keys one Retrieve asks Mooncake for at most (the rest: the next Retrieve)
LOAD_MAX = 64
#: a load of this many bytes or more is read by PARTS calls at once (one thread's
#: transfer beside the others' checksums; one of the gate's threads left free)
SPLIT_BYTES = 16 << 20
PARTS = 2
#: a value whose call failed (counted by the gate), or was given up on
_FAILED, _LATE = "failed", "late"


@dataclass
class _Load:
    """One Retrieve's keys memory lacks, and what became of them."""

    namespace: str
    layout: str
    names: list[str]
    keys: list[bytes]
    sizes: list[int] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class Reads:
    def __init__(self, gate: Gate, store: ChunkStore, prefix: str) -> None:
        self.gate = gate
        self.store = store
        self.prefix = prefix
        self.headers = gate.connection.headers

    async def load(
        self,
        namespace: str,
        layout: str,
        keys: list[bytes],
        budget: float,
        stale: Container[tuple[str, bytes, str]],
    ) -> list[Chunk]:
        """The leading ``keys`` memory lacks brought into it, verified, within
        ``budget`` s: the chunks committed, read-pinned (the caller releases them)."""
        g = self.gate
        deadline = time.monotonic() + max(budget, 0.0)
        wanted: list[bytes] = []
        for key in keys[:LOAD_MAX]:
            if self.store.get(namespace, key, layout) is not None:
                break  # the rest of the prefix: the next tier's, or memory's
            if (namespace, key, layout) in stale:  # its newest version never landed
                g.count(g.rejected, "stale")
                break
            wanted.append(key)
        if not wanted:
            return []
        names = [key_name(self.prefix, namespace, layout, k) for k in wanted]
        try:
            sizes = await g.run(lambda c: _sizes(c, names), deadline - time.monotonic())
        except Failed:
            g.add(misses=len(wanted))
            return []
        job = _Load(namespace, layout, [], [])
        for key, total in zip(wanted, sizes, strict=True):
            if total < 0:  # not there
                break
            size = chunk_bytes(total, layout)  # 0: no chunk of this layout fits
            if size == 0 or total - size > HEADER_SLOT_BYTES:
                g.count(g.rejected, BAD_HEADER)
                break
            job.names.append(names[len(job.keys)])
            job.keys.append(key)
            job.sizes.append(size)
            job.heads.append(total - size)
        g.add(misses=len(wanted) - len(job.keys))
        if not job.keys or not self._reserve(job):
            g.add(misses=len(job.keys))
            return []
        return await self._get(job, deadline)

    def _reserve(self, job: _Load) -> bool:
        """Chunks and header slots for the job (False: no room; counted)."""
        g = self.gate
        slots = self.headers.take(len(job.keys))
        if slots is None:
            g.count(g.errors, "busy")
            return False
        try:
            chunks, _ = self.store.reserve(
                job.namespace,
                list(zip(job.keys, job.sizes, strict=True)),
                job.layout,
                origin="mooncake",
            )
        except CapacityExhausted as exc:
            self.headers.give(slots)
            g.count(g.errors, "capacity")
            warn.warning("mooncake tier: no room in the local store for read chunks: %s", exc)
            return False
        job.chunks, job.slots = chunks, slots
        return True

    async def _get(self, job: _Load, deadline: float) -> list[Chunk]:
        """Read the job's values, in PARTS calls at once when they are large, and
        commit the prefix."""
        g, store = self.gate, self.store
        n = len(job.chunks)
        k = min(n, PARTS) if sum(job.sizes) >= SPLIT_BYTES else 1
        bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        parts = await asyncio.gather(*(self._part(job, lo, hi, deadline) for lo, hi in bounds))
        results = [r for part in parts for r in part]
        pinned: list[Chunk] = []
        ok = True
        for chunk, result in zip(job.chunks, results, strict=True):
            if ok and isinstance(result, list):
                if store.commit(chunk, result):  # else another call's is there
                    g.add(hits=1, bytes_read=chunk.size)
                    chunk.readers += 1
                    pinned.append(chunk)
                continue
            ok = False
            g.add(misses=1)
            if result == _LATE:  # freed once its call ends
                continue
            if isinstance(result, str) and result != _FAILED:
                if result.startswith("rejected:"):
                    g.count(g.rejected, result.removeprefix("rejected:"))
                    warn.warning("mooncake tier: a value was refused (%s): a miss", result)
                elif result != NOT_FOUND:
                    g.count(g.errors, result)
            store.abort(chunk)
        self.headers.give([s for s, r in zip(job.slots, results, strict=True) if r != _LATE])
        return pinned

    async def _part(self, job: _Load, lo: int, hi: int, deadline: float) -> list[list[int] | str]:
        """Values ``lo:hi`` of the job read and checked on a Mooncake thread: each
        its digests or why not (_LATE: given up on, its chunk freed when the call
        ends)."""
        store, headers = self.store, self.headers
        names, slots, heads = job.names[lo:hi], job.slots[lo:hi], job.heads[lo:hi]
        chunks = job.chunks[lo:hi]
        views = [store.buffer(c) for c in chunks]

        def get(client: object) -> list[list[int] | str]:
            got = client.batch_get_into_multi_buffers(  # type: ignore[attr-defined]
                names,
                [[headers.addr(s), v.addr] for s, v in zip(slots, views, strict=True)],
                [[h, c.size] for h, c in zip(heads, chunks, strict=True)],
            )
            out: list[list[int] | str] = []
            for i, rc in enumerate(got):
                if rc != heads[i] + chunks[i].size:
                    out.append(code_kind(rc) if rc < 0 else "truncated")
                    continue
                try:
                    slot = headers.slot(slots[i], heads[i])
                    out.append(verify(names[i], job.layout, slot, views[i].view, views[i].addr))
                except Rejected as exc:
                    out.append("rejected:" + exc.kind)
            return _judged(out)

        def free() -> None:
            for chunk in chunks:
                store.abort(chunk)
            headers.give(slots)

        try:
            return await self.gate.run(get, deadline - time.monotonic(), late=free)
        except Failed as exc:
            late = exc.kind in (TIMEOUT, BUDGET)  # the call goes on: free() once it ends
            return [_LATE if late else _FAILED] * len(chunks)


def _judged(out: list[list[int] | str]) -> list[list[int] | str]:
    """``out``, or Failed when no value came and Mooncake failed (the breaker
    hears of it; a call that brought some is an answer)."""
    if not any(isinstance(r, list) for r in out):
        failed = next((r for r in out if isinstance(r, str) and r in FAILURES), None)
        if failed is not None:
            raise Failed(failed)
    return out


def _sizes(client: object, names: list[str]) -> list[int]:
    """Each value's size (-1: Mooncake holds no complete copy in memory)."""
    desc = client.batch_get_replica_desc(names)  # type: ignore[attr-defined]
    out = []
    for name in names:
        size = -1
        for replica in desc.get(name, ()):
            if replica.is_memory_replica():
                size = int(replica.get_memory_descriptor().buffer_descriptor.size)
                break
        out.append(size)
    return out
