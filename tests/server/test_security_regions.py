"""The server never opens a client-named file with its own rights unless it is safe
(issue 15, item 1): each path trick is refused by a real server, and the cases of
another uid run a real client as ``nobody`` (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO, make_cache

from kvsvc.client import KVCacheClient
from kvsvc.errors import InvalidRequest, PermissionDenied

NOBODY = 65534


def _others_can_enter(path: Path) -> bool:
    """Whether another uid can reach ``path``: every directory on the way lets others
    in (a checkout under a 0700 ``mktemp -d`` does not, and nobody cannot import
    kvsvc from it)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in (path, *path.parents))


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="running a client as another uid needs root and setpriv",
)
needs_a_checkout_others_can_read = pytest.mark.skipif(
    not _others_can_enter(REPO),
    reason=f"uid {NOBODY} cannot enter the checkout at {REPO} (a 0700 directory on its path)",
)


def named(cache, name: str):
    region = cache.rank_region()
    for t in region.tensors:
        t.handle.shared_memory.name = name
    return region


def test_each_path_trick_is_refused_and_the_server_keeps_serving(server, client, shm_dir):
    cache = make_cache(shm_dir, "good", seed=1)
    outside = shm_dir.parent / "outside"
    outside.write_bytes(b"\0" * cache.size)
    outside.chmod(0o600)
    os.symlink(outside, shm_dir / "symlink")
    os.mkfifo(shm_dir / "fifo", 0o600)
    (shm_dir / "dir").mkdir()
    os.link(outside, shm_dir / "hardlink")
    group_writable = shm_dir / "gw"
    shutil.copyfile(cache.path, group_writable)
    group_writable.chmod(0o620)
    world_writable = shm_dir / "ww"
    shutil.copyfile(cache.path, world_writable)
    world_writable.chmod(0o602)

    for name in ("../outside", str(outside), "symlink", "fifo", "dir", ".."):
        with pytest.raises(InvalidRequest) as ei:
            client.map("ns", [named(cache, name)], timeout=10)
        assert ei.value.reason == "INVALID_REGION_NAME", name
    for name in ("hardlink", "gw", "ww"):
        with pytest.raises(PermissionDenied) as pd:
            client.map("ns", [named(cache, name)], timeout=10)
        assert pd.value.reason == "REGION_NOT_TRUSTED", name
        assert pd.value.code.name == "PERMISSION_DENIED"
    # Nothing was written through the hard link, and a safe file still maps.
    assert outside.read_bytes() == b"\0" * cache.size
    m = client.map("ns", [cache.rank_region()], timeout=10)
    assert client.store(m, [(b"k", [0, 1])]).stored_chunks == 1


def test_names_off_refuses_every_file_and_says_why(make_server, shm_dir):
    st = make_server(shm_uids="off")
    cache = make_cache(shm_dir, "c")
    with KVCacheClient(st.address) as c, pytest.raises(PermissionDenied) as ei:
        c.map("ns", [cache.rank_region()], timeout=10)
    assert ei.value.reason == "REGION_NOT_TRUSTED"
    assert "--shm-uids off" in ei.value.message


# --- another uid, for real ----------------------------------------------------------
@pytest.fixture
def shared_shm() -> Iterator[Path]:
    """A /dev/shm-like directory (sticky, world-writable) that nobody can use too;
    tmp_path's parents are root-only."""
    d = Path(tempfile.mkdtemp(prefix="kvsvc-sec-"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


NOBODY_CLIENT = r"""
import json, os, sys
from kvsvc.client import KVCacheClient
from kvsvc.errors import KVServiceError
from kvsvc.client.kvcache import SharedKVCache
address, shm_dir, secret = sys.argv[1:4]
out = {}
try:
    open(os.path.join(shm_dir, secret), "rb")
    out["own_open"] = "opened"
except PermissionError:
    out["own_open"] = "EACCES"
cache = SharedKVCache("mine", num_layers=2, num_blocks=4, block_size=4, kv_heads=2,
                      head_dim=16, shm_dir=shm_dir)
def attempt(label, region):
    try:
        with KVCacheClient(address) as c:
            m = c.map("ns", [region], timeout=10)
            out[label] = "mapped"
            out[label + "_stored"] = c.store(m, [(label.encode(), [0])]).stored_chunks
    except KVServiceError as exc:
        out[label] = exc.reason
attempt("own", cache.rank_region())
theirs = cache.rank_region()
for t in theirs.tensors:
    t.handle.shared_memory.name = secret
attempt("secret", theirs)
cache.close()
print(json.dumps(out))
"""


def as_nobody(address: str, shm_dir: Path, secret: str) -> dict[str, object]:
    proc = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-c",
            NOBODY_CLIENT,
            address,
            str(shm_dir),
            secret,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "HOME": "/"},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_root
@needs_a_checkout_others_can_read
def test_a_client_of_another_uid_cannot_have_the_server_map_a_file_it_cannot_open(
    make_server, shared_shm
):
    """The confused deputy of the issue: a nobody client names root's 0600 file. The
    server, trusting nobody's files only, refuses it, and maps nobody's own file."""
    secret = shared_shm / "root-secret"
    secret.write_bytes(b"S" * (1 << 20))
    secret.chmod(0o600)
    st = make_server(shm_dir=str(shared_shm), shm_uids="nobody")
    out = as_nobody(st.address, shared_shm, "root-secret")
    assert out["own_open"] == "EACCES"  # the client itself may not open it
    assert out["secret"] == "REGION_NOT_TRUSTED"
    assert out["own"] == "mapped" and out["own_stored"] == 1
    assert secret.read_bytes() == b"S" * (1 << 20)


@needs_root
@needs_a_checkout_others_can_read
def test_by_default_only_the_server_uids_files_are_mapped(make_server, shared_shm):
    """Default --shm-uids self: another uid's file (its own 0600 file) is refused."""
    (shared_shm / "root-secret").write_bytes(b"\0" * 4096)
    st = make_server(shm_dir=str(shared_shm))
    out = as_nobody(st.address, shared_shm, "root-secret")
    assert out["own"] == "REGION_NOT_TRUSTED"
