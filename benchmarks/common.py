"""Helpers shared by the benchmark scripts: starting and stopping a real
`kvsvc serve`, timing loops, percentiles, process memory, machine facts,
markdown tables and a progress display."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVING_RE = re.compile(r"serving on (\S+) \(store")


class KvsvcServer:
    """One `kvsvc serve` subprocess; ``address`` is what clients dial."""

    def __init__(
        self,
        *,
        threads: int = 2,
        store_bytes: int | str = 1 << 30,
        shm_dir: str = "/dev/shm",
        listen: str = "127.0.0.1:0",
        env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        start_timeout: float = 120.0,
        cwd: str | None = None,
    ) -> None:
        log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            "w+", prefix="kvsvc-bench-", suffix=".log", delete=False
        )
        self.log_path = Path(log.name)
        self._log = log
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        full_env.pop("KVSVC_FAILPOINTS", None)
        full_env.update(env or {})
        cmd = [sys.executable, "-m", "kvsvc", "serve", "--listen", listen,
               "--transfer-threads", str(threads), "--store-bytes", str(store_bytes),
               "--shm-dir", shm_dir, *extra_args]  # fmt: skip
        # ``cwd``: another checkout's kvsvc (python -m imports from the cwd first).
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd
        )
        self.pid = self.proc.pid
        address = wait_for_address(self.proc, self.log_path, SERVING_RE, start_timeout)
        if address is None:
            text = self.log_path.read_text()
            self.stop()
            raise RuntimeError(f"kvsvc serve did not start:\n{text}")
        self.address = address

    def log_text(self) -> str:
        return self.log_path.read_text()

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; returns the exit code."""
        rc = stop_process(self.proc, grace)
        self._log.close()
        with contextlib.suppress(FileNotFoundError):
            self.log_path.unlink()
        return rc

    def __enter__(self) -> KvsvcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for_address(
    proc: subprocess.Popen, log_path: Path, pattern: re.Pattern[str], timeout: float
) -> str | None:
    """The address a starting server logs (``pattern`` group 1); None if it exits or
    the timeout passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = pattern.search(log_path.read_text())
        if m:
            return m.group(1)
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def start_server(threads: int, store_bytes: int, shm_dir: str) -> tuple[KvsvcServer, str]:
    """A `kvsvc serve` on 127.0.0.1 (port picked by the kernel): (server, address)."""
    server = KvsvcServer(threads=threads, store_bytes=store_bytes, shm_dir=shm_dir)
    return server, server.address


def stop_process(proc: subprocess.Popen, grace: float = 15.0) -> int | None:
    """End one process this benchmark started: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return proc.returncode


# --- timing ---
def bench(fn: Callable[[], Any], nbytes: int, seconds: float) -> float:
    """GB/s of ``fn`` moving ``nbytes`` per call: median over repeated calls."""
    return bench_interleaved({"x": fn}, nbytes, seconds)["x"]


