"""Where the fd socket listens and who may connect to it: its path (set, or chosen
for 'auto'), the socket dir's and the socket's permissions, and whether another
server already answers on a path."""

from __future__ import annotations

import logging
import os
import socket
import stat
import tempfile

from kvsvc.limits import FD_SOCKET_NAME
from kvsvc.server.config.host import MAX_UNIX_PATH

log = logging.getLogger(__name__)


def socket_path(setting: str, shm_dir: str, start_id: str, socket_dir: str = "") -> str | None:
    """Where the server listens for fds: ``setting``, or for 'auto' fd.sock in the
    socket dir (shared with engines' containers), else a per-server name in the shm
    dir, or in the temp dir when that path is too long for a unix socket; None for
    'off'."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    if socket_dir:
        return os.path.join(socket_dir, FD_SOCKET_NAME)
    name = f".kvsvc-{start_id[:12]}.fds"
    path = os.path.join(shm_dir, name)
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        path = os.path.join(tempfile.gettempdir(), name)
    return path


def prepare_socket_dir(path: str, gid: int) -> None:
    """Make the socket dir (0750) if missing; give it ``gid`` (-1: keep) when this
    process owns it. A directory someone else made (a hostPath, a volume) keeps its
    mode: the sockets' own 0660 and group decide who may connect."""
    os.makedirs(path, mode=0o750, exist_ok=True)
    st = os.stat(path)
    if st.st_uid == os.geteuid():
        if gid >= 0 and st.st_gid != gid:
            os.chown(path, -1, gid)
        if st.st_mode & 0o007:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o007)  # others: nothing
    elif st.st_mode & 0o002:
        log.warning("socket dir %s is writable by everyone: anyone can replace its sockets", path)


def restrict_socket(path: str, gid: int) -> None:
    """Only the server's uid and ``gid`` (-1: the server's gid) may connect."""
    if gid >= 0:
        os.chown(path, -1, gid)
    os.chmod(path, 0o660)


def answers(path: str) -> bool:
    """Whether a server listens on the unix socket at ``path`` now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True
