"""Routing policies.  Each ranks the candidate targets of one request; limits are applied by the router.

    kv-aware      cost = queued prefill + (1 + compute_weight) x prefill still to compute here
                         + load_weight x requests in flight,
                  where "still to compute" = prompt tokens minus the prefix this target really caches,
                  each block at its tier's worth (GPU and speculative entries 1; CPU, STORAGE and
                  shared stores what loading saves over recomputing: ``tier_value``);
                  targets whose index is not trusted get no credit for cache (load-based for them alone)
    prefix-hash   consistent hashing with bounded load over the first `prefix_length` characters (plus the
                  affinity id), SageMaker PREFIX_AWARE style
    session       a request of a session goes where the session's last request went, while that target
                  is a candidate (healthy), under its concurrency threshold and within kv-aware's load
                  bound; otherwise (and without a session) kv-aware, which finds the session's history
                  in the cache anyway (HyperPod's "session" strategy)
    least-loaded  fewest requests in flight
    round-robin   in turn
    random        uniformly (seeded)

A policy returns the candidates in preference order (best first).  ``dry_run`` asks for the ranking
without advancing any internal state (round-robin's pointer, the random generator): shadow scoring uses
it to ask every policy what it would have done, on the same request, for free.
"""

from __future__ import annotations

import enum
import random
from typing import Protocol

import msgspec

from ..types import InstanceId, TargetKey
from .expiring import ExpiringMap
from .hashring import HashRing


class PolicyName(enum.StrEnum):
    """Every policy's name (``registry`` builds them).  A ``StrEnum``: equal to its string."""

    KV_AWARE = "kv-aware"
    PREFIX_HASH = "prefix-hash"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    SESSION = "session"


class Candidate(msgspec.Struct):
    """One routing target (an instance's data-parallel rank) as a policy sees it."""

    instance: InstanceId
    dp_rank: int
    target: TargetKey
    """``instance`` or ``instance/rank``: the key of load accounting and of the hash ring."""
    trust: str = "none"
    """The index's trust in this target (exact, partial, degraded, cold), or "none" without events."""
    matched_blocks: int = 0
    gpu_blocks: int = 0
    offload_blocks: int = 0
    speculative_blocks: int = 0
    tiers: dict[str, int] = {}
    """Credited blocks by tier (GPU, speculative, CPU, STORAGE, a shared store's name; 0s left out)."""
    cached_tokens: int = 0
    """Prompt tokens the target is credited with: each cached block at its tier's worth (``tier_value``),
    0 when its index is not trusted.  What kv-aware subtracts from the prefill to compute."""
    hit_tokens: int = 0
    """Prompt tokens vLLM is predicted to report as cached there (every tier in full)."""
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    decoding: int = 0
    weight: float = 1.0
    saturated: bool = False
    """At or over the concurrency threshold: chosen only if every target is."""
    score: float = 0.0
    """The policy's score (lower is better), for explain and logs."""


class RouteView(msgspec.Struct):
    """What a policy may read about the request."""

    num_tokens: int
    prefix_key: bytes
    session: str | None = None
    now: float | None = None
    """The caller's clock (the session policy's expiry); None when the caller has none."""


class Policy(Protocol):
    name: PolicyName

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]: ...


class KvAwareSettings(msgspec.Struct, frozen=True):
    compute_weight: float = 8.0
    """Extra weight of the prefill a choice adds to the fleet.  The first term of the cost is this request's
    wait (queued + own prefill); this one charges the capacity it takes from every later request, so a
    target that must recompute a prefix another target holds loses even when it is idle right now.
    Tuned with ``kvrouter eval`` (docs/measurements.md, "kv-aware weights")."""
    load_weight: float = 32.0
    """Prefill-token equivalent of one request in flight (each decodes in every later step)."""
    load_bound: float = 1.5
    """A target with more than ``load_bound`` x mean + ``load_slack`` requests in flight is chosen only if
    every target is (consistent hashing's bounded-load idea, with slack).  Without it, one prefix shared by
    all traffic stays on the instance that computed it up to the spill threshold: the cost charges
    recomputing the prefix elsewhere in full, though each other instance pays it once.  With it, that
    instance takes its share plus the slack and the prefix spreads (docs/measurements.md, "kv-aware
    weights").  0: off."""
    load_slack: float = 8.0
    """Requests in flight a target may hold above ``load_bound`` x mean: a burst of one new prefix up to
    this size stays together on an idle fleet (its later requests hit what the first computes)."""
    offload_value: float | None = None
    """Worth of a hit in any tier below the GPU relative to a GPU hit, for every such tier alike.  None
    (the default): each tier's worth follows from its load bandwidth (the fleet file's ``tiers:``,
    ``kvrouter.routing.tier_value``)."""


