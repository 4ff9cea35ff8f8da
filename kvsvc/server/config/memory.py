"""How much memory this server may take here: the host's RAM, and the memory limit
of its cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, the tightest of its
own and its ancestors'), so a store a container's limit cannot hold is refused in
one line at start instead of OOMKilled once it fills."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvsvc.limits import GiB, MiB
from kvsvc.server.config.setting import ConfigError
from kvsvc.server.config.values import format_size

#: What the server itself takes beside the store (the interpreter, torch, gRPC):
#: ~250 MiB resident when idle, measured with a 16 MiB store.
SERVER_BYTES = 256 * MiB
#: At or above this a cgroup v1 limit means none (the kernel writes 2^63 - 4096).
UNLIMITED = 1 << 62
#: (cgroup version, the controller's name in /proc/self/cgroup, the limit's file)
FILES = ((2, "", "memory.max"), (1, "memory", "memory.limit_in_bytes"))


@dataclass(frozen=True)
class Limit:
    bytes: int
    what: str  # "this host's memory" or the cgroup file that sets it


def check_store_fits(store_bytes: int, root: str = "/") -> None:
    """The store and the server's own memory must fit in what this process may
    use (``root``: where /proc and /sys are, for tests); else a ConfigError."""
    limits = [limit for limit in (host_memory(), cgroup_limit(root)) if limit is not None]
    if not limits:  # not known here: the allocation decides
        return
    limit = min(limits, key=lambda x: x.bytes)
    if store_bytes + SERVER_BYTES > limit.bytes:
        raise ConfigError(
            f"--store-bytes {format_size(store_bytes)}: more than {limit.what} "
            f"({limit.bytes / GiB:.1f} GiB) leaves beside the server's own "
            f"{SERVER_BYTES // MiB} MiB; give a smaller --store-bytes or raise the limit"
        )


def host_memory() -> Limit | None:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return Limit(total, "this host's memory")


def cgroup_limit(root: str = "/") -> Limit | None:
    """The tightest memory limit on this process's cgroups (v2, v1 or both), or None."""
    base = Path(root)
    try:
        membership = (base / "proc/self/cgroup").read_text().splitlines()
        mounts = (base / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = []
    for version, name, limit_file in FILES:
        path = _membership(membership, version, name)
        mount = _mount(mounts, version)
        if path is None or mount is None:
            continue
        mount_root, mount_point = mount
        # The cgroup's path is relative to the hierarchy's root; the mount shows
        # the hierarchy from mount_root (a container's own cgroup, with cgroupns).
        if path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
            path = path[len(mount_root.rstrip("/")) :]
        top = base / mount_point.lstrip("/")
        found += _tightest(top, top / path.lstrip("/"), limit_file)
    return min(found, key=lambda x: x.bytes) if found else None


def _membership(lines: list[str], version: int, controller: str) -> str | None:
    """This process's cgroup path: v2's ``0::PATH``, v1's line naming ``controller``."""
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if version == 2 and hierarchy == "0" and not controllers:
            return path
        if version == 1 and controller in controllers.split(","):
            return path
    return None


def _mount(lines: list[str], version: int) -> tuple[str, str] | None:
    """(root within the hierarchy, mount point) of the cgroup2 mount, or of v1's memory one."""
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        if version == 2 and fstype == "cgroup2":
            return fields[3], fields[4]
        if version == 1 and fstype == "cgroup" and "memory" in options.split(","):
            return fields[3], fields[4]
    return None


def _tightest(top: Path, leaf: Path, name: str) -> list[Limit]:
    """Limits set in ``name`` from ``leaf`` up to ``top`` (directories that are not
    there, as when the mount shows less than the path, are skipped)."""
    out = []
    d = leaf
    while True:
        try:
            text = (d / name).read_text().strip()
        except OSError:
            text = ""
        if text and text != "max" and text.isdigit() and int(text) < UNLIMITED:
            out.append(Limit(int(text), f"the cgroup memory limit in {d / name}"))
        if d == top or top not in d.parents:
            return out
        d = d.parent
