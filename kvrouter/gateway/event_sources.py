"""Finding an instance's KV-event publishers when the fleet file (or Kubernetes) gives only its URL.

::

    instance with url, no events ──GET /kv_event_sources──▶ with_event_sources ──▶ FleetMembership.rewire
        (retried with backoff while it does not answer)        (subscribe on the instance's host, each rank)
    instance back in rotation ──▶ asked again (a restart may have moved its publishers)

Until its events are known the instance is routed by load (no cache credit), as any instance without
events.  In bind mode (the router binds, instances connect) there is nothing to find.  An instance whose
vLLM connects its PUB out (its endpoint names a host) gets a SUB bound at that address when the address is
this host's (``event_mode.settle_mode``); otherwise it is refused, loudly, with the fix in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

import aiohttp
import zmq.asyncio

from indexer.config import InstanceConfig

from ..membership.errors import EventSourcesError
from ..membership.event_sources import with_event_sources
from .event_mode import settle_mode
from .fleet_membership import FleetMembership

log = logging.getLogger("kvrouter.gateway.event_sources")


class EventSourceResolver:
    def __init__(
        self,
        membership: FleetMembership,
        *,
        enabled: bool = True,
        timeout_s: float = 2.0,
        retry_s: float = 0.5,
        retry_max_s: float = 10.0,
    ) -> None:
        self.membership = membership
        self.enabled = enabled
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.session: aiohttp.ClientSession | None = None
        self.counters: Counter[str] = Counter()
        """resolved, and failures by reason."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.refused: dict[str, str] = {}
        """Instances that publish events this router cannot receive, with why and the fix (for /health)."""
        self._ctx: zmq.asyncio.Context | None = None

    @staticmethod
    def wanted(inst: InstanceConfig) -> bool:
        """An instance whose events must be asked for: it has a URL and the file gives no endpoint."""
        return inst.url is not None and inst.events is None

    async def start(self, session: aiohttp.ClientSession, instances: list[InstanceConfig]) -> None:
        self.session = session
        for inst in instances:
            self.watch(inst)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def watch(self, inst: InstanceConfig) -> None:
        """Ask ``inst`` for its publishers (again), in the background, until it answers."""
        if not self.enabled or self.session is None or not self.wanted(inst):
            return
        old = self._tasks.pop(inst.name, None)
        if old is not None:
            old.cancel()
        self._tasks[inst.name] = asyncio.create_task(self._resolve(inst), name=f"kv-sources-{inst.name}")

    async def settled(self, timeout_s: float) -> None:
        """Until the questions asked so far are answered (or ``timeout_s``): the start-up check then sees
        the publishers as the subscriber does."""
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    def forget(self, name: str) -> None:
        t = self._tasks.pop(name, None)
        if t is not None:
            t.cancel()

    async def _resolve(self, inst: InstanceConfig) -> None:
        delay = self.retry_s
        while True:
            try:
                resolved = await self._settled(with_event_sources(inst, await self._ask(inst)))
            except EventSourcesError as e:
                self.counters[e.reason] += 1
                if e.reason != "unreachable":
                    # The instance answered: it publishes nothing usable here.  It stays routed by load.
                    level = logging.ERROR if e.reason in ("elsewhere", "taken") else logging.WARNING
                    log.log(
                        level, "no KV events from instance", extra={"instance": inst.name, "reason": str(e)}
                    )
                    self.refused[inst.name] = str(e)
                    self._tasks.pop(inst.name, None)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            self.counters["resolved"] += 1
            self.refused.pop(inst.name, None)
            self._tasks.pop(inst.name, None)
            await self.membership.rewire(resolved)
            log.info(
                "kv events found",
                extra={
                    "instance": inst.name,
                    "events": resolved.events,
                    "mode": resolved.events_mode,
                    "dp_size": resolved.dp_size,
                },
            )
            return

    async def _settled(self, resolved: InstanceConfig) -> InstanceConfig:
        """``resolved`` with a mode this router can carry out.  A bind this router already holds for the
        same address is kept as it is (probing it would find our own SUB)."""
        prev = self.membership.found(resolved.name)
        if prev is not None and (prev.events, prev.events_mode, prev.dp_size) == (
            resolved.events,
            resolved.events_mode,
            resolved.dp_size,
        ):
            return prev
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return await settle_mode(resolved, self._ctx)

    async def _ask(self, inst: InstanceConfig) -> bytes:
        assert self.session is not None and inst.url is not None
        try:
            async with self.session.get(
                inst.url.rstrip("/") + "/kv_event_sources",
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as r:
                if r.status == 404:
                    raise EventSourcesError("invalid", "no /kv_event_sources (vLLM before 0.33?)")
                if r.status != 200:
                    raise EventSourcesError("unreachable", f"HTTP {r.status}")
                return await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EventSourcesError("unreachable", repr(e)) from None
