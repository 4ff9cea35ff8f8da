"""The Mooncake tier's connection to Mooncake Store: the extra it needs, what kind
each Mooncake return code is (the label of kvsvc_mooncake_errors_total), and the
client itself, set up on a Mooncake thread (at the first call that needs it, and
again after a failed set-up), with the store's memory registered once so chunks
move straight from and into it."""

from __future__ import annotations

import ctypes
import logging
import mmap
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from kvsvc.errors import BoundedLog
from kvsvc.server.config import ConfigError, ServerConfig
from kvsvc.server.data.store import ChunkStore

log = logging.getLogger("kvsvc.server.tiers.mooncake")
#: at most one such warning per 10 s for the whole tier (a failing master fails every call)
warn = BoundedLog(log, 10.0)

# Failures in a row that open the breaker; then one probe call after this long.
BREAKER_FAILURES = 3
BREAKER_OPEN_S = 2.0

# Error kinds kvsvc adds to Mooncake's codes.
TIMEOUT, BUSY, BREAKER_OPEN, CONNECTING, SETUP, CLOSING, OTHER = (
    "timeout",  # past --mooncake-timeout or the call's budget (left to end on its thread)
    "busy",  # every Mooncake thread is taken (calls stuck in Mooncake): not asked
    "breaker_open",
    "connecting",  # another thread is setting the client up
    "setup",  # setup() or register_buffer() refused
    "closing",
    "other",
)
NOT_FOUND = "not_found"

#: Mooncake Store's codes (mooncake-store ErrorCode) by name; any other code is
#: named by its hundred (Mooncake groups them so), "other" beyond
_CODES = {
    -703: NOT_FOUND,  # REPLICA_IS_NOT_READY: being written, a miss for now
    -704: NOT_FOUND,  # OBJECT_NOT_FOUND
    -705: "exists",  # OBJECT_ALREADY_EXISTS
    -706: "leased",  # OBJECT_HAS_LEASE
}
_HUNDREDS = {
    -1: "internal",
    -100: "segment",
    -200: "no_space",  # NO_AVAILABLE_HANDLE: the pool has no room
    -300: "version",
    -400: "invalid_key",
    -500: "write_fail",
    -600: "invalid_params",  # a value larger than the buffer given, among others
    -700: "object",
    -800: "transfer",  # TRANSFER_FAIL: the peer holding the value did not answer
    -900: "rpc",  # RPC_FAIL: the master did not answer
    -1000: "metadata",
    -1100: "file",
}
#: kinds that say Mooncake (master, peer, metadata) is failing or not set up yet:
#: they feed the breaker (any other code is an answer)
FAILURES = frozenset({"internal", "transfer", "rpc", "metadata", SETUP, CONNECTING, TIMEOUT, OTHER})


