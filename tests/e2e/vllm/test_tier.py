"""KvsvcTier below vLLM's real TieringOffloadingManager (tiering.py builds it from
vLLM's own spec and factory, over a real /dev/shm offload file), against real
`kvsvc serve` processes: what one engine offloads another loads bit-exact; a
kvsvc killed mid-run is misses and failed jobs, never an exception or a hang, and
the tier maps again once kvsvc is back; a chunk that fails its check (a bit flipped
in an in-process server's store) is never reported loaded; with vLLM's KV events on,
the tier reports what kvsvc stores and removes; a server secured as
docker/compose.yaml secures it is reached with the connector's token_file, tls_* and
fd_socket keys, with mTLS too (a client certificate by itself or beside the token)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering", reason="the vLLM tests run in .venv-vllm")

from driver import KvsvcProcess
from support import flip
from tiering import Engine, new_keys
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm_helpers import free_port

from kvsvc.integrations.vllm.tier import KvsvcTier


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvsvcProcess]:
    """One server for the tests that leave it running (each uses fresh keys)."""
    proc = KvsvcProcess(free_port(), "", str(tmp_path_factory.mktemp("tier")))
    yield proc
    proc.kill()


def test_vllms_factory_builds_the_tier_from_its_config(server) -> None:
    engine = Engine(target=server.address)
    try:
        assert type(engine.tier) is KvsvcTier  # loaded by type + module_path alone
        assert engine.tier.mover.threads  # vLLM's view staged: nothing to find by name
        assert engine.tier.namespace.startswith("vllm/")
    finally:
        engine.close()


def test_what_one_engine_offloads_another_loads_bit_exact(server) -> None:
    a, b = Engine(target=server.address), Engine(target=server.address)
    try:
        keys = new_keys(6)
        data = a.offload(keys, seed=1)
        a.settle()
        assert a.tier.counters["stored_chunks"] == 6, a.tier.counters
        assert a.tier.namespace == b.tier.namespace  # one deployment, one namespace
        b.wait_index()
        other = new_keys(2)  # never stored: misses
        got = b.fetch(keys + other)
        assert [got[k] for k in other] == [LookupResult.MISS] * 2
        assert {k: got[k] for k in keys} == data  # promoted from kvsvc, byte for byte
        assert b.tier.counters["loaded_chunks"] == 6, b.tier.counters
        # Promoted into b's own CPU tier: asked again, vLLM answers without kvsvc.
        assert {k: v for k, v in b.fetch(keys).items()} == data
        assert b.tier.counters["loaded_chunks"] == 6
    finally:
        a.close()
        b.close()


def test_a_load_fails_for_exactly_the_keys_not_loaded(server) -> None:
    a, b = Engine(target=server.address), Engine(target=server.address)
    try:
        stored = new_keys(3)
        data = a.offload(stored, seed=2)
        a.settle()
        absent = new_keys(1)[0]
        # A job as vLLM's promotion submits it; kvsvc loads the leading run it holds.
        keys = [stored[0], stored[1], absent, stored[2]]
        chunks = np.array([20, 21, 22, 23], dtype=np.int32)
        job = TransferJob(7, keys, chunks, is_promotion=True, req_context=ReqContext("x"))
        b.tier.submit_load(job)
        end = time.monotonic() + 30
        results: list = []
        while not results:
            assert time.monotonic() < end, b.tier.counters
            results = list(b.tier.get_finished_jobs())
            time.sleep(0.01)
        (r,) = results
        assert r.job_id == 7 and not r.success
        assert list(r.successful_keys) == keys[:2]
        assert [b.rows[c].tobytes() for c in (20, 21)] == [data[k] for k in keys[:2]]
    finally:
        a.close()
        b.close()


def test_a_chunk_failing_its_check_is_never_reported_loaded_and_is_dropped(make_server) -> None:
    """A bit flipped in a stored chunk (an in-process server, tests/conftest.py's, so
    that a stored byte can be flipped): vLLM's manager promotes the keys through
    KvsvcTier; the job ends with success=False, the chunk before the bad one loaded
    and reported, the bad one never; vLLM drops the keys not loaded, kvsvc drops the
    bad chunk, so it is a miss from then on; an intact chunk after it is promoted
    again by a later request, bit-exact."""
    srv = make_server()
    store = srv.server.servicer.store
    a, b = Engine(target=srv.address), Engine(target=srv.address)
    jobs: dict[int, list[bytes]] = {}
    results: list[Any] = []
    submit, finished = b.tier.submit_load, b.tier.get_finished_jobs

    def submit_load(job: TransferJob) -> None:
        jobs[job.job_id] = [bytes(k) for k in job.keys]
        submit(job)

    def get_finished_jobs() -> list[Any]:
        out = list(finished())
        results.extend(r for r in out if r.job_id in jobs)
        return out

    b.tier.submit_load, b.tier.get_finished_jobs = submit_load, get_finished_jobs
    try:
        keys = new_keys(3)
        data = a.offload(keys, seed=10)
        a.settle()
        assert a.tier.counters["stored_chunks"] == 3, a.tier.counters
        flip(store, a.tier.namespace, bytes(keys[1]), random.Random(10))
        b.wait_index()

        got = b.fetch(keys)
        bad = bytes(keys[1])
        assert got[keys[1]] is LookupResult.MISS  # dropped by vLLM and by kvsvc
        assert got[keys[0]] == data[keys[0]]
        # The intact key after it: loaded, or (in the failed job) a miss for this
        # request, as vLLM's fs tier marks the keys from the failed one on.
        assert got[keys[2]] in (data[keys[2]], LookupResult.MISS)
        assert store.checksum_failures == 1
        assert not [k for (ns, k, *_) in store._chunks if ns == a.tier.namespace and k == bad]
        # The promotion that held the bad key failed, for exactly the keys from it on.
        holding = [r for r in results if bad in jobs[r.job_id]]
        assert holding, (jobs, results)
        for r in holding:
            keys_of = jobs[r.job_id]
            assert not r.success
            loaded = [bytes(k) for k in (r.successful_keys or [])]
            assert loaded == keys_of[: keys_of.index(bad)], (keys_of, loaded)
        # The intact key after it was dropped by vLLM too; another request promotes
        # it again, bit-exact.
        assert b.fetch([keys[2]])[keys[2]] == data[keys[2]]
        assert any(r.success and bytes(keys[2]) in jobs[r.job_id] for r in results), results
        print(f"jobs {[(j, len(k)) for j, k in jobs.items()]}, results {results}")
        assert b.tier.counters["loads_failed"] >= 1 and not b.tier.counters["hook_errors"]
        # Asked again: the bad key stays a miss (vLLM's tiers and kvsvc both lack it).
        assert b.fetch([keys[1]])[keys[1]] is LookupResult.MISS
    finally:
        a.close()
        b.close()


def test_a_failed_promotion_is_a_miss_for_its_request(tmp_path) -> None:
    """kvsvc holds the keys (the index says HIT) but every Retrieve fails: through
    vLLM's manager, the request's keys end as MISS (its failed promotion is not
    issued again on every step, as vLLM's fs and obj tiers guard against), within
    a bounded number of promotion jobs."""
    server = KvsvcProcess(free_port(), "handler.enter=Retrieve@raise", str(tmp_path))
    a, b = Engine(target=server.address), Engine(target=server.address)
    loads = 0
    submit = b.tier.submit_load

    def submit_load(job: TransferJob) -> None:
        nonlocal loads
        loads += 1
        submit(job)

    b.tier.submit_load = submit_load
    try:
        keys = new_keys(2)
        a.offload(keys, seed=16)
        a.settle()
        assert a.tier.counters["stored_chunks"] == 2, a.tier.counters
        b.wait_index()
        got = b.fetch(keys, timeout=30)
        assert set(got.values()) == {LookupResult.MISS}, b.tier.counters
        assert 1 <= loads <= 2, loads  # one promotion per key at most, never re-issued
        assert not b.tier.counters["hook_errors"]
    finally:
        a.close()
        b.close()
        server.kill()


def test_kvsvc_killed_mid_run_is_misses_and_failed_jobs_then_recovers(tmp_path) -> None:
    port = free_port()
    server = KvsvcProcess(port, "", str(tmp_path))
    a, b = Engine(target=server.address), Engine(target=server.address)
    try:
        before = new_keys(4)
        a.offload(before, seed=3)
        a.settle()
        b.wait_index()
        server.kill()

        # Stores cascaded now are dropped or fail; vLLM's manager gets every job back.
        t0 = time.monotonic()
        lost = new_keys(4)
        a.offload(lost, seed=4)
        a.settle(timeout=30)
        failed = a.tier.counters["stores_failed"] + a.tier.counters["stores_dropped"]
        assert failed == 4, a.tier.counters
        # What kvsvc held is now a miss (a stale index, or a promotion that failed).
        got = b.fetch(before, timeout=30)
        assert set(got.values()) == {LookupResult.MISS}, b.tier.counters
        print(f"outage answered in {time.monotonic() - t0:.2f} s: {dict(b.tier.counters)}")
        assert not a.tier.counters["hook_errors"] and not b.tier.counters["hook_errors"]

        # kvsvc comes back (empty): the tier passes the file again, maps, stores.
        server = KvsvcProcess(port, "", str(tmp_path))
        end = time.monotonic() + 60
        while True:
            again = new_keys(2)
            data = a.offload(again, seed=5)
            a.settle()
            if a.tier.counters["stored_chunks"] >= 6:
                break
            assert time.monotonic() < end, a.tier.counters
            time.sleep(0.2)
        b.wait_index()
        assert {k: v for k, v in b.fetch(again).items()} == data
    finally:
        a.close()
        b.close()
        server.kill()


def test_a_secured_server_with_token_tls_and_fd_socket(secured) -> None:
    target = f"127.0.0.1:{secured['port']}"
    a, b = Engine(target=target, **secured["keys"]), Engine(target=target, **secured["keys"])
    no_token = {k: v for k, v in secured["keys"].items() if k != "token_file"}
    c = Engine(target=target, **no_token)
    try:
        keys = new_keys(3)
        data = a.offload(keys, seed=6)
        a.settle()
        assert a.tier.counters["stored_chunks"] == 3, a.tier.counters
        b.wait_index()
        assert {k: v for k, v in b.fetch(keys).items()} == data
        # Without the token every call is refused: misses and dropped stores, no error.
        c.offload(new_keys(2), seed=7)
        c.settle()
        assert c.tier.counters["stored_chunks"] == 0
        assert set(c.fetch(keys).values()) == {LookupResult.MISS}
        assert not c.tier.counters["hook_errors"]
    finally:
        for e in (a, b, c):
            e.close()


def test_an_mtls_server_by_certificate_and_by_token(mtls) -> None:
    """kvsvc with mTLS as well (``--tls-client-ca``): the tier's tls_cert/tls_key
    certificate names its tenant without a token, and a token works beside it; one
    engine stores, another loads bit-exact. No certificate, one from another CA, or a
    signed one the tenant file does not list (and no token): every call refused, so
    misses and dropped stores, never an error into vLLM."""
    target, keys, certs = f"127.0.0.1:{mtls['port']}", mtls["keys"], mtls["certs"]
    by_cert = {k: v for k, v in keys.items() if k != "token_file"}

    def cert(name: str) -> dict[str, str]:
        return {"tls_cert": f"{certs}/{name}.pem", "tls_key": f"{certs}/{name}.key"}

    no_cert = {k: v for k, v in keys.items() if k not in ("tls_cert", "tls_key")}
    a, b = Engine(target=target, **keys), Engine(target=target, **by_cert)
    refused = [
        Engine(target=target, **no_cert),  # token, but no certificate: no handshake
        Engine(target=target, **(keys | cert("forged"))),  # another CA's
        Engine(target=target, **(by_cert | cert("engine-b"))),  # signed, not listed
    ]
    try:
        data = a.offload(new_keys(3), seed=11)
        a.settle()
        assert a.tier.counters["stored_chunks"] == 3, a.tier.counters
        b.wait_index()
        assert {k: v for k, v in b.fetch(list(data)).items()} == data
        more = b.offload(new_keys(1), seed=12)  # the certificate alone stores too
        b.settle()
        assert b.tier.counters["stored_chunks"] == 1, b.tier.counters
        for e in refused:
            e.offload(new_keys(1), seed=13)
            e.settle(timeout=30)
            assert e.tier.counters["stored_chunks"] == 0, e.tier.counters
            got = e.fetch([*data, *more], timeout=30)
            assert set(got.values()) == {LookupResult.MISS}, e.tier.counters
            assert not e.tier.counters["hook_errors"]
    finally:
        for e in (a, b, *refused):
            e.close()


def test_take_events_reports_what_kvsvc_holds_stored_and_removed(tmp_path) -> None:
    """vLLM's KV events on: through vLLM's manager (``take_events``), KvsvcTier
    reports each chunk kvsvc stores in the namespace, by this engine or another
    (ownership: its tier type; locality: as configured), then its removal when kvsvc
    evicts it, and withdraws everything it reported once kvsvc is gone. With KV
    events off, it keeps none."""
    server = KvsvcProcess(free_port(), "", str(tmp_path), store_bytes="128K")  # 16 chunks
    a, b = (
        Engine(target=server.address, kv_events=True),
        Engine(target=server.address, kv_events=True, locality="LOCAL"),
    )
    off = Engine(target=server.address)
    stored: set[bytes] = set()
    removed: set[bytes] = set()

    def drain(until: Any, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while True:
            for ev in b.manager.take_events():
                if ev.ownership is None:
                    continue  # vLLM's own CPU tier
                assert ev.ownership == "KvsvcTier" and ev.medium is Medium.CPU, ev
                assert ev.locality is Locality.LOCAL and ev.removal_expected, ev
                keys = {bytes(k) for k in ev.keys}
                if ev.removed:
                    removed.update(keys)
                    stored.difference_update(keys)
                else:
                    stored.update(keys)
            if until():
                return
            assert time.monotonic() < end, (len(stored), len(removed), dict(b.tier.counters))
            time.sleep(0.05)

    try:
        first = {bytes(k) for k in a.offload(new_keys(4), seed=14)}
        a.settle()
        drain(lambda: first <= stored)  # stored by another engine: b reports them
        for seed in range(15, 18):  # 3 x 8 chunks more than kvsvc's 16 hold: LRU evicts
            a.offload(new_keys(8), seed=seed)
            a.settle()
        drain(lambda: first <= removed)
        assert not first & stored and stored  # what kvsvc still holds stays reported
        held = set(stored)
        server.kill()
        drain(lambda: held <= removed and not stored)  # withdrawn once kvsvc is gone
        assert off.tier.events is None and not list(off.tier.take_events())
        assert not b.tier.counters["hook_errors"]
        print(f"events: {dict(b.tier.counters)}")
    finally:
        for e in (a, b, off):
            e.close()
        server.kill()


def test_a_load_past_its_deadline_never_writes_vllms_rows(tmp_path) -> None:
    """kvsvc slow: every copy waits 3 s before its bytes move, and loads have 1 s.
    The load's outcome is unknown at its deadline, but kvsvc was only ever handed the
    tier's staging slots: the job is answered failed, vLLM's rows keep their bytes
    after the late copy has landed (in staging), and the staging slots come back once
    a Fence proves the copy ended; vLLM's calls return at once all along."""
    server = KvsvcProcess(free_port(), "transfer.before_copy=sleep(3000)", str(tmp_path))
    a = Engine(target=server.address, load_timeout_s=1.0)
    try:
        keys = new_keys(2)
        a.offload(keys, seed=8)
        a.settle(timeout=60)  # each Store waits its 3 s, within its 10 s
        assert a.tier.counters["stored_chunks"] == 2, a.tier.counters
        a.rows[30:32] = np.random.default_rng(9).integers(0, 256, a.rows[30:32].shape)
        before = a.rows[30:32].copy()
        job = TransferJob(9, keys, np.array([30, 31], np.int32), True, ReqContext("y"))
        t0 = time.monotonic()
        a.tier.submit_load(job)
        slowest = 0.0
        results: list = []
        while not results or a.tier.mover.held:
            assert time.monotonic() - t0 < 60, (results, a.tier.counters)
            c0 = time.perf_counter()
            results += list(a.tier.get_finished_jobs())
            a.tier.lookup(keys[0], ReqContext("y"))
            slowest = max(slowest, time.perf_counter() - c0)
            time.sleep(0.01)
        (r,) = results
        assert r.job_id == 9 and not r.success and not r.successful_keys
        time.sleep(3.5)  # past any copy the server could still have been running
        assert np.array_equal(a.rows[30:32], before)
        assert slowest < 0.5, f"a scheduler call took {slowest:.3f} s"
        print(f"unproven load: slots back after {time.monotonic() - t0:.2f} s; "
              f"slowest call {slowest * 1e3:.2f} ms")  # fmt: skip
    finally:
        a.close()
        server.kill()