def bench_interleaved(
    fns: dict[str, Callable[[], Any]], nbytes: int, seconds: float, min_rounds: int = 3
) -> dict[str, float]:
    """GB/s of each of ``fns`` (each moves ``nbytes`` per call), measured in
    alternating rounds so that machine noise hits all of them alike: the median
    per function over the rounds run within about ``seconds`` x len(fns)."""
    for fn in fns.values():
        fn()  # warm up (page faults, first touch, connections)
    rates: dict[str, list[float]] = {name: [] for name in fns}
    t_end = time.monotonic() + seconds * len(fns)
    rounds = 0
    while (time.monotonic() < t_end or rounds < min_rounds) and rounds < 100_000:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            rates[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
        rounds += 1
    return {name: statistics.median(r) for name, r in rates.items()}


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# --- processes ---
def proc_status(pid: int) -> dict[str, int]:
    """Memory fields of /proc/PID/status, in bytes (VmRSS, RssAnon, RssFile,
    RssShmem, VmHWM)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    if "VmRSS" not in out:
        raise RuntimeError(f"/proc/{pid}/status has no VmRSS (process gone?)")
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``, from /proc."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


class ThreadsBusy:
    """Cores some threads of a process keep busy while the calls wrapped by
    ``measure`` run: their CPU seconds (/proc/PID/task/TID/stat, read by ``start``
    and ``stop`` around a phase, so no call pays for reading them) over the wall
    seconds of those calls. Only meaningful when nothing else in the phase makes
    those threads work. kvsvc names its copy threads in the OS (``kvsvc-copy-N``);
    its event loop runs on the main thread (TID = PID)."""

    def __init__(self, pid: int, prefix: str = "kvsvc-copy-") -> None:
        self.pid, self.cpu, self.loop_cpu, self.wall = pid, 0.0, 0.0, 0.0
        self.tids: list[int] = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                if (task / "comm").read_text().strip().startswith(prefix):
                    self.tids.append(int(task.name))
        self._at: tuple[float, float] = (0.0, 0.0)

    def _read(self) -> tuple[float, float]:
        cpu = thread_cpu(self.pid)
        return sum(cpu.get(t, 0.0) for t in self.tids), cpu.get(self.pid, 0.0)

    def start(self) -> None:
        self._at = self._read()

    def stop(self) -> None:
        (c0, l0), (c1, l1) = self._at, self._read()
        self.cpu += c1 - c0
        self.loop_cpu += l1 - l0

    def measure(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.wall += time.perf_counter() - t0

        return run

    def cores(self) -> tuple[float, float]:
        """(copy threads, event loop thread) cores busy over the measured calls."""
        return (self.cpu / self.wall, self.loop_cpu / self.wall) if self.wall else (0.0, 0.0)


# --- machine ---
def machine_info() -> dict[str, str]:
    """The facts a reader needs to compare figures across machines: cores usable
    here (``nproc``), CPU model, memory, kernel, versions, and the load average
    when the run began (other work on a shared machine shows there)."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "unknown"
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f"{kb / (1 << 20):.1f} GiB"
    info = {
        "host": platform.node(),
        "cores": str(len(os.sched_getaffinity(0))),
        "cpu": cpu,
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    for mod in ("torch", "grpc", "google.protobuf", "numpy", "zmq", "msgpack"):
        key = mod.replace("google.", "")
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[key] = str(getattr(m, "__version__", "?"))
        except ImportError:
            info[key] = "not installed"
    return info


def machine_line(info: dict[str, str]) -> str:
    return (
        f"{info['cores']} cores ({info['cpu']}), {info['memory']} RAM, Linux {info['kernel']}; "
        f"Python {info['python']}, torch {info['torch']}, grpcio {info['grpc']}, "
        f"protobuf {info['protobuf']}, pyzmq {info['zmq']}, msgpack {info['msgpack']}; "
        f"load average {info['load']} (1, 5, 15 min) at the start"
    )


# --- output ---
def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Progress:
    """A progress bar over a known number of steps: tqdm when installed, else a
    printed counter. ``log`` prints a line without breaking the bar."""

    def __init__(self, total: int, desc: str = "bench", *, enabled: bool = True) -> None:
        self.total, self.n, self.desc = total, 0, desc
        self._bar: Any = None
        self._enabled = enabled
        self._t0 = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)

    def step(self, what: str) -> None:
        """Mark one step done; ``what`` names it."""
        self.n += 1
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(what[:60], refresh=False)
            self._bar.update(1)
        else:
            elapsed = time.monotonic() - self._t0
            print(f"[{self.n}/{self.total} {elapsed:5.0f}s] {what}", file=sys.stderr, flush=True)

    def add(self, steps: int) -> None:
        """Grow the total (a section found more work than planned)."""
        self.total += steps
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def log(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class NullProgress(Progress):
    def __init__(self) -> None:
        super().__init__(0, enabled=False)

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
