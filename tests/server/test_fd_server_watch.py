"""The client's watch of the server process that took its fds (``fd_server_watch``):
what proves a killed kvsvc's copies ended when it never answers again, on a real
`kvsvc serve` killed under it. No watch where it cannot be trusted: no lease, a
lease connection the server hung up (its pid may be another process's by now),
no pidfds on this kernel."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import ServerProcess

from kvsvc.client import KVCacheClient, fdpass
from kvsvc.pidfds import ProcessWatch

pytestmark = pytest.mark.slow  # starts servers


def exits_within(watch: ProcessWatch, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not watch.exited():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("shared_file", [False, True], ids=["sealed-memfd", "shared-file"])
def test_the_watch_sees_the_server_that_took_the_fds_exit(
    spawn: Callable[..., ServerProcess], shm_dir: Path, shared_file: bool
) -> None:
    srv = spawn()
    if shared_file:
        path = shm_dir / "l1"
        path.write_bytes(bytes(1 << 16))
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    else:
        fd = fdpass.make_sealed_memfd("watched", 1 << 16)
    try:
        with KVCacheClient(srv.address) as c:
            assert c.fd_server_watch() is None  # nothing passed: no lease
            c.register_memfd(fd, shared_file=shared_file)
            watch = c.fd_server_watch()
            assert watch is not None
            assert c.fd_server_watch(c.server_info().fd_socket) is not None
            assert not watch.exited()
            srv.signal(signal.SIGKILL)
            assert exits_within(watch, 30), "the killed server's exit was not seen"
            # Its connection is hung up now: a new watch could name a reused pid.
            assert c.fd_server_watch() is None
            watch.close()
            assert not watch.exited()  # closed: unknown, never "exited"
        assert c.fd_server_watch() is None  # closed client: no lease
    finally:
        os.close(fd)


def test_a_stopped_server_is_not_taken_for_exited(spawn: Callable[..., ServerProcess]) -> None:
    srv = spawn()
    fd = fdpass.make_sealed_memfd("stopped", 4096)
    try:
        with KVCacheClient(srv.address) as c:
            c.register_memfd(fd)
            watch = c.fd_server_watch()
            assert watch is not None
            srv.signal(signal.SIGSTOP)
            try:
                assert not watch.exited()
            finally:
                srv.signal(signal.SIGCONT)
    finally:
        os.close(fd)


def test_no_watch_of_a_peer_that_hung_up() -> None:
    """The pid SO_PEERCRED gives was taken at connect: once the peer hung up it
    may name a later process, so there is no watch."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        watch = fdpass.peer_watch(ours)
        assert watch is not None and not watch.exited()  # our own process
        theirs.close()
        assert fdpass.peer_watch(ours) is None


def test_no_watch_without_pidfds(
    spawn: Callable[..., ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel or Python without pidfd_open: no watch, held tasks wait for kvsvc."""
    srv = spawn()
    monkeypatch.delattr(os, "pidfd_open")
    fd = fdpass.make_sealed_memfd("no-pidfds", 4096)
    try:
        with KVCacheClient(srv.address) as c:
            c.register_memfd(fd)
            assert c.fd_server_watch() is None
    finally:
        os.close(fd)
