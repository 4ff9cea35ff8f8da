"""--store-bytes against what this process may use: the host's RAM and its
cgroup's memory limit (v2 memory.max, v1 memory.limit_in_bytes, ancestors too),
read from a fake /proc and /sys (``root``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsvc.limits import GiB, MiB
from kvsvc.server.config import ConfigError, memory

V2_MOUNT = "30 23 0:26 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
V1_MOUNT = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"


def fake(tmp: Path, cgroup: str, mounts: list[str], files: dict[str, str]) -> str:
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/self/cgroup").write_text(cgroup)
    (tmp / "proc/self/mountinfo").write_text("\n".join(mounts) + "\n")
    for path, text in files.items():
        f = tmp / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return str(tmp)


def test_v2_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root = fake(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        [V2_MOUNT.format(root="/")],
        {
            "/sys/fs/cgroup/kubepods/memory.max": str(8 * GiB),
            "/sys/fs/cgroup/kubepods/pod1/memory.max": str(2 * GiB),
            "/sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max",
        },
    )
    limit = memory.cgroup_limit(root)
    assert limit is not None and limit.bytes == 2 * GiB
    assert limit.what.endswith("sys/fs/cgroup/kubepods/pod1/memory.max")


def test_v2_in_a_cgroup_namespace_reads_the_mounts_own_root(tmp_path: Path) -> None:
    """With cgroupns the container sees "0::/" and its cgroup mounted at the top."""
    root = fake(
        tmp_path, "0::/\n", [V2_MOUNT.format(root="/")], {"/sys/fs/cgroup/memory.max": "1073741824"}
    )
    assert memory.cgroup_limit(root) == memory.Limit(
        GiB, f"the cgroup memory limit in {tmp_path}/sys/fs/cgroup/memory.max"
    )


def test_v1_memory_controller_unlimited_is_no_limit(tmp_path: Path) -> None:
    cgroup = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"
    root = fake(
        tmp_path,
        cgroup,
        [V1_MOUNT.format(root="/docker/abc")],  # the mount shows the container's own
        {"/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"},
    )
    assert memory.cgroup_limit(root) is None
    (tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(f"{512 * MiB}\n")
    limit = memory.cgroup_limit(root)
    assert limit is not None and limit.bytes == 512 * MiB


def test_v1_and_v2_both_mounted_the_tighter_wins(tmp_path: Path) -> None:
    root = fake(
        tmp_path,
        "4:memory:/a\n0::/b\n",
        [V1_MOUNT.format(root="/"), V2_MOUNT.format(root="/").replace("/sys/fs/cgroup ", "/u ")],
        {"/sys/fs/cgroup/memory/a/memory.limit_in_bytes": str(3 * GiB), "/u/b/memory.max": "max"},
    )
    limit = memory.cgroup_limit(root)
    assert limit is not None and limit.bytes == 3 * GiB


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert memory.cgroup_limit(str(tmp_path)) is None  # no /proc there
    root = fake(tmp_path, "0::/x\n", [V2_MOUNT.format(root="/")], {})
    assert memory.cgroup_limit(root) is None


def test_a_store_the_limit_cannot_hold_is_refused_in_one_line(tmp_path: Path) -> None:
    root = fake(
        tmp_path, "0::/\n", [V2_MOUNT.format(root="/")], {"/sys/fs/cgroup/memory.max": str(GiB)}
    )
    memory.check_store_fits(GiB - memory.SERVER_BYTES, root)  # fits, with the server's own
    with pytest.raises(ConfigError) as exc:
        memory.check_store_fits(GiB, root)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("--store-bytes 1G: more than the cgroup memory limit in ")
    assert "memory.max (1.0 GiB)" in message
