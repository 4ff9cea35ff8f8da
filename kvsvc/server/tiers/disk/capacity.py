"""--disk-capacity: what counts against it (the index's files, and the writes not
yet landed: reserved when queued, released when they end) and which files go to
make room: the least recently used, preferring owners over their share of the
disk when tenants have shares (a tenant's quota counts its disk bytes). The files
chosen leave the index here; their removal (and its announcement) is the tier's.
Only the event loop touches it."""

from __future__ import annotations

from kvsvc.server.data.store import ChunkKey, ChunkStore
from kvsvc.server.tiers.disk.index import Entry, Index


class Capacity:
    """The disk's byte budget, and the eviction that keeps to it."""

    def __init__(self, limit: int, store: ChunkStore) -> None:
        self.limit = limit
        #: the shares of its capacity scale each owner's share of the disk
        self.store = store
        self.pending_bytes = 0  # files being written

    def reserve(self, nbytes: int) -> None:
        """A write is queued: its file counts until it ends."""
        self.pending_bytes += nbytes

    def release(self, nbytes: int) -> None:
        """A write ended (written, skipped or failed): a landed file counts in the index."""
        self.pending_bytes -= nbytes

    def fits(self, index: Index, need: int) -> bool:
        return index.used_bytes + self.pending_bytes + need <= self.limit

    def evict(
        self, index: Index, need: int, owner: str = ""
    ) -> tuple[list[tuple[ChunkKey, Entry]], bool]:
        """Forget files from ``index`` until ``need`` more bytes fit: the files
        forgotten, in order, and whether ``need`` fits now (False when it does not
        even so: the rest is writes not yet landed)."""
        gone: list[tuple[ChunkKey, Entry]] = []
        while index.entries and not self.fits(index, need):
            key = self.victim(index, owner, need)
            entry = index.remove(key)
            assert entry is not None
            gone.append((key, entry))
        return gone, self.fits(index, need)

    def victim(self, index: Index, owner: str, need: int) -> ChunkKey:
        """The least recently used file, preferring owners over their disk share: the
        store's share of its capacity (kvsvc.server.security.auth.Quota.store_share),
        applied to --disk-capacity; the writer counted with what it asks."""
        entries = index.entries
        oldest = next(iter(entries))
        shares = self.store.shares
        if not shares:
            return oldest
        scale = self.limit / max(1, self.store.capacity)
        held = dict(index.used_by)
        held[owner] = held.get(owner, 0) + need
        over = {o for o, n in held.items() if o in shares and n > shares[o] * scale}
        if not over:
            return oldest
        return next((k for k, e in entries.items() if e.owner in over), oldest)
