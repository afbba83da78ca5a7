"""round-robin: the targets in turn (sorted by key, one step on per routed request)."""

from __future__ import annotations

from typing import ClassVar

from .base import Candidate, PolicyConfig, PolicyContext, RouteView

ROUND_ROBIN = "round-robin"


class RoundRobinSettings(PolicyConfig, frozen=True):
    name: ClassVar[str] = ROUND_ROBIN

    def build(self, context: PolicyContext) -> RoundRobin:
        return RoundRobin()


class RoundRobin:
    name = ROUND_ROBIN

    def __init__(self) -> None:
        self._next = 0

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        if not cands:
            return []
        order = sorted(cands, key=lambda c: c.target)
        k = self._next % len(order)
        if not dry_run:
            self._next += 1
        out = order[k:] + order[:k]
        for i, c in enumerate(out):
            c.score = float(i)
        return out

    def reason(self, chosen: Candidate) -> str:
        return "load"
