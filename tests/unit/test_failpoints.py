"""Failpoints are inert until loaded: importing kvsvc (the server included) reads
no environment, so a bad KVSVC_FAILPOINTS cannot break an import and an embedded
server injects nothing; `kvsvc serve` loads the table (tests/server/test_faults.py runs
it). The hot paths read ``failpoints.ENABLED`` at call time."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvsvc.cli import main as cli
from kvsvc.server.ops import failpoints


@pytest.fixture(autouse=True)
def inert() -> Iterator[None]:
    """Every test leaves the process's table empty, as it found it."""
    assert not failpoints.ENABLED
    yield
    failpoints.load("")


def test_importing_kvsvc_ignores_the_environment() -> None:
    """Before: the table was parsed at import, so a bad one made `import` raise."""
    code = (
        "from kvsvc.server.ops import failpoints\nfrom kvsvc.cli import main as cli\n"
        "assert not failpoints.ENABLED and failpoints.active() == {}\n"
        "failpoints.hit('store.put')\n"
    )
    for spec in ("no.such.point=raise", "store.put=raise"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KVSVC_FAILPOINTS": spec},
        )
        assert out.returncode == 0, out.stderr


def test_load_enables_and_an_empty_table_disables() -> None:
    failpoints.load("store.put=raise")
    assert failpoints.ENABLED
    assert failpoints.active() == {"store.put": (1.0, "raise", 0, "")}
    with pytest.raises(failpoints.FailpointError, match=r"failpoint store\.put fired"):
        failpoints.hit("store.put")
    failpoints.hit("transfer.copy")  # not in the table: nothing
    failpoints.load("")
    assert not failpoints.ENABLED
    failpoints.hit("store.put")


def test_a_bad_table_raises_and_keeps_the_one_loaded() -> None:
    failpoints.load("transfer.copy=sleep(1)")
    with pytest.raises(ValueError, match="unknown failpoint 'nope'"):
        failpoints.load("nope=raise")
    assert failpoints.ENABLED and list(failpoints.active()) == ["transfer.copy"]


def test_load_from_env_reads_kvsvc_failpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.ENV, "map.rank=2@kill-thread")
    failpoints.load_from_env()
    failpoints.hit("map.rank", 1)  # another rank: nothing
    with pytest.raises(failpoints.FailpointThreadKill):
        failpoints.hit("map.rank", 2)
    assert not isinstance(failpoints.FailpointThreadKill("x"), Exception)
    monkeypatch.delenv(failpoints.ENV)
    failpoints.load_from_env()
    assert not failpoints.ENABLED


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("transfer.copy=explode", "bad action 'explode'"),
        ("store.put=raise;store.put=hang", "set twice"),
        ("store.put=2*raise", r"probability 2.0 is not in \(0, 1\]"),
        ("store.put=Lookup@raise", "takes no tag"),
    ],
)
def test_parse_refuses_bad_tables(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        failpoints.parse(spec)


def test_parse_reads_tags_probabilities_and_sleeps() -> None:
    assert failpoints.parse(" handler.enter=Lookup@0.5*sleep(20) ; transfer.copy=hang ;") == {
        "handler.enter": (0.5, "sleep", 20, "Lookup"),
        "transfer.copy": (1.0, "hang", 0, ""),
    }


async def test_hit_async_delays_only_its_caller() -> None:
    failpoints.load("handler.enter=Map@sleep(50)")
    other = asyncio.create_task(failpoints.hit_async("handler.enter", "Lookup"))
    await asyncio.wait_for(failpoints.hit_async("handler.enter", "Map"), 30)
    assert other.done()  # the other RPC's hit returned without waiting


def test_the_failpoints_command_checks_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(failpoints.ENV, "no.such.point=raise")
    assert cli.main(["failpoints"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvsvc failpoints: KVSVC_FAILPOINTS: unknown failpoint 'no.such.point'")
    assert "\n" not in err
    monkeypatch.delenv(failpoints.ENV)
    assert cli.main(["failpoints"]) == 0
    assert "transfer.before_copy" in capsys.readouterr().out
    assert not failpoints.ENABLED  # listing loads nothing
