"""Routing policies.  Each ranks the candidate targets of one request; limits are applied by the router.

    kv-aware      cost = queued prefill + (1 + compute_weight) x prefill still to compute here
                         + load_weight x requests in flight,
                  where "still to compute" = prompt tokens minus the prefix this target really caches,
                  each block at its tier's worth (GPU and speculative entries 1; CPU, STORAGE and
                  shared stores what loading saves over recomputing: ``tier_value``);
                  targets whose index is not trusted get no credit for cache (load-based for them alone);
                  among the cheapest targets that hold the same part of the prompt, those within the
                  placement band are taken in the ring order of the first blocks none of them holds
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

from indexer.hashing import I64Array

from ..types import InstanceId, TargetKey
from .expiring import ExpiringMap
from .hashring import HashRing

RING_KEY_BLOCKS = 4
"""The placement ring is keyed by the first this-many blocks nobody holds (64 tokens at block size 16):
enough to tell distinct system prompts with a common opening apart, few enough that a question after a
shared prompt rarely reaches into them."""


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
    others_in_flight: int = 0
    """Of ``in_flight``, what is not this router's own: other router replicas' requests (shared state, a
    round trip old) and whatever more the engine reports running or waiting (its last scrape)."""
    pending_prefill_tokens: int = 0
    decoding: int = 0
    weight: float = 1.0
    footprint: int = 0
    """GPU blocks the index holds for this target plus its speculative entries (0 when unknown): how much
    of its cache the traffic sent there fills; the same for every router fed the same events."""
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
    chains: I64Array | None = None
    """The prompt's chain hashes (None without a tokenizer): block i's covers the whole prefix up to it."""


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
    placement_band: float = 0.1
    """Placement of a prompt's part that no target holds, agreed on without talking.  The band: the
    targets first in cost order that hold the same part of the prompt as the cheapest and cost at most
    (1 + placement_band) x its cost (never an over-bound one).  Within it, targets whose cache footprint
    is at most the fleet's mean come first, and the ring order of the first blocks none of them holds
    decides.  Router replicas, gateway workers and endpoint-picker replicas whose views of the load
    differ by less than the band send a new prefix to the same target before hearing of each other's
    requests; the footprint bound keeps a few large prefixes from piling onto one cache as plain
    consistent hashing would.  A prefix held by the cheapest target alone is placed by cost as before.
    The chosen target costs at most (1 + placement_band) x the cheapest.  0: the ring breaks exact ties
    only.  Tuned with ``kvrouter eval`` and ``kvrouter bench replicas`` (docs/measurements.md,
    "kv-aware placement band")."""


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
        # Over-bound targets go last; ties (equal cost) go to the less loaded, then the more cached.
        over: set[str] = set()
        busy: set[str] = set()
        if self.s.load_bound and len(cands) > 1:
            n = len(cands)
            mean = sum(c.in_flight / max(c.weight, 1e-6) for c in cands) / n
            cap = self.s.load_bound * mean + self.s.load_slack
            over = {c.target for c in cands if c.in_flight / max(c.weight, 1e-6) > cap}
            if len(over) == len(cands):
                over = set()
            # busy: a burst of a new prefix (load_slack requests) placed there would be split by the bound,
            # which rises with the burst's own share of the mean; in the band such a target comes after
            # those with room.  Judged on this router's own requests: other replicas' come a round trip
            # late and the engines' counts a scrape late, each replica's at another moment, and a
            # threshold on them puts one target on different sides in different replicas, which then
            # split a burst of one prefix (each places its share of it by its own view).  The bound
            # itself counts everything in flight.
            own = {c.target: (c.in_flight - c.others_in_flight) / max(c.weight, 1e-6) for c in cands}
            own_mean = sum(own.values()) / n
            k = self.s.load_slack
            busy = {
                c.target
                for c in cands
                if own[c.target] + k / max(c.weight, 1e-6)
                > self.s.load_bound * (own_mean + k / max(c.weight, 1e-6) / n) + k
            }
        out = sorted(cands, key=lambda c: (c.target in over, c.score, c.in_flight, -c.cached_tokens))
        band = self._band(out, over)
        if band > 1:
            # The band is a leading run of the cost order, so whatever it reorders stays ahead of every
            # target outside it, each of which costs at least as much: more cached at equal load still
            # never loses, and an over-bound target still comes only after every other.
            head = out[:band]
            for c in head:
                self.ring.add(c.target)
            self.ring.prune(c.target for c in cands)
            order = {t: i for i, t in enumerate(self.ring.walk(self.ring_key(req, out[0])))}
            fill = sum(c.footprint for c in cands) / len(cands)
            head.sort(key=lambda c: (c.target in busy, c.footprint > fill, order.get(c.target, len(order))))
            out = head + out[band:]
        return out

    def _band(self, ranked: list[Candidate], over: set[str]) -> int:
        """How many of the cost-ordered ``ranked`` form the placement band (see ``placement_band``)."""
        if len(ranked) < 2:
            return len(ranked)
        lead = ranked[0]
        limit = lead.score * (1 + self.s.placement_band)
        n = 0
        for c in ranked:
            if c.target in over or c.cached_tokens != lead.cached_tokens or c.score > limit:
                break
            n += 1
        return n

    @staticmethod
    def ring_key(req: RouteView, lead: Candidate) -> bytes:
        """The key the band is placed by: the chain hash of the ``RING_KEY_BLOCKS``-th block past what the
        band holds (it covers the whole prompt up to there), or the request's prefix key without chains
        or when no full block is left past the held part."""
        ch = req.chains
        held = lead.matched_blocks
        if ch is None or len(ch) <= held:
            return req.prefix_key
        i = min(held + RING_KEY_BLOCKS, len(ch)) - 1
        return b"kv-block\x00" + int(ch[i]).to_bytes(8, "little", signed=True)


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
