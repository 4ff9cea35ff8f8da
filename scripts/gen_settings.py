"""Writes docs/configuration.md's settings tables (between the settings:begin/end markers)
from the settings declared in kvsvc/server/config/settings.py.

    .venv/bin/python scripts/gen_settings.py           # rewrite the tables
    .venv/bin/python scripts/gen_settings.py --check   # exit 1 if the page drifted

tests/unit/test_config_parsing.py checks the page the same way.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvsvc.server.config.docs import render_tables  # noqa: E402 - after the path is set

DOC_PATH = ROOT / "docs" / "configuration.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail on drift, write nothing")
    args = parser.parse_args()
    have = DOC_PATH.read_text()
    try:
        want = render_tables(have)
    except ValueError as exc:
        print(f"gen_settings: {DOC_PATH}: {exc}", file=sys.stderr)
        return 1
    if have == want:
        return 0
    if not args.check:
        DOC_PATH.write_text(want)
        print("gen_settings: wrote docs/configuration.md")
        return 0
    sys.stdout.writelines(
        difflib.unified_diff(
            have.splitlines(keepends=True),
            want.splitlines(keepends=True),
            "docs/configuration.md (committed)",
            "docs/configuration.md (from kvsvc/server/config)",
        )
    )
    print(
        "gen_settings: docs/configuration.md's settings tables differ from the declarations; "
        "run .venv/bin/python scripts/gen_settings.py and commit the result",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
