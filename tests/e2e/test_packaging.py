"""The runtime floors in pyproject.toml are never older than the generator that
made kvsvc/v1 (an older runtime refuses, or worse, misreads, newer code)."""

from __future__ import annotations

import importlib.machinery
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import REPO

pytestmark = pytest.mark.slow  # starts servers or subprocesses


def _floor(deps: list[str], name: str) -> tuple[int, ...]:
    for dep in deps:
        m = re.match(rf"^{re.escape(name)}>=([0-9.]+)", dep.replace(" ", ""))
        if m:
            return tuple(int(x) for x in m.group(1).split("."))
    raise AssertionError(f"{name} has no >= floor in pyproject.toml")


def test_runtime_floors_cover_the_generated_code() -> None:
    text = (REPO / "pyproject.toml").read_text()
    deps = re.findall(
        r'^\s*"([^"]+)",', text.split("dependencies = [", 1)[1].split("]", 1)[0], re.M
    )
    gen = Path(REPO / "kvsvc/v1")
    grpc_gen = re.search(
        r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (gen / "kv_cache_service_pb2_grpc.py").read_text()
    )
    pb_gen = re.search(
        r"Protobuf Python Version: ([0-9.]+)", (gen / "kv_cache_service_pb2.py").read_text()
    )
    assert grpc_gen and pb_gen
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert _floor(deps, "grpcio") >= as_tuple(grpc_gen.group(1))
    assert _floor(deps, "grpcio-health-checking") >= as_tuple(grpc_gen.group(1))
    assert _floor(deps, "protobuf") >= as_tuple(pb_gen.group(1))


def test_the_wheel_holds_the_package_and_nothing_beside_it(tmp_path: Path) -> None:
    """The package sits at the repository root beside benchmarks/, tests/ and tools/:
    the wheel must hold exactly kvsvc/ (its modules, generated code and stubs) and
    the two native modules the package build compiles (setup.py)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("kvsvc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {n for n in names if not n.startswith("kvsvc-")}
    expected = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "kvsvc").rglob("*")
        if p.suffix in (".py", ".pyi", ".typed") and "__pycache__" not in p.parts
    }
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    expected |= {
        f"kvsvc/server/data/native/_copyloop{suffix}",
        f"kvsvc/client/native/_presence{suffix}",
    }
    assert package == expected
    assert {"kvsvc/py.typed", "kvsvc/v1/kv_cache_service_pb2.pyi"} <= package
    assert not {n for n in names if n.split("/")[0] in ("benchmarks", "tests", "tools")}