def code_kind(code: int) -> str:
    """The kind of a negative Mooncake return code."""
    if code in _CODES:
        return _CODES[code]
    if code > -100:
        return _HUNDREDS[-1] if code < 0 else OTHER
    return _HUNDREDS.get(-((-code) // 100) * 100, OTHER)


class Failed(Exception):
    """A Mooncake exchange that did not happen or failed (``kind`` says why)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def require_store() -> Any:
    """``mooncake.store``, or a ConfigError naming the extra that brings it."""
    try:
        import mooncake.store
    except ImportError as exc:
        raise ConfigError(
            "--mooncake-master needs Mooncake Store: pip install 'kvsvc[mooncake]' "
            f"(mooncake-transfer-engine-non-cuda; its binaries need libibverbs1): {exc}"
        ) from None
    return mooncake.store


#: bytes of registered memory per value header (a 32 MiB chunk's is ~300 bytes
#: plus its layout's name), and headers in flight at once
HEADER_SLOT_BYTES = 16 << 10
HEADER_SLOTS = 128


class Headers:
    """Registered memory the values' headers are put from and read into, by
    slots (any thread; a call that finds none free is a busy miss)."""

    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, HEADER_SLOT_BYTES * HEADER_SLOTS)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.view = memoryview(self.memory)
        self._free = list(range(HEADER_SLOTS))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int] | None:
        with self._lock:
            if len(self._free) < n:
                return None
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def give(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def addr(self, slot: int) -> int:
        return self.base + slot * HEADER_SLOT_BYTES

    def slot(self, slot: int, n: int) -> memoryview:
        lo = slot * HEADER_SLOT_BYTES
        return self.view[lo : lo + n]


class Connection:
    """The MooncakeDistributedStore client, set up on the first Mooncake thread
    that needs it. Mooncake calls block (4.5 s each with a dead master): only the
    tier's own threads make them."""

    def __init__(self, config: ServerConfig, store: ChunkStore) -> None:
        t = config.tiers
        self.master = t.mooncake_master
        self.metadata = t.mooncake_metadata
        self.hostname = t.mooncake_local_hostname
        self.protocol = t.mooncake_protocol
        self.devices = t.mooncake_rdma_devices
        self.segment_bytes = t.mooncake_segment_bytes
        self.buffer_bytes = t.mooncake_buffer_bytes
        self.store = store
        self.headers = Headers()
        self.client: Any = None
        #: where this server's own writes go first (its segment), once set up
        self.replicate: Any = None
        self._setting_up = threading.Lock()

    def check(self) -> None:
        """At start: the settings and the extra (ConfigErrors name the flag)."""
        if not self.metadata:
            raise ConfigError(
                "--mooncake-master needs --mooncake-metadata (e.g. http://HOST:PORT/metadata, "
                "the master's --enable_http_metadata_server)"
            )
        require_store()

    def get(self) -> Any:
        """On a Mooncake thread: the client, set up now if it is not yet."""
        client = self.client
        if client is not None:
            return client
        if not self._setting_up.acquire(blocking=False):
            raise Failed(CONNECTING)
        try:
            if self.client is None:
                self.client = self._setup()
            return self.client
        finally:
            self._setting_up.release()

    def _reachable(self) -> bool:
        """Whether the master's RPC port (and an HTTP metadata server's) take a TCP
        connection within a second. Mooncake's setup() against a master that is
        not there holds Python's GIL for ~90 s (measured: the whole process,
        event loop included, stops), so it is only called once they do."""
        targets = [self.master]
        meta = urlsplit(self.metadata)
        if meta.scheme in ("http", "https") and meta.hostname:
            targets.append(
                f"{meta.hostname}:{meta.port or (443 if meta.scheme == 'https' else 80)}"
            )
        for target in targets:
            host, _, port = target.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            except (OSError, ValueError) as exc:
                warn.warning(
                    "mooncake tier: %s does not answer (%s): reads are misses", target, exc
                )
                return False
        return True

    def _setup(self) -> Any:
        mod = require_store()
        if not self._reachable():
            raise Failed(SETUP)
        client = mod.MooncakeDistributedStore()
        rc = client.setup(
            self.hostname or "0.0.0.0",
            self.metadata,
            self.segment_bytes,
            self.buffer_bytes,
            self.protocol,
            self.devices,
            self.master,
        )
        if rc != 0:
            warn.warning(
                "mooncake tier: setup with master %s refused (%s, %s): reads are misses, "
                "writes skipped, until it succeeds",
                self.master,
                rc,
                code_kind(rc),
            )
            raise Failed(SETUP)
        for addr, size in (
            (self.store.base, self.store.capacity),
            (self.headers.base, HEADER_SLOT_BYTES * HEADER_SLOTS),
        ):
            rc = client.register_buffer(addr, size)
            if rc != 0:
                warn.warning("mooncake tier: register_buffer of %d bytes refused (%s)", size, rc)
                raise Failed(SETUP)
        replicate = mod.ReplicateConfig()
        replicate.replica_num = 1
        replicate.preferred_segment = client.get_hostname()
        self.replicate = replicate
        log.info(
            "mooncake tier: master %s answers; this server is %s, adding %d bytes",
            self.master,
            client.get_hostname(),
            self.segment_bytes,
        )
        return client

    def close(self, timeout: float, answering: bool) -> None:
        """Mooncake's close() on a thread of its own, waited ``timeout`` s at most,
        only while Mooncake answers (``answering``). With a dead master close()
        runs ~17 s holding the GIL (measured: every thread of the process, the
        event loop too, stops meanwhile), so then the client is left to the
        process's exit, never destroyed (its destructor would close it)."""
        client, self.client = self.client, None
        if client is None:
            return
        if not answering:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))
            log.warning("mooncake tier: Mooncake does not answer; its client is left open")
            return
        closer = threading.Thread(target=client.close, name="kvsvc-mooncake-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            log.warning("mooncake tier: close() still running after %g s; not waited for", timeout)
