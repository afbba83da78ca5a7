"""The reconciler: brings what is applied to what is desired, one worker per instance name.

``set_desired(source, instances)`` merges the sources and starts a worker for each name that differs;
a worker steps until ``applied[name] == desired[name]``: absent -> wanted is an add, a routing-only
change an in-place update, any other change or a departure a drain (wait for in-flight 0 or
``drain_timeout_s``) then a remove; a name wanted back unchanged while draining is undrained.

Level-triggered: a worker re-reads ``desired`` after every step, so a change that lands during a slow step
is picked up when the step ends, and no intermediate state needs applying.  Invariants: one worker per
name at a time, so a name's steps never interleave; ``applied`` names exactly what the ``Membership``
holds; ``set_desired`` never awaits, so the end check of a worker and its removal from ``_workers``
happen with no ``set_desired`` in between (no update is ever lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Iterable

from indexer.config import InstanceConfig

from .model import Membership, MembershipDiff, by_name, diff, merge_sources, routing_only

log = logging.getLogger("kvrouter.membership")


class Reconciler:
    def __init__(
        self,
        membership: Membership,
        *,
        initial: Iterable[InstanceConfig] = (),
        initial_source: str = "fleet",
        drain_timeout_s: float = 30.0,
        poll_s: float = 0.05,
        retry_s: float = 1.0,
    ) -> None:
        """``initial`` is what the membership already holds (the fleet file read at startup), claimed by
        ``initial_source``."""
        self.membership = membership
        self.drain_timeout_s = drain_timeout_s
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.applied: dict[str, InstanceConfig] = by_name(initial)
        self._sources: dict[str, dict[str, InstanceConfig]] = {initial_source: dict(self.applied)}
        self.desired: dict[str, InstanceConfig] = dict(self.applied)
        self.draining: set[str] = set()
        self.counters: Counter[str] = Counter()
        """added, updated, removed, undrained, drain_timeouts, source_conflicts, errors_<op>_<ExcType>."""
        self._workers: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ desired state
    def set_desired(self, source: str, instances: Iterable[InstanceConfig]) -> MembershipDiff:
        """Replace what ``source`` wants; returns the change of the merged desired set.  Never awaits."""
        self._sources[source] = by_name(instances)
        new, conflicts = merge_sources(self._sources)
        for name in conflicts:
            self.counters["source_conflicts"] += 1
            log.warning("instance claimed by two sources; the first wins", extra={"instance": name})
        d = diff(self.desired, new)
        self.desired = new
        if d:
            log.info("membership changed", extra=d.summary())
        for name in self.desired.keys() | self.applied.keys():
            if self.desired.get(name) != self.applied.get(name) and name not in self._workers:
                self._workers[name] = asyncio.create_task(self._converge(name), name=f"membership-{name}")
        return d

    def busy(self) -> bool:
        return bool(self._workers)

    async def settle(self) -> None:
        """Wait until every worker has finished (applied == desired, unless a step keeps failing)."""
        while self._workers:
            await asyncio.gather(*self._workers.values(), return_exceptions=True)

    async def stop(self) -> None:
        workers = list(self._workers.values())
        for t in workers:
            t.cancel()
        for t in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._workers.clear()

    # ------------------------------------------------------------------ one name
    async def _converge(self, name: str) -> None:
        try:
            while True:
                want, have = self.desired.get(name), self.applied.get(name)
                if want == have:
                    return
                op = "add" if have is None else "update" if want and routing_only(have, want) else "remove"
                try:
                    await self._step(name, op, want, have)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the membership's failure: counted, logged, retried
                    self.counters[f"errors_{op}_{type(e).__name__}"] += 1
                    log.exception("membership step failed; retrying", extra={"instance": name, "op": op})
                    await asyncio.sleep(self.retry_s)
        finally:
            if self._workers.get(name) is asyncio.current_task():
                del self._workers[name]

    async def _step(
        self, name: str, op: str, want: InstanceConfig | None, have: InstanceConfig | None
    ) -> None:
        m = self.membership
        if op == "add":
            assert want is not None
            await m.add(want)
            self.applied[name] = want
            self.counters["added"] += 1
        elif op == "update":
            assert want is not None
            m.update(want)
            self.applied[name] = want
            self.counters["updated"] += 1
        else:
            assert have is not None
            if await self._drain(name, have):
                await m.remove(name)
                del self.applied[name]
                self.counters["removed"] += 1

    async def _drain(self, name: str, have: InstanceConfig) -> bool:
        """Drain ``name``; False if it became wanted again, unchanged, before its drain ended."""
        m = self.membership
        m.drain(name)
        self.draining.add(name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        try:
            while True:
                if self.desired.get(name) == have:
                    m.undrain(name)
                    self.counters["undrained"] += 1
                    return False
                left = m.in_flight(name)
                if left == 0:
                    return True
                if loop.time() >= deadline:
                    self.counters["drain_timeouts"] += 1
                    log.warning("drain timed out", extra={"instance": name, "in_flight": left})
                    return True
                await asyncio.sleep(self.poll_s)
        finally:
            self.draining.discard(name)
