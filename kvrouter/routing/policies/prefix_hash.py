"""prefix-hash: consistent hashing with bounded load over the first ``prefix_length`` characters of the
request (plus its affinity id), SageMaker's PREFIX_AWARE style.  Reads no index."""

from __future__ import annotations

from typing import ClassVar

from ...types import TargetKey
from ..hashring import HashRing
from .base import Candidate, PolicyConfig, PolicyContext, RouteView

PREFIX_HASH = "prefix-hash"


class PrefixHashSettings(PolicyConfig, frozen=True):
    name: ClassVar[str] = PREFIX_HASH

    prefix_length: int = 1024
    """Characters (chat message text) or bytes (raw body) hashed for affinity (SageMaker: 1024..65536)."""
    load_bound: float = 1.25
    """Bounded-load factor: a target takes a key only below bound x (mean load + 1)."""
    vnodes: int = 160

    def validate(self) -> None:
        if self.prefix_length <= 0:
            raise ValueError("prefix_length must be positive")

    def build(self, context: PolicyContext) -> PrefixHash:
        return PrefixHash(self)


class PrefixHash:
    name = PREFIX_HASH

    def __init__(self, settings: PrefixHashSettings | None = None) -> None:
        self.settings = settings or PrefixHashSettings()
        self.ring = HashRing(vnodes=self.settings.vnodes)

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        by_target = {c.target: c for c in cands}
        for t in set(by_target) - set(self.ring.members):
            self.ring.add(t)
        self.ring.prune(by_target)

        def load(t: TargetKey) -> float:
            return by_target[t].load

        walk = self.ring.walk(req.prefix_key)
        first = self.ring.choose(
            req.prefix_key,
            load,
            bound=self.settings.load_bound,
            eligible=lambda t: t in by_target,
            order=walk,
        )
        order = [by_target[t] for t in walk if t in by_target]
        for i, c in enumerate(order):
            c.score = float(i)
        if first is not None:
            order.remove(by_target[first])
            order.insert(0, by_target[first])
            by_target[first].score = -1.0
        return order

    def reason(self, chosen: Candidate) -> str:
        return "affinity"
