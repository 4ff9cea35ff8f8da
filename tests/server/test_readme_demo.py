"""The README's demo transcript is what `kvsvc demo` prints: the same steps in the
same order with the same results (only the timings and the header's ids differ)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def rows(text: str) -> list[tuple[str, str]]:
    """(step, result) of each table row between the header line and 'demo: OK'."""
    body = text[text.index("\nstep ") :].split("\n\ndemo:")[0].splitlines()[2:]
    out = []
    for line in body:
        match = re.match(r"^(\S.*?)\s{2,}(\S.*?)\s+[\d.]+$", line)
        assert match, f"not a demo row: {line!r}"
        out.append((match.group(1), match.group(2)))
    return out


def test_the_readme_transcript_matches_the_demo(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("```\nkvsvc 0.1.0 at ") :].split("```")[1]
    out = subprocess.run(
        [sys.executable, "-m", "kvsvc", "demo", "--shm-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "demo: OK" in out.stdout and "demo: OK" in block
    assert rows(out.stdout) == rows(block)
