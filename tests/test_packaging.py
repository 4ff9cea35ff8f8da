"""The runtime floors in pyproject.toml are never older than the generator that
made src/kvsvc/v1 (an older runtime refuses, or worse, misreads, newer code)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO


def _floor(deps: list[str], name: str) -> tuple[int, ...]:
    for dep in deps:
        m = re.match(rf"^{re.escape(name)}>=([0-9.]+)", dep.replace(" ", ""))
        if m:
            return tuple(int(x) for x in m.group(1).split("."))
    raise AssertionError(f"{name} has no >= floor in pyproject.toml")


def test_runtime_floors_cover_the_generated_code() -> None:
    text = (REPO / "pyproject.toml").read_text()  # (tomllib is 3.11+; we support 3.10)
    deps = re.findall(
        r'^\s*"([^"]+)",', text.split("dependencies = [", 1)[1].split("]", 1)[0], re.M
    )
    gen = Path(REPO / "src/kvsvc/v1")
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
