"""Big inline messages against a well-behaved caller: N clients each send inline
Stores larger than the whole store (all refused, REQUEST_EXCEEDS_CAPACITY) from one
process while another asks Lookups; prints the Lookup p50 / p99 / max during the flood (and
before it, the reference), the refusals by reason, and the server's peak RSS
(VmHWM) against the store capacity plus --inline-budget-bytes.

    python -m benchmarks.inline_flood [--smoke] [--clients 8] [--message-mib 128]
        [--store-mib 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from collections import Counter
from typing import Any

from benchmarks.common import KvsvcServer, md_table, proc_status
from kvsvc.client import KVCacheClient
from kvsvc.errors import KVServiceError

MiB = 1 << 20
BUDGET_MIB = 512  # the server's default --inline-budget-bytes


def lookups(address: str, stop: threading.Event, seconds: float) -> list[float]:
    """Lookup latencies (s) for ``seconds`` or until ``stop``."""
    out: list[float] = []
    with KVCacheClient(address) as client:
        client.lookup([b"warm"], namespace="ns")
        end = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < end:
            t0 = time.perf_counter()
            client.lookup([b"k%d" % i for i in range(8)], namespace="ns")
            out.append(time.perf_counter() - t0)
    return out


def summary(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    return {
        "n": len(lat),
        "p50": statistics.median(lat) * 1e3,
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "max": lat[-1] * 1e3,
    }


def _flood(address: str, clients: int, message_mib: int, rounds: int, out: Any) -> None:
    """(A process of its own: the senders' GIL is not the prober's.) ``clients``
    threads each send ``rounds`` inline Stores; puts the answers by reason on ``out``."""
    payload = b"\x5a" * (message_mib * MiB)
    reasons: Counter[str] = Counter()
    lock = threading.Lock()

    def send(i: int) -> None:
        with KVCacheClient(address) as client:
            for r in range(rounds):
                try:
                    client.put("ns", [(b"big-%d-%d" % (i, r), payload)], timeout=120)
                    got = "stored"
                except KVServiceError as exc:
                    got = exc.reason
                with lock:
                    reasons[got] += 1

    threads = [threading.Thread(target=send, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    out.put(dict(reasons))


def measure(
    *, clients: int, message_mib: int, store_mib: int, rounds: int, budget_mib: int = BUDGET_MIB
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with KvsvcServer(
        store_bytes=store_mib * MiB, extra_args=("--inline-budget-bytes", f"{budget_mib}MiB")
    ) as server:
        rss_start = proc_status(server.pid)["VmRSS"]
        idle = summary(lookups(server.address, threading.Event(), 2.0))
        stop = threading.Event()
        lat: list[float] = []
        prober = threading.Thread(target=lambda: lat.extend(lookups(server.address, stop, 900)))
        out = ctx.Queue()
        sender = ctx.Process(
            target=_flood, args=(server.address, clients, message_mib, rounds, out)
        )
        t0 = time.monotonic()
        prober.start()
        sender.start()
        reasons = out.get(timeout=900)
        took = time.monotonic() - t0
        sender.join(60)
        stop.set()
        prober.join(60)
        status = proc_status(server.pid)
    return {
        "clients": clients,
        "message_mib": message_mib,
        "store_mib": store_mib,
        "budget_mib": budget_mib,
        "rounds": rounds,
        "seconds": took,
        "reasons": reasons,
        "idle": idle,
        "flood": summary(lat or [float("nan")]),
        "rss_start_mib": rss_start / MiB,
        "rss_peak_mib": status["VmHWM"] / MiB,
    }


def table(r: dict[str, Any]) -> str:
    f, i = r["flood"], r["idle"]
    return md_table(
        ["load", "Lookup p50 / p99 / max (ms)", "alone: p50 / p99 (ms)", "answers",
         "server RSS start → peak (MiB)", "store + budget (MiB)"],
        [(f"{r['clients']} x {r['rounds']} inline Stores of {r['message_mib']} MiB, "
          f"{r['store_mib']} MiB store", f"{f['p50']:.2f} / {f['p99']:.2f} / {f['max']:.1f}",
          f"{i['p50']:.2f} / {i['p99']:.2f}",
          ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items())),
          f"{r['rss_start_mib']:.0f} → {r['rss_peak_mib']:.0f}",
          f"{r['store_mib'] + r['budget_mib']}")],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--message-mib", type=int, default=128)
    ap.add_argument("--store-mib", type=int, default=64)
    ap.add_argument("--budget-mib", type=int, default=BUDGET_MIB)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.message_mib, args.store_mib, args.rounds = 2, 8, 4, 1
    print(table(measure(clients=args.clients, message_mib=args.message_mib,
                        store_mib=args.store_mib, rounds=args.rounds,
                        budget_mib=args.budget_mib)))  # fmt: skip


if __name__ == "__main__":
    main()
