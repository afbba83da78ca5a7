"""Quiet targets: part of a model's fleet kept for the flows within their share of the work.

An engine step is shared: a short prompt scheduled beside another tenant's long prefill waits for it, and
no queue in the router can prevent that once both run on one instance.  So a flow that takes more than its
share, has a backlog waiting, or whose priority is below ``quiet_priority``, is **heavy**, and heavy
requests never go to a **quiet** target; the other flows' requests go to a quiet target while one has
room, else anywhere::

    quiet targets = the ceil(quiet_share x n) of a model's n targets ranked first by a stable hash of
                    their keys (at least 1, at most n - 1; every router and worker picks the same ones)
    heavy request : the open targets that are not quiet (none open: it waits, as at capacity)
    other request : the open quiet targets, else every open target
    quiet_open    : (no request of a flow that is not heavy admitted for idle_s) every open target

The price is capacity: the quiet targets do not take heavy work even when it queues elsewhere
(docs/flows.md, "Quiet targets").  Whether a flow is heavy is the front door's reading of its recent work
(``flows.meter``), set on the request as ``RouteInput.heavy``.  Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
import math

import msgspec

from indexer.errors import ConfigError
from kvrouter.types import TargetKey

from .policies import Candidate


class Isolation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The fleet file's ``limits.isolation`` section."""

    quiet_share: float = 0.0
    """Share (0-1) of each model's targets kept quiet: heavy flows never go there (0: off)."""
    over_share: float = 1.5
    """A flow is heavy while its recent work exceeds this multiple of its fair share among the flows
    active now (its weight over theirs).  1.5: of two flows, the one doing over 3/4 of the work."""
    backlog: int = 2
    """A flow with this many requests waiting for capacity is heavy (it asks more than it gets; 0: never).
    The meter's share needs the flow's work to build up; a backlog says so at once."""
    hold_s: float = 2.0
    """A flow found heavy by its backlog or share stays heavy this long: a flood's backlog drains for a
    moment between its requests, and a request sent then would land on a quiet target."""
    idle_s: float = 2.0
    """Once no request of a flow that is not heavy has been admitted for this long, the quiet targets take
    every request: with no one to keep them quiet for, they do not idle beside a backlog (0: never)."""
    quiet_priority: int = 0
    """Flows of a lower priority are heavy whatever their share (the default: sheddable flows only).  Set
    above a tenant's priority, that tenant never uses a quiet target, even while nothing else runs."""
    half_life_s: float = 10.0
    """How fast a flow's recent work is forgotten."""

    def validate(self) -> None:
        if not 0.0 <= self.quiet_share < 1.0:
            raise ConfigError("limits.isolation.quiet_share must be in [0, 1)")
        if min(self.backlog, self.hold_s, self.idle_s) < 0 or self.over_share < 1.0 or self.half_life_s <= 0:
            raise ConfigError(
                "limits.isolation: over_share must be >= 1, half_life_s > 0, backlog, hold_s, idle_s >= 0"
            )

    @property
    def on(self) -> bool:
        return self.quiet_share > 0


def _rank(key: TargetKey) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


class QuietTargets:
    """Which of a model's targets are quiet, remembered per set of targets (a fleet changes rarely)."""

    def __init__(self, config: Isolation) -> None:
        self.config = config
        self._memo: dict[frozenset[TargetKey], frozenset[TargetKey]] = {}

    def of(self, keys: frozenset[TargetKey]) -> frozenset[TargetKey]:
        """The quiet ones among ``keys``: none for fewer than two targets."""
        got = self._memo.get(keys)
        if got is not None:
            return got
        n = len(keys)
        q = min(n - 1, max(1, math.ceil(self.config.quiet_share * n - 1e-9))) if n > 1 else 0
        got = frozenset(sorted(keys, key=_rank)[:q])
        if len(self._memo) > 64:  # fleets in flux: keep the memo bounded
            self._memo.clear()
        self._memo[keys] = got
        return got

    def lane(self, open_: list[Candidate], cands: list[Candidate], heavy: bool) -> list[Candidate]:
        """The open candidates a request may take (see the module's rule).  Quiet is decided over every
        candidate, not only the open ones, so a target's lane does not change with its load."""
        if not self.config.on or len(cands) < 2:
            return open_
        quiet = self.of(frozenset(c.target for c in cands))
        if heavy:
            return [c for c in open_ if c.target not in quiet]
        return [c for c in open_ if c.target in quiet] or open_
