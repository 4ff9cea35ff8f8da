"""The server's start line names the copy loop that runs its copies, and why."""

from __future__ import annotations

import signal

from kvsvc.server.data import copies


def test_the_start_line_names_the_copy_loop_and_why(spawn) -> None:
    srv = spawn()
    srv.signal(signal.SIGTERM)
    assert srv.wait(60) == 0
    line = next(x for x in srv.output().splitlines() if "serving on" in x)
    name, why = copies.copy_loop()  # this checkout's build, as the server loaded it
    assert f"copy loop {name}: {why}," in line, line
