"""least-loaded: the fewest requests in flight per unit of weight; equal loads broken at random (seeded),
so an idle fleet spreads instead of piling on its first target."""

from __future__ import annotations

import random
from typing import ClassVar

from .base import Candidate, PolicyConfig, PolicyContext, RouteView

LEAST_LOADED = "least-loaded"


class LeastLoadedSettings(PolicyConfig, frozen=True):
    name: ClassVar[str] = LEAST_LOADED

    def build(self, context: PolicyContext) -> LeastLoaded:
        return LeastLoaded(random.Random(context.settings.seed))


class LeastLoaded:
    name = LEAST_LOADED

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(0)

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        for c in cands:
            c.score = c.load
        salt = {c.target: (self.rng.random() if not dry_run else 0.0) for c in cands}
        return sorted(cands, key=lambda c: (c.score, salt[c.target], c.target))

    def reason(self, chosen: Candidate) -> str:
        return "load"
