"""What kvsvc holds of this deployment, published as vLLM KV events: vLLM's
scheduler appends ``connector.take_events()`` to every ``KVEventBatch`` it
publishes, so a router that follows vLLM's KV-events publisher (llm-d, Dynamo)
sees kvsvc's blocks beside vLLM's own, in the form vLLM's offloading tiers use:
``medium`` one of vLLM's (``CPU`` or ``STORAGE``), ``locality`` ``LOCAL`` (kvsvc
serves this node's engines) and ``ownership`` ``kvsvc`` (the tier, as vLLM's
secondary tiers name theirs).

A router sends a request to the engine whose events announce its blocks, so an
engine announces only blocks it can load: with ``claim`` (the connector), only
chunks this engine itself planned to store, once kvsvc holds them; the
deployment's other engines announce theirs. Removals are announced for every
block announced.

Driven by the presence index's stream: the index's listener only notes which
chunk hashes an applied batch touched (cheap, on the index's thread); each
``take()`` (the scheduler's step) asks the index whether each touched chunk is
present on every TP rank, and turns changes against what it last announced into
``BlockStored`` / ``BlockRemoved``. A resync (``lost`` and a snapshot, a
server's clear) re-checks everything announced. While the index is not fresh
nothing is announced; once it has been unknown for ``withdraw_after_s``, every
announced block is withdrawn (a router must not route to what kvsvc may have
lost). A server clear is sent as ``BlockRemoved`` of kvsvc's blocks, not
``AllBlocksCleared``: that event has no medium, and a router would drop vLLM's
own GPU blocks with it.

Keys map back to vLLM block hashes as the connector makes them
(``chunk_key``: ``tp<rank>:`` + the hash of the chunk's last block), converted as
vLLM converts its own (``maybe_convert_block_hash``). With ``blocks_per_chunk``
> 1 only each chunk's last block is published (the key names no other).

KvsvcTier (tier.py) uses the same bookkeeping (``changes``, with ``whole_keys``:
its keys are vLLM's OffloadKeys, one a chunk) and hands the changes to vLLM's
tiering manager as ``OffloadingEvent`` s instead."""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvsvc.integrations.vllm.common import chunk_key

_RANK_PREFIX = re.compile(rb"tp(\d+):")

#: chunks claimed and not yet announced, at most (the oldest are forgotten: a
#: store that never landed must not hold memory for ever)
MAX_CLAIMED = 1 << 18

Probe = Callable[[Sequence[bytes]], "list[bool] | None"]


def block_hash_of(key: bytes) -> tuple[int, bytes] | None:
    """(TP rank, vLLM block hash) of a connector key; None for another key."""
    m = _RANK_PREFIX.match(key)
    return None if m is None else (int(m.group(1)), key[m.end() :])


