"""The Python floor is one number: pyproject's requires-python, the version mypy
and ruff check the code as (so a newer API or syntax fails `make check`), the
image's base, and what the README promises."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=(\d+)\.(\d+)", spec)
    assert m, f"requires-python {spec!r} is not a plain floor"
    return int(m[1]), int(m[2])


def test_the_checks_run_as_the_floor() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    major, minor = floor()
    assert tool["mypy"]["python_version"] == f"{major}.{minor}"
    assert tool["ruff"]["target-version"] == f"py{major}{minor}"
    assert sys.version_info[:2] >= (major, minor)


def test_the_image_and_the_readme_name_the_floor() -> None:
    major, minor = floor()
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=python:(\d+)\.(\d+)", dockerfile, re.M)
    assert base and (int(base[1]), int(base[2])) >= (major, minor), "the image's Python"
    assert f"Python >= {major}.{minor} is required" in dockerfile
    assert f"Python ≥ {major}.{minor}" in (ROOT / "README.md").read_text()


def test_the_floor_has_what_the_server_relies_on() -> None:
    """asyncio.timeout, Task contexts (the eager dispatch) and tomllib are 3.11's."""
    assert floor() >= (3, 11)
