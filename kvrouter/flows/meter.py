"""Each flow's recent work, and whether it is heavy: more than its share, or below the quiet priority.

The work a flow is charged at admission (``request_cost``'s ``work``: uncached prompt tokens plus decode)
is added to its meter, and every meter decays by half each ``half_life_s``.  A flow is heavy when::

    priority < quiet_priority
    or  requests of the flow waiting for capacity  >=  backlog
    or  work(flow) / work(all)  >  over_share x weight(flow) / sum of weight(f) over the active flows f
    or  either of the two held within the last hold_s

A flow is active while its work is at least ``ACTIVE`` of the total.  A lone flow is never heavy by
share (its fair share is all of it).  Each process meters its own admissions: with requests spread
evenly over a router's workers and replicas, each sees the fleet's shares (docs/flows.md, "Quiet
targets").  Pure: the caller passes the time.
"""

from __future__ import annotations

from collections.abc import Callable

from ..routing.isolation import Isolation
from .scheduler import Flow

ACTIVE = 0.01
"""A flow whose recent work is below this share of the total does not count among the active ones."""
_FORGET = 1e-6
"""Below this share of the total a flow's meter is dropped (the meter's memory stays bounded)."""


class WorkMeter:
    def __init__(self, half_life_s: float) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.half_life_s = half_life_s
        self._work: dict[str, float] = {}
        """Per tenant, its decayed work as of ``_at`` (one clock for all: decaying is one multiply)."""
        self._at: float | None = None
        self._light_at: float | None = None
        """When a request of a flow that was not heavy was last admitted (None: no admission yet)."""
        self._until: dict[str, float] = {}
        """Per tenant found heavy, until when it stays so (``hold_s``; an entry goes when it is read
        expired, and with the meter's own entry)."""

    def _decay(self, now: float) -> None:
        at = self._at
        self._at = now if at is None or now > at else at
        if at is None or now <= at:
            return
        f = 0.5 ** ((now - at) / self.half_life_s)
        total = 0.0
        for t, w in self._work.items():
            self._work[t] = w * f
            total += w * f
        floor = total * _FORGET
        for t in [t for t, w in self._work.items() if w < floor]:
            del self._work[t]
            self._until.pop(t, None)

    def add(self, tenant: str, work: float, now: float, *, light: bool = False) -> None:
        """``tenant`` was charged ``work`` at ``now`` (never negative: a correction below 0 counts 0);
        ``light``: at a request's admission, its flow was not heavy."""
        self._decay(now)
        if work > 0:
            self._work[tenant] = self._work.get(tenant, 0.0) + work
        if light or self._light_at is None:  # (the first admission starts the clock)
            self._light_at = now

    def light_idle(self, now: float, idle_s: float) -> bool:
        """No request of a flow that was not heavy has been admitted for ``idle_s`` (counted from the first
        admission if none has been; False before any: nothing is heavy then)."""
        return bool(idle_s) and self._light_at is not None and now - self._light_at > idle_s

    def shares(self, now: float) -> dict[str, float]:
        """Each metered tenant's share of the recent work (empty before any)."""
        self._decay(now)
        total = sum(self._work.values())
        return {t: w / total for t, w in self._work.items()} if total > 0 else {}

    def lanes(
        self,
        iso: Isolation,
        flow: Flow,
        now: float,
        *,
        waiting: int,
        weight: Callable[[str], float] = lambda _: 1.0,
    ) -> tuple[bool, bool]:
        """(``RouteInput.heavy``, ``RouteInput.quiet_open``) for a request of ``flow`` now, ``waiting`` of
        its flow's requests waiting: the one reading the pipeline and the evaluator both set (both False
        with ``iso`` off)."""
        if not iso.on:
            return False, False
        heavy = self.heavy(
            flow,
            now,
            over_share=iso.over_share,
            quiet_priority=iso.quiet_priority,
            weight=weight,
            waiting=waiting,
            backlog=iso.backlog,
            hold_s=iso.hold_s,
        )
        return heavy, self.light_idle(now, iso.idle_s)

    def heavy(
        self,
        flow: Flow,
        now: float,
        *,
        over_share: float,
        quiet_priority: int,
        weight: Callable[[str], float] = lambda _: 1.0,
        waiting: int = 0,
        backlog: int = 0,
        hold_s: float = 0.0,
    ) -> bool:
        """Whether ``flow`` is heavy now (the module's rule); ``weight``: a tenant's share weight;
        ``waiting``: its requests waiting for capacity, heavy at ``backlog`` or more (0: never);
        ``hold_s``: a flow found heavy by its backlog or share stays heavy this long after (a flood's
        backlog drains for a moment between its requests)."""
        if flow.priority < quiet_priority:
            return True
        until = self._until.get(flow.tenant)
        if until is not None and now < until:
            return True
        if (backlog and waiting >= backlog) or self._over(flow.tenant, now, over_share, weight):
            if hold_s > 0:
                self._until[flow.tenant] = now + hold_s
            return True
        if until is not None:
            del self._until[flow.tenant]
        return False

    def _over(self, tenant: str, now: float, over_share: float, weight: Callable[[str], float]) -> bool:
        shares = self.shares(now)
        mine = shares.get(tenant, 0.0)
        if not mine:
            return False
        active = sum(weight(t) for t, s in shares.items() if s >= ACTIVE or t == tenant)
        return mine > over_share * weight(tenant) / active
