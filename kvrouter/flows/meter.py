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
_RESCALE = 64.0
"""Half-lives between two rescalings of the stored work (2^64 keeps it far from a float's range)."""


class WorkMeter:
    """Every meter decays by the same factor, so none is decayed: each charge is stored scaled up by
    2^(its time since ``_t0`` in half-lives), and a share is a ratio of stored values, which time does
    not change.  Charging and reading a flow cost O(1) whatever the number of tenants (a router has one
    per API key); the stored values are rescaled to ``_t0`` = now every ``_RESCALE`` half-lives, and the
    forgotten flows dropped then, or when the meter has doubled in size since the last drop."""

    def __init__(self, half_life_s: float) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.half_life_s = half_life_s
        self._work: dict[str, float] = {}
        """Per tenant, the sum of its charges, each x 2^((its time - ``_t0``) / ``half_life_s``)."""
        self._total = 0.0
        """The sum of ``_work`` (kept as charges come; summed afresh at each rescaling)."""
        self._t0: float | None = None
        self._at: float | None = None
        """The latest time seen: the clock never goes back (a charge dated before it counts at it)."""
        self._active: set[str] = set()
        """The tenants with a share of at least ``ACTIVE``, and some that fell below since: a share grows
        only with the tenant's own charge, so one is added then, and dropped when found below."""
        self._kept = 0
        """``_work``'s size after the last drop of forgotten flows."""
        self._light_at: float | None = None
        """When a request of a flow that was not heavy was last admitted (None: no admission yet)."""
        self._until: dict[str, float] = {}
        """Per tenant found heavy, until when it stays so (``hold_s``; an entry goes when it is read
        expired, and with the meter's own entry)."""

    def __len__(self) -> int:
        """The tenants metered now (the forgotten ones dropped, up to twice as many kept meanwhile)."""
        return len(self._work)

    def _scale(self, now: float) -> float:
        """A charge's scale at ``now`` (the clock advanced to it; rescaled first when due)."""
        at = self._at
        if at is None or now > at:
            self._at = at = now
        if self._t0 is None:
            self._t0 = at
        x = (at - self._t0) / self.half_life_s
        if x > _RESCALE:
            f = 0.5**x  # underflows to 0 after a long silence: every meter is forgotten then
            self._work = {t: w * f for t, w in self._work.items()}
            self._total = sum(self._work.values())
            self._t0, x = at, 0.0
            self._forget()
        return 2.0**x

    def _forget(self) -> None:
        floor = self._total * _FORGET
        for t in [t for t, w in self._work.items() if w < floor or not w]:
            del self._work[t]
            self._until.pop(t, None)
            self._active.discard(t)
        self._kept = len(self._work)

    def add(self, tenant: str, work: float, now: float, *, light: bool = False) -> None:
        """``tenant`` was charged ``work`` at ``now`` (never negative: a correction below 0 counts 0);
        ``light``: at a request's admission, its flow was not heavy."""
        scale = self._scale(now)
        if work > 0:
            w = self._work.get(tenant, 0.0) + work * scale
            self._work[tenant] = w
            self._total += work * scale
            if w >= ACTIVE * self._total:
                self._active.add(tenant)
            if len(self._work) > 2 * self._kept + 64:
                self._forget()
        if light or self._light_at is None:  # (the first admission starts the clock)
            self._light_at = now

    def light_idle(self, now: float, idle_s: float) -> bool:
        """No request of a flow that was not heavy has been admitted for ``idle_s`` (counted from the first
        admission if none has been; False before any: nothing is heavy then)."""
        return bool(idle_s) and self._light_at is not None and now - self._light_at > idle_s

    def share(self, tenant: str, now: float) -> float:
        """``tenant``'s share of the recent work (0 before any)."""
        self._scale(now)
        return self._work.get(tenant, 0.0) / self._total if self._total > 0 else 0.0

    def shares(self, now: float) -> dict[str, float]:
        """Each metered tenant's share of the recent work (empty before any; O(tenants): for reports)."""
        self._scale(now)
        total = self._total
        return {t: w / total for t, w in self._work.items()} if total > 0 else {}

    def lanes(
        self,
        iso: Isolation,
        flow: Flow,
        now: float,
        *,
        waiting: int,
        weight: Callable[[str], float] = lambda _: 1.0,
        dry_run: bool = False,
    ) -> tuple[bool, bool]:
        """(``RouteInput.heavy``, ``RouteInput.quiet_open``) for a request of ``flow`` now, ``waiting`` of
        its flow's requests waiting: the one reading the pipeline and the evaluator both set (both False
        with ``iso`` off).  ``dry_run`` (explain): the verdict only; no hold starts or ends."""
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
            dry_run=dry_run,
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
        dry_run: bool = False,
    ) -> bool:
        """Whether ``flow`` is heavy now (the module's rule); ``weight``: a tenant's share weight;
        ``waiting``: its requests waiting for capacity, heavy at ``backlog`` or more (0: never);
        ``hold_s``: a flow found heavy by its backlog or share stays heavy this long after (a flood's
        backlog drains for a moment between its requests); ``dry_run``: the verdict only, no hold starts
        or ends."""
        if flow.priority < quiet_priority:
            return True
        until = self._until.get(flow.tenant)
        if until is not None and now < until:
            return True
        if (backlog and waiting >= backlog) or self._over(flow.tenant, now, over_share, weight):
            if hold_s > 0 and not dry_run:
                self._until[flow.tenant] = now + hold_s
            return True
        if until is not None and not dry_run:
            del self._until[flow.tenant]
        return False

    def _over(self, tenant: str, now: float, over_share: float, weight: Callable[[str], float]) -> bool:
        mine = self.share(tenant, now)
        if not mine:
            return False
        floor = ACTIVE * self._total
        work, active = self._work, self._active
        for t in [t for t in active if work.get(t, 0.0) < floor]:
            active.discard(t)
        n = sum(weight(t) for t in active) + (0.0 if tenant in active else weight(tenant))
        return mine > over_share * weight(tenant) / n
