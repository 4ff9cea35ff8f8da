"""What an operation of kvsvc.client.calls is made of: the table of calls (which
RPC, its result's type, its deadline, what it does to leases; request and response
types read from the proto service, so the table cannot drift from the wire), the
mapping handle and its leases, and the steps an operation yields to its driver
(an RPC's ``Plan``, ``Blocking`` work, RPCs sent in ``Parallel``). Nothing here
does I/O.
"""

from __future__ import annotations

import enum
import threading
import uuid
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvsvc.v1 import kv_cache_service_pb2 as pb

R = TypeVar("R")
ResT = TypeVar("ResT")
#: ``[(key, block_ids), ...]``: the chunks of a block transfer.
BlockChunkList = Sequence[tuple[bytes, Sequence[int]]]
SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"]


class _Default(enum.Enum):
    DEFAULT = "DEFAULT"


#: Use the client's configured deadline for this kind of call.
DEFAULT = _Default.DEFAULT
Timeout = float | _Default


class Deadline(enum.Enum):
    """Which configured deadline a call gets when its caller passes ``DEFAULT``."""

    CONTROL = "control"
    TRANSFER = "transfer"


class Lease(enum.Enum):
    """What a call does to the leases on its mapping's blocks."""

    NONE = "none"  # touches no mapped block
    TRANSFER = "transfer"  # leases the blocks it may copy until its outcome is proven
    FENCE = "fence"  # a result proves that the fenced transfers ended
    UNMAP = "unmap"  # a result proves that every copy of the mapping ended


@dataclass(frozen=True)
class Call(Generic[ResT]):
    """One kind of call. Its request and response types are read from the proto
    service, and its result type is checked against the response there, so the
    table cannot drift from the wire contract."""

    method: str
    result: type[ResT]
    deadline: Deadline
    lease: Lease
    request: type[Any] = field(init=False, repr=False)
    response: type[Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rpc = SERVICE.methods_by_name[self.method]
        result = rpc.output_type.fields_by_name["result"].message_type
        if result is not getattr(self.result, "DESCRIPTOR", None):
            raise TypeError(f"{rpc.output_type.full_name}.result is not a {self.result}")
        object.__setattr__(self, "request", getattr(pb, rpc.input_type.name))
        object.__setattr__(self, "response", getattr(pb, rpc.output_type.name))

    @property
    def path(self) -> str:
        return f"/{SERVICE.full_name}/{self.method}"


CONTROL, TRANSFER = Deadline.CONTROL, Deadline.TRANSFER
MAP = Call("Map", pb.MapResult, CONTROL, Lease.NONE)
UNMAP = Call("Unmap", pb.UnmapResult, TRANSFER, Lease.UNMAP)
STORE = Call("Store", pb.StoreResult, TRANSFER, Lease.TRANSFER)
RETRIEVE = Call("Retrieve", pb.RetrieveResult, TRANSFER, Lease.TRANSFER)
PUT = Call("Store", pb.StoreResult, TRANSFER, Lease.NONE)  # inline bytes, no mapping
GET = Call("Retrieve", pb.RetrieveResult, TRANSFER, Lease.NONE)
LOOKUP = Call("Lookup", pb.LookupResult, CONTROL, Lease.NONE)
FENCE = Call("Fence", pb.FenceResult, TRANSFER, Lease.FENCE)
SERVER_INFO = Call("GetServerInfo", pb.GetServerInfoResult, CONTROL, Lease.NONE)
DROP_NAMESPACE = Call("DropNamespace", pb.DropNamespaceResult, CONTROL, Lease.NONE)
CALLS: tuple[Call[Any], ...] = (
    MAP,
    UNMAP,
    STORE,
    RETRIEVE,
    PUT,
    GET,
    LOOKUP,
    FENCE,
    SERVER_INFO,
    DROP_NAMESPACE,
)


@dataclass
class MappingHandle:
    """A mapping as the client knows it; re-mapping after a restart updates it in place."""

    mapping_id: str
    namespace: str
    server_start_id: str
    num_blocks: int
    block_bytes: int
    layout_fingerprint: str
    ranks: list[pb.RankRegion] = field(repr=False, default_factory=list)
    #: Stable across re-maps: the leases of this handle live under it.
    lease_key: str = field(repr=False, default_factory=lambda: uuid.uuid4().hex)

    def replace_with(self, fresh: MappingHandle) -> None:
        """Adopt a re-map's identity; leases stay where they are."""
        key = self.lease_key
        self.__dict__.update(fresh.__dict__)
        self.lease_key = key


class Leases:
    """Which blocks of each mapping handle an unfinished or unprovable transfer may
    touch, and on which server start it ran (only that server can prove it ended)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # lease key -> transfer id -> (blocks, server start id)
        self._by_key: dict[str, dict[str, tuple[frozenset[int], str]]] = {}

    def acquire(self, key: str, transfer_id: str, blocks: Iterable[int], start_id: str) -> None:
        with self._lock:
            self._by_key.setdefault(key, {})[transfer_id] = (frozenset(blocks), start_id)

    def release(self, key: str, transfer_id: str) -> None:
        with self._lock:
            self._by_key.get(key, {}).pop(transfer_id, None)

    def release_all(self, key: str, start_id: str) -> None:
        with self._lock:
            leases = self._by_key.get(key, {})
            for tid in [t for t, (_, s) in leases.items() if s == start_id]:
                del leases[tid]

    def blocks(self, key: str) -> set[int]:
        with self._lock:
            out: set[int] = set()
            for blocks, _ in self._by_key.get(key, {}).values():
                out |= blocks
            return out

    def transfers(self, key: str, start_id: str | None = None) -> list[str]:
        """Leased transfer ids; with ``start_id``, those of that server start only."""
        with self._lock:
            return sorted(
                t
                for t, (_, s) in self._by_key.get(key, {}).items()
                if start_id is None or s == start_id
            )


@dataclass(slots=True)
class Plan(Generic[ResT]):
    """One prepared RPC: what to send, how long to wait, which leases it touches."""

    call: Call[ResT]
    request: Any  # a ``call.request`` message
    timeout: float
    mapping: MappingHandle | None = None
    blocks: frozenset[int] = frozenset()
    #: an inline Store's size, declared in its metadata (kvsvc.framing.REQUEST_BYTES);
    #: 0: a request small enough for the Session
    declared: int = 0

    @property
    def request_id(self) -> str:
        return str(self.request.header.request_id)

    @property
    def transfer(self) -> bool:
        return self.call.lease is Lease.TRANSFER


@dataclass(slots=True)
class Blocking(Generic[R]):
    """Work that blocks its thread (the fd exchange): the asyncio client runs it in another."""

    fn: Callable[[], R]


@dataclass(slots=True)
class Parallel:
    """RPCs sent at once (pipelined on the session); the driver sends back, in the
    same order, each one's result or its typed error."""

    plans: list[Plan[Any]]


Step = Plan[Any] | Blocking[Any] | Parallel
#: An operation: yields steps, is sent each step's result, returns its own.
Steps = Generator[Step, Any, R]
