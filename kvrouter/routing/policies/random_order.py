"""random: the targets in a uniformly random order (seeded)."""

from __future__ import annotations

import random
from typing import ClassVar

from .base import Candidate, PolicyConfig, PolicyContext, RouteView

RANDOM = "random"


class RandomSettings(PolicyConfig, frozen=True):
    name: ClassVar[str] = RANDOM

    def build(self, context: PolicyContext) -> Random:
        return Random(random.Random(context.settings.seed))


class Random:
    name = RANDOM

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(0)
        self._dry = 0

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        out = sorted(cands, key=lambda c: c.target)
        if dry_run:
            # A uniform-enough shuffle that leaves the real generator's sequence untouched.
            self._dry += 1
            salt = self._dry
            out.sort(key=lambda c: hash((c.target, salt)))
        else:
            self.rng.shuffle(out)
        for i, c in enumerate(out):
            c.score = float(i)
        return out

    def reason(self, chosen: Candidate) -> str:
        return "load"
