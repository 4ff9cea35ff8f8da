"""Which run of Redis the keys announced on the events stream live in.

A Redis without persistence comes back empty after a restart, and redis-py
reconnects by itself, so no call fails that would tell the tier: the events
stream would keep vouching for keys Redis no longer holds, and every presence
index would over-claim them for good. So the tier asks Redis for its run id
(INFO server's ``run_id``, new at every start) every REMOTE_RUN_CHECK_S, on a
Lookup link, within --remote-timeout. After a new run id, the announced keys the
new run does not hold are withdrawn (removed, TIER_DROPPED; an EXISTS sweep, so
what was written to the new run stays announced). A Redis that does not answer
(the breaker opened: failures in a row, not one slow reply) withdraws them all:
an index then under-claims until the keys are seen again, which costs a
recompute, never a wrong hit. Writes and fetches that cross a change of run are
announced only once an EXISTS shows the run now serving holds them. A Lookup
that finds an announced key absent withdraws that key.
Standalone Redis only: each node of a cluster has its own run, and a cluster's
keys are withdrawn only by the misses Lookup and Retrieve see."""

from __future__ import annotations

import asyncio

from kvsvc.server.config import REMOTE_RUN_CHECK_S
from kvsvc.server.tiers.breaker import OPEN
from kvsvc.server.tiers.redis.connection import UNCONFIRMED_MAX
from kvsvc.server.tiers.redis.health import log
from kvsvc.server.tiers.redis.links import checked
from kvsvc.server.tiers.redis.lookup import Lookups
from kvsvc.server.tiers.redis.values import redis_key
from kvsvc.v1 import kv_cache_service_pb2 as pb

#: Keys asked per EXISTS round trip when a restarted Redis' keys are rechecked.
RUN_RECHECK_KEYS = 1024


def parse_run_id(info: bytes | str) -> str | None:
    """The ``run_id`` line of an INFO reply."""
    text = info.decode("latin-1") if isinstance(info, bytes) else info
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line[len("run_id:") :].strip() or None
    return None


class Runs(Lookups):
    """The run id the announced keys were seen in, checked on the loop."""

    run_id: str | None = None
    _run_checks: asyncio.Task[None] | None = None

    def _start_run_checks(self) -> None:
        if not self.cluster and self._run_checks is None:
            self._run_checks = self.loop.create_task(self._check_runs())

    def _stop_run_checks(self) -> None:
        """Cancelled on the loop; from another thread it ends at its next wake (_closed)."""
        task, self._run_checks = self._run_checks, None
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if task is not None and on_loop:
            task.cancel()

    async def _check_runs(self) -> None:
        """Until the tier closes (or the task is cancelled)."""
        while not self._closed:
            await asyncio.sleep(REMOTE_RUN_CHECK_S)
            run = await self._ask_run()
            if run is None and self.breaker.state != OPEN:
                continue  # one failed ask (a loaded host's timeout) is not an outage
            if run is not None and run == self.run_id:
                if self.unconfirmed:
                    await self._confirm()
                continue
            self.run_epoch += 1  # writes in flight now are announced after a recheck
            if self.events is not None and self.events.remote:
                if run is None:
                    log.info("remote tier: Redis does not answer; its announced keys are withdrawn")
                    self.events.withdraw(pb.TIER_REDIS)
                elif self.run_id is not None:
                    log.info("remote tier: Redis restarted (a new run id); rechecking its keys")
                    # A write that lands during the sweep may be withdrawn by it: its
                    # announcement waits for the next check's EXISTS instead.
                    self.rechecking = True
                    try:
                        await self._recheck()
                    finally:
                        self.rechecking = False
            self.run_id = run

    async def _confirm(self) -> None:
        """Announce the writes sent across a change of run that this run holds."""
        assert self.events is not None
        todo, self.unconfirmed = self.unconfirmed, []
        epoch = self.run_epoch
        for start in range(0, len(todo), RUN_RECHECK_KEYS):
            part = todo[start : start + RUN_RECHECK_KEYS]
            rkeys = [redis_key(self.prefix, ns, layout, key) for ns, key, layout, _ in part]
            found = await self._ask(rkeys, self.timeout)
            if found is None or self.doubted(epoch):  # in doubt again: at a later check
                self.unconfirmed += todo[start : start + UNCONFIRMED_MAX - len(self.unconfirmed)]
                return
            for (ns, key, layout, size), there in zip(part, found, strict=True):
                if there:
                    self.events.stored(ns, (key,), layout, size, pb.TIER_REDIS)

    async def _recheck(self) -> None:
        """After a restart: withdraw the announced keys the new run does not hold (what
        was written to it since it started stays announced), all of them if it stops
        answering. One pipelined EXISTS per RUN_RECHECK_KEYS keys."""
        assert self.events is not None
        keys = list(self.events.remote)
        for start in range(0, len(keys), RUN_RECHECK_KEYS):
            part = keys[start : start + RUN_RECHECK_KEYS]
            rkeys = [redis_key(self.prefix, ns, layout, key) for ns, key, layout in part]
            found = await self._ask(rkeys, self.timeout)
            if found is None:
                self.events.withdraw(pb.TIER_REDIS)
                return
            for (ns, key, layout), there in zip(part, found, strict=True):
                if not there:
                    self.events.removed(
                        ns, (key,), layout, pb.REMOVAL_REASON_TIER_DROPPED, pb.TIER_REDIS
                    )

    async def _ask_run(self) -> str | None:
        """INFO server's run id, or None: refused, failed or past --remote-timeout."""
        if self._refused():
            return None
        try:
            async with asyncio.timeout(self.timeout):
                link = self._idle_link() or await self._link()
                try:
                    reply = checked(await link.roundtrip([("INFO", "server")]))
                except BaseException:
                    link.close()
                    raise
        except Exception as exc:  # noqa: BLE001 - a Redis failure: counted, fed to the breaker
            self._failed(exc)
            return None
        self._links.append(link)
        self.breaker.success()
        return parse_run_id(reply[0])