class KvsvcKVEvents:
    """The announced set and the changes not yet taken; see the module docstring.
    Memory: one entry per chunk kvsvc holds of this namespace (the announced set),
    plus the touched chunks between two steps."""

    def __init__(
        self,
        namespace: str,
        tp: int,
        medium: str,
        withdraw_after_s: float,
        *,
        whole_keys: bool = False,
        locality: str | None = None,
        ownership: str | None = None,
        claimed_only: bool = False,
    ) -> None:
        """``whole_keys``: the namespace's keys are announced as they are, one key a
        chunk (the offloading tier's OffloadKeys) instead of ``tp`` connector keys.
        ``claimed_only``: a chunk is announced only once ``claim`` named it."""
        self.namespace = namespace
        self.locality = locality
        self.ownership = ownership
        self.claimed: OrderedDict[bytes, None] | None = OrderedDict() if claimed_only else None
        self.tp = 1 if whole_keys else tp
        self.whole_keys = whole_keys
        self.medium = medium
        self.withdraw_after_s = withdraw_after_s
        self.lock = threading.Lock()
        self.touched: set[bytes] = set()
        self.recheck_all = False
        self.announced: set[bytes] = set()
        self.unknown_since: float | None = None
        self.counters = {"kv_events_stored": 0, "kv_events_removed": 0}

    def claim(self, hashes: Sequence[bytes]) -> None:
        """Chunks this engine stores (``claimed_only``): announced once kvsvc holds
        them. Called on the scheduler's thread, as ``take``."""
        if self.claimed is None:
            return
        for h in hashes:
            self.claimed[h] = None
        while len(self.claimed) > MAX_CLAIMED:
            self.claimed.popitem(last=False)

    # --- the index's listener (its own thread): note, never probe ---
    def on_batch(self, batch: Any) -> None:
        """One applied ``pb.EventBatch`` (live, or a page of a snapshot)."""
        hashes: set[bytes] = set()
        recheck = bool(batch.lost or batch.snapshot_done)
        for event in batch.events:
            kind = event.WhichOneof("kind")
            if kind == "cleared":
                recheck = True
                continue
            body = getattr(event, kind)
            if body.namespace != self.namespace:
                continue
            for key in body.keys:
                if self.whole_keys:
                    hashes.add(bytes(key))
                    continue
                parsed = block_hash_of(key)
                if parsed is not None:
                    hashes.add(parsed[1])
        with self.lock:
            self.touched |= hashes
            self.recheck_all = self.recheck_all or recheck

    # --- the scheduler's step ---
    def take(self, probe: Probe, fresh: bool) -> list[KVCacheEvent]:
        """The events since the last step: one ``BlockRemoved`` of every chunk gone,
        one ``BlockStored`` per chunk new."""
        return self._events(*self.changes(probe, fresh))

    def changes(self, probe: Probe, fresh: bool) -> tuple[list[bytes], list[bytes]]:
        """(chunks new, chunks gone) since the last call, as block hashes (with
        ``whole_keys``: as keys)."""
        now = time.monotonic()
        if not fresh:
            if self.unknown_since is None:
                self.unknown_since = now
            if now - self.unknown_since < self.withdraw_after_s or not self.announced:
                return [], []
            gone, self.announced = sorted(self.announced), set()
            with self.lock:
                self.recheck_all = True  # re-announce what is there once it is fresh
            return [], gone
        self.unknown_since = None
        with self.lock:
            touched, self.touched = self.touched, set()
            recheck, self.recheck_all = self.recheck_all, False
        if recheck:
            touched |= self.announced
        if self.claimed is not None:
            touched = {h for h in touched if h in self.claimed or h in self.announced}
        if not touched:
            return [], []
        order = sorted(touched)
        if self.whole_keys:
            keys = order
        else:
            keys = [chunk_key(r, h) for h in order for r in range(self.tp)]
        present = probe(keys)
        if present is None:  # turned unknown meanwhile: try again next step
            with self.lock:
                self.touched |= touched
                self.recheck_all = self.recheck_all or recheck
            return [], []
        stored, removed = [], []
        for i, h in enumerate(order):
            here = all(present[i * self.tp : (i + 1) * self.tp])
            if here and h not in self.announced:
                self.announced.add(h)
                if self.claimed is not None:
                    self.claimed.pop(h, None)
                stored.append(h)
            elif not here and h in self.announced:
                self.announced.discard(h)
                removed.append(h)
        return stored, removed

    def _events(self, stored: list[bytes], removed: list[bytes]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        if removed:
            self.counters["kv_events_removed"] += len(removed)
            out.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in removed],
                    medium=self.medium,
                    group_idx=0,
                    locality=self.locality,
                    ownership=self.ownership,
                )
            )
        if stored:
            self.counters["kv_events_stored"] += len(stored)
            # As vLLM's OffloadingConnector publishes its tiers' blocks without
            # self-describing payloads: one placeholder per chunk (kvsvc keeps no
            # token ids, and a list of hashes would claim they chain).
            out.extend(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h)],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=None,
                    group_idx=0,
                    locality=self.locality,
                    ownership=self.ownership,
                )
                for h in stored
            )
        return out
