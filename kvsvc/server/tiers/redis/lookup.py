"""Lookup's question to Redis: one pipelined EXISTS round trip within the call's
budget, on the server's event loop (redis.asyncio; a hop to a thread and back
cost more than the round trip itself, docs/benchmarks.md section 7). Values are
not verified here: Retrieve verifies what it fetches."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis.asyncio as aredis
import redis.exceptions as rx

from kvsvc.server.config import ServerConfig
from kvsvc.server.data.store import ChunkStore
from kvsvc.server.tiers.redis.connection import Connections
from kvsvc.server.tiers.redis.health import CONNECTION, TIMEOUT, Skipped, consume, error_kind, log
from kvsvc.server.tiers.redis.links import Link, checked
from kvsvc.server.tiers.redis.values import redis_keys
from kvsvc.v1 import kv_cache_service_pb2 as pb


class Lookups(Connections):
    """EXISTS on links the tier keeps (standalone Redis), or in a task through
    redis.asyncio (a new link, Redis Cluster)."""

    def __init__(
        self, config: ServerConfig, store: ChunkStore, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(config, store, loop)
        self._links: list[Link] = []  # Lookup's idle connections (standalone Redis)
        self._asking = 0  # asyncio exchanges in flight

    async def present(self, namespace: str, layout: str, keys: list[bytes]) -> list[bool]:
        """Whether Redis holds each of ``keys`` (Lookup; values are verified when
        Retrieve fetches them); [] when it cannot say within the budget. One
        pipelined EXISTS round trip, on the loop."""
        rkeys = redis_keys(self.prefix, namespace, layout, keys)
        found = await self._ask(rkeys, self.lookup_budget)
        if found is None:
            return []
        present = [bool(f) for f in found]
        if self.events is not None and self.events.remote and not all(present):
            gone = [k for k, f in zip(keys, present, strict=True) if not f]
            self.events.removed(
                namespace, gone, layout, pb.REMOVAL_REASON_TIER_DROPPED, pb.TIER_REDIS
            )
        return present

    async def _close_lookups(self) -> None:
        """The loop's connections (Lookup's), within --remote-timeout."""
        client, self._aclient = self._aclient, None
        links, self._links = self._links, []
        for link in links:
            link.close()
        if client is not None:
            try:
                await asyncio.wait_for(client.aclose(), self.timeout)
            except Exception as exc:  # noqa: BLE001 - closing: the sockets go anyway
                log.debug("remote tier: closing the asyncio client: %s", exc)

    async def _ask(self, rkeys: list[bytes], budget: float) -> list[int] | None:
        """EXISTS of each key, or None: skipped, failed or over budget. The exchange
        is bounded by --remote-timeout; past the budget the caller goes on and the
        exchange ends by itself (its outcome still feeds the breaker), so a
        cut-off read never leaves a connection mid-reply. On an idle link
        (standalone Redis) it is a write and a callback (``_exchange``); otherwise
        (connecting, Redis Cluster) a task."""
        if self._turned_away(self._asking):
            return None
        link = self._idle_link()
        if link is not None:
            if self._refused():
                self._links.append(link)
                return None
            return await self._exchange(link, rkeys, budget)
        self._asking += 1
        task = self.loop.create_task(self._acall(rkeys))
        # A bare future woken by the task or the budget's timer: what wait_for does,
        # without shield's and timeout's extra futures and cancellation (about 20 µs
        # of a 0.3 ms exchange on the benchmark host).
        woken = self.loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        task.add_done_callback(self._done_asking)
        task.add_done_callback(wake)
        timer = self.loop.call_later(max(budget, 0.0), wake)
        try:
            await woken
        finally:  # also when the call is cancelled: the task ends by itself
            timer.cancel()
            if not task.done():
                task.add_done_callback(consume)
        if not task.done():
            self._count(self.errors, "budget")
            return None
        if task.cancelled() or task.exception() is not None:  # Skipped: counted
            return None
        return task.result()

    def _done_asking(self, _task: asyncio.Task[list[int]]) -> None:
        self._asking -= 1

    def _idle_link(self) -> Link | None:
        while self._links:
            link = self._links.pop()
            if not link.closed:
                return link
        return None

    async def _exchange(self, link: Link, rkeys: list[bytes], budget: float) -> list[int] | None:
        """One EXISTS round trip on an idle link, in the caller's task: one future and
        one timer (the budget's, then the rest of --remote-timeout's); the link's
        callback ends it, whether or not the caller still waits."""
        loop = self.loop
        self._asking += 1
        waiter: asyncio.Future[list[int] | None] = loop.create_future()
        start = loop.time()
        timer: asyncio.TimerHandle | None = None

        def end(outcome: list[Any] | BaseException) -> None:
            if timer is not None:
                timer.cancel()
            self._asking -= 1
            found: list[int] | None = None
            try:
                found = checked(outcome)
            except Exception as exc:  # noqa: BLE001 - a Redis failure is a miss, counted
                link.close()
                self._failed(exc)
            else:
                self.breaker.success()
                self._links.append(link)
            if not waiter.done():
                waiter.set_result(found)

        def over() -> None:
            link.fail(rx.TimeoutError(f"Timeout reading from {self.where}"))

        def late() -> None:
            nonlocal timer
            timer = loop.call_at(start + self.timeout, over)
            if not waiter.done():
                self._count(self.errors, "budget")
                waiter.set_result(None)

        if budget < self.timeout:
            timer = loop.call_at(start + max(budget, 0.0), late)
        else:
            timer = loop.call_at(start + self.timeout, over)
        link.send([("EXISTS", k) for k in rkeys], end)
        return await waiter  # cancelled: the exchange ends by itself

    async def _link(self) -> Link:
        """A new link, connected and authenticated as redis-py would (its reading of
        the URL and TLS settings; AUTH, SELECT); the caller bounds it."""
        conn = self._aredis().connection_pool.make_connection()
        ssl_context = conn.ssl_context.get() if isinstance(conn, aredis.SSLConnection) else None
        link = Link()
        await self.loop.create_connection(
            lambda: link,
            conn.host,
            conn.port,
            ssl=ssl_context,
            server_hostname=conn.host if ssl_context is not None else None,
        )
        hello: list[tuple[Any, ...]] = []
        if conn.password:
            auth = (conn.username, conn.password) if conn.username else (conn.password,)
            hello.append(("AUTH", *auth))
        if conn.db:
            hello.append(("SELECT", conn.db))
        try:
            if hello:
                checked(await link.roundtrip(hello))
        except BaseException:
            link.close()
            raise
        return link

    async def _acall(self, rkeys: list[bytes]) -> list[int]:
        """The asyncio twin of _call for EXISTS: the breaker, one deadline of
        --remote-timeout for connect, send and reply together; raises only Skipped."""
        refused = self._refused()
        if refused:
            raise Skipped(refused)
        try:
            async with asyncio.timeout(self.timeout):
                found = await self._exists(self._aredis(), rkeys)
        except Exception as exc:  # a Redis failure is a miss, counted
            self._failed(exc)
            if self.cluster and error_kind(exc) in (CONNECTION, TIMEOUT):
                stale, self._aclient = self._aclient, None  # maybe a stale slot table
                if stale is not None:
                    with contextlib.suppress(Exception):
                        await stale.aclose()
            raise Skipped(error_kind(exc)) from exc
        self.breaker.success()
        return found

    async def _exists(self, r: Any, rkeys: list[bytes]) -> list[int]:
        """One pipelined EXISTS round trip (in a task, bounded by its caller).
        Standalone: on a link (a new one when none is idle), kept once it answered;
        a failed or cut-off one is closed, never reused mid-reply."""
        if self.cluster:  # keys on every shard: redis-py groups them by node
            pipe = r.pipeline(transaction=False)
            for k in rkeys:
                pipe.exists(k)
            return list(await pipe.execute())
        link = self._idle_link() or await self._link()
        try:
            found = checked(await link.roundtrip([("EXISTS", k) for k in rkeys]))
        except BaseException:
            link.close()
            raise
        self._links.append(link)
        return found