class KvAware:
    name = PolicyName.KV_AWARE

    def __init__(self, settings: KvAwareSettings | None = None) -> None:
        self.s = settings or KvAwareSettings()
        self.ring = HashRing(vnodes=40)

    def cost(self, req: RouteView, c: Candidate) -> float:
        to_compute = max(0, req.num_tokens - c.cached_tokens)
        cost = (
            c.pending_prefill_tokens
            + (1 + self.s.compute_weight) * to_compute
            + self.s.load_weight * c.in_flight
        )
        return cost / max(c.weight, 1e-6)

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        for c in cands:
            c.score = self.cost(req, c)
        # Over-bound targets go last; ties (equal cost) go to the less loaded, then the more cached.  Exact
        # ties that remain (an idle fleet, a prefix nobody holds) are broken by consistent hashing of the
        # prompt's prefix: every router replica, seeing the same state, picks the same target for it.
        over: set[str] = set()
        if self.s.load_bound and len(cands) > 1:
            mean = sum(c.in_flight / max(c.weight, 1e-6) for c in cands) / len(cands)
            cap = self.s.load_bound * mean + self.s.load_slack
            over = {c.target for c in cands if c.in_flight / max(c.weight, 1e-6) > cap}
            if len(over) == len(cands):
                over = set()
        out = sorted(cands, key=lambda c: (c.target in over, c.score, c.in_flight, -c.cached_tokens))
        if len(out) > 1 and req.prefix_key:
            first = (out[0].score, out[0].in_flight, out[0].cached_tokens)
            tied = [c for c in out if (c.score, c.in_flight, c.cached_tokens) == first]
            if len(tied) > 1:
                for c in tied:
                    self.ring.add(c.target)
                self.ring.prune(c.target for c in cands)
                order: dict[str, int] = {str(t): i for i, t in enumerate(self.ring.walk(req.prefix_key))}
                tied.sort(key=lambda c: order.get(c.target, len(order)))
                out = tied + out[len(tied) :]
        return out


class SessionSettings(msgspec.Struct, frozen=True):
    ttl_s: float = 1800.0
    """A session not seen for this long is forgotten (its next request is routed kv-aware)."""
    max_sessions: int = 100_000
    """Sessions remembered at most (those expiring first are forgotten first)."""


class SessionTable:
    """Session -> the target its last request was sent to (bounded, sliding expiry).  Filled by the
    router on every dispatch, whatever the policy, so the session policy's shadow choice is real."""

    def __init__(self, settings: SessionSettings | None = None) -> None:
        self.s = settings or SessionSettings()
        self.map: ExpiringMap[str, TargetKey] = ExpiringMap(self.s.max_sessions)

    def pinned(self, session: str, now: float) -> TargetKey | None:
        return self.map.get(session, now)

    def record(self, session: str, target: TargetKey, now: float) -> None:
        self.map.put(session, target, now, self.s.ttl_s)


class SessionAffinity:
    name = PolicyName.SESSION

    def __init__(self, table: SessionTable, kv: KvAware) -> None:
        self.table = table
        self.kv = kv

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        ranked = self.kv.rank(req, cands, dry_run=dry_run)
        if req.session is None or req.now is None:
            return ranked
        pin = self.table.pinned(req.session, req.now)
        c = next((c for c in ranked if c.target == pin), None) if pin is not None else None
        if c is None or c.saturated or self._over_bound(c, cands):
            return ranked
        ranked.remove(c)
        c.score = -1.0  # below any kv-aware cost: marks the session's own choice
        return [c, *ranked]

    def _over_bound(self, c: Candidate, cands: list[Candidate]) -> bool:
        s = self.kv.s
        if not s.load_bound or len(cands) < 2:
            return False
        loads = [x.in_flight / max(x.weight, 1e-6) for x in cands]
        cap = s.load_bound * sum(loads) / len(loads) + s.load_slack
        return c.in_flight / max(c.weight, 1e-6) > cap


class PrefixHashSettings(msgspec.Struct, frozen=True):
    prefix_length: int = 1024
    """Characters (chat message text) or bytes (raw body) hashed for affinity (SageMaker: 1024..65536)."""
    load_bound: float = 1.25
    """Bounded-load factor: a target takes a key only below bound x (mean load + 1)."""
    vnodes: int = 160


class PrefixHash:
    name = PolicyName.PREFIX_HASH

    def __init__(self, settings: PrefixHashSettings | None = None) -> None:
        self.s = settings or PrefixHashSettings()
        self.ring = HashRing(vnodes=self.s.vnodes)

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        by_target = {c.target: c for c in cands}
        for t in set(by_target) - set(self.ring.members):
            self.ring.add(t)
        self.ring.prune(by_target)

        def load(t: TargetKey) -> float:
            return by_target[t].in_flight / max(by_target[t].weight, 1e-6)

        walk = self.ring.walk(req.prefix_key)
        first = self.ring.choose(
            req.prefix_key, load, bound=self.s.load_bound, eligible=lambda t: t in by_target, order=walk
        )
        order = [by_target[t] for t in walk if t in by_target]
        for i, c in enumerate(order):
            c.score = float(i)
        if first is not None:
            order.remove(by_target[first])
            order.insert(0, by_target[first])
            by_target[first].score = -1.0
        return order


class LeastLoaded:
    name = PolicyName.LEAST_LOADED

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(0)

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        for c in cands:
            c.score = c.in_flight / max(c.weight, 1e-6)
        # equal loads are broken at random, so idle fleets spread instead of piling on the first target
        salt = {c.target: (self.rng.random() if not dry_run else 0.0) for c in cands}
        return sorted(cands, key=lambda c: (c.score, salt[c.target], c.target))


class RoundRobin:
    name = PolicyName.ROUND_ROBIN

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


class Random:
    name = PolicyName.RANDOM

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


class PolicySettings(msgspec.Struct, frozen=True):
    """Per-policy settings (the fleet file's ``routing:`` section)."""

    kv_aware: KvAwareSettings = KvAwareSettings()
    prefix_hash: PrefixHashSettings = PrefixHashSettings()
    session: SessionSettings = SessionSettings()
    seed: int = 0
