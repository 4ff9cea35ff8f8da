"""Which run of Redis the keys announced on the events stream live in.

A Redis without persistence comes back empty after a restart, and redis-py
reconnects by itself, so no call fails that would tell the tier: the events
stream would keep vouching for keys Redis no longer holds, and every presence
index would over-claim them for good. So the tier asks Redis for its run id
(INFO server's ``run_id``, new at every start) every REMOTE_RUN_CHECK_S, on a
Lookup link, within --remote-timeout. A new run id, or a Redis that does not
answer, withdraws every announced key (removed, TIER_DROPPED): an index then
under-claims until the keys are seen again, which costs a recompute, never a
wrong hit. A Lookup that finds an announced key absent withdraws that key.
Standalone Redis only: each node of a cluster has its own run, and a cluster's
keys are withdrawn only by the misses Lookup and Retrieve see."""

from __future__ import annotations

import asyncio
import sys

from kvsvc.server.config import REMOTE_RUN_CHECK_S
from kvsvc.server.tiers.redis.health import log
from kvsvc.server.tiers.redis.links import checked
from kvsvc.server.tiers.redis.lookup import Lookups
from kvsvc.v1 import kv_cache_service_pb2 as pb

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # redis-py depends on async-timeout below 3.11.3
    from async_timeout import timeout as _deadline


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
            if run is not None and run == self.run_id:
                continue
            if self.events is not None and self.events.remote:
                why = "does not answer" if run is None else "restarted (a new run id)"
                log.info("remote tier: Redis %s; its announced keys are withdrawn", why)
                self.events.withdraw(pb.TIER_REDIS)
            self.run_id = run

    async def _ask_run(self) -> str | None:
        """INFO server's run id, or None: refused, failed or past --remote-timeout."""
        if self._refused():
            return None
        try:
            async with _deadline(self.timeout):
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
