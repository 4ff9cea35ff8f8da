"""`kvsvc serve` children forked from one process that imported kvsvc (and torch)
once: a restart costs a fork and a server start instead of seconds of imports, so a
test can kill -9 and restart a server fifty times within CI's budget.

The zygote (this file run as a script) starts no gRPC, event loop or thread of its
own before it forks: gRPC does not survive a fork once it started. It reads one
JSON command a line on stdin and answers one line on stdout:
  {"fork": [LOG, ARG, ...]} -> the child's pid (its stdout and stderr go to LOG;
                                it runs `kvsvc serve ARG ...` and exits with its code)
  {"wait": PID, "limit": S} -> the child's wait status, or null if it has not ended
                                within S seconds (0: a poll)
EOF ends it. The test side is Zygote (a context manager) and Forked."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType

#: how long the zygote waits for a killed child to be reaped
REAP_S = 30.0


def _child(log: str, args: list[str]) -> None:
    """In the forked child: become `kvsvc serve`, never return."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        from kvsvc.cli.main import main

        code = main(["serve", *args])
    except SystemExit as exc:  # a usage error: argparse's exit code
        code = exc.code if isinstance(exc.code, int) else 2
    except Exception:  # noqa: BLE001  (a fork must reach os._exit; the traceback is logged)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(pid: int, limit: float) -> int | None:
    end = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() >= end:
            return None
        time.sleep(0.01)


def _zygote() -> None:
    # The imports every child shares (torch, grpc, the server): paid once.
    import kvsvc.cli.main
    import kvsvc.server.ops.lifecycle  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "fork" in command:
            log, *args = command["fork"]
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(log, args)
            print(json.dumps(pid), flush=True)
        else:
            print(json.dumps(_reap(int(command["wait"]), float(command["limit"]))), flush=True)


class Zygote:
    """The zygote as a subprocess, and the servers it forks."""

    def __init__(self, limit: float = 120.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.children: set[int] = set()
        assert self._line(limit) == "ready"

    def _line(self, limit: float) -> str:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(limit):
                raise TimeoutError(f"the zygote did not answer within {limit} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited ({self.proc.poll()})")
        return line.strip()

    def _ask(self, command: dict[str, object], limit: float = 60.0) -> object:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(limit))

    def serve(self, log: Path, *args: str, limit: float = 60.0) -> Forked:
        """A forked `kvsvc serve --listen 127.0.0.1:0 ARGS`, once it says where it serves."""
        pid = self._ask({"fork": [str(log), "--listen", "127.0.0.1:0", *args]})
        assert isinstance(pid, int)
        self.children.add(pid)
        return Forked(self, pid, log, limit)

    def kill(self, pid: int) -> int:
        """kill -9 ``pid`` and reap it: its wait status."""
        os.kill(pid, signal.SIGKILL)
        status = self._ask({"wait": pid, "limit": REAP_S}, REAP_S + 10)
        assert isinstance(status, int), f"child {pid} not reaped within {REAP_S} s"
        self.children.discard(pid)
        return status

    def close(self) -> None:
        for pid in list(self.children):
            self.kill(pid)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Forked:
    """One forked server: its pid, log and address."""

    def __init__(self, zygote: Zygote, pid: int, log: Path, limit: float) -> None:
        self.zygote, self.pid, self.log = zygote, pid, log
        end = time.monotonic() + limit
        while True:
            text = log.read_text() if log.exists() else ""
            m = re.search(r"serving on 127\.0\.0\.1:(\d+)", text)
            if m:
                self.address = f"127.0.0.1:{m.group(1)}"
                return
            if zygote._ask({"wait": pid, "limit": 0}) is not None:
                zygote.children.discard(pid)
                raise RuntimeError(f"forked server exited: {text}")
            if time.monotonic() > end:
                zygote.kill(pid)
                raise RuntimeError(f"forked server did not start in {limit} s: {text}")
            time.sleep(0.02)

    def kill9(self) -> int:
        return self.zygote.kill(self.pid)


if __name__ == "__main__":
    _zygote()
