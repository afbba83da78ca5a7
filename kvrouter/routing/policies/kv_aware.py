"""kv-aware: the target where the prompt costs the fleet least, cache and load counted together.

::

    cost = queued prefill + (1 + compute_weight) x prefill still to compute here
           + load_weight x requests in flight                          (per unit of weight)

"Still to compute" is the prompt minus the prefix this target really caches, each block at its tier's
worth (GPU and speculative entries 1; CPU, STORAGE and shared stores what loading saves over recomputing:
``tier_value``); a target whose index is not trusted gets no credit for cache (load-based for it alone).
Among the cheapest targets that hold the same part of the prompt, those within the placement band are
taken in the ring order of the first blocks none of them holds.
"""

from __future__ import annotations

from typing import ClassVar

from ..hashring import HashRing
from .base import MIN_WEIGHT, Candidate, PolicyConfig, PolicyContext, RouteView, load_cap

KV_AWARE = "kv-aware"

RING_KEY_BLOCKS = 4
"""The placement ring is keyed by the first this-many blocks nobody holds (64 tokens at block size 16):
enough to tell distinct system prompts with a common opening apart, few enough that a question after a
shared prompt rarely reaches into them."""


class KvAwareSettings(PolicyConfig, frozen=True):
    name: ClassVar[str] = KV_AWARE
    reads_index: ClassVar[bool] = True

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
    (1 + placement_band) x its cost (never an over-bound one).  Within it, targets that took at most the
    fleet's mean of new prompts' blocks lately come first (``routing.placed_blocks``: this router's
    placements and, through the claims log, other replicas'), then those whose cache footprint is at
    most the fleet's mean, and the ring order of the first blocks none of them holds decides.  Router
    replicas, gateway workers and endpoint-picker replicas whose views of the load differ by less than
    the band send a new prefix to the same target before hearing of each other's requests; the two
    balance keys keep a few large prefixes from piling onto one cache as plain consistent hashing would
    (the footprint alone stops telling caches apart once all are full: evictions hold each at its
    capacity).  A prefix held by the cheapest target alone is placed by cost as before.  The chosen
    target costs at most (1 + placement_band) x the cheapest.  0: the ring breaks exact ties only.
    Tuned with ``kvrouter eval`` and ``kvrouter bench replicas`` (docs/measurements.md, "kv-aware
    placement band")."""

    def validate(self) -> None:
        if self.offload_value is not None and not 0 <= self.offload_value <= 1:
            raise ValueError("offload_value must be between 0 and 1")

    def build(self, context: PolicyContext) -> KvAware:
        return KvAware(self)


class KvAware:
    name = KV_AWARE

    def __init__(self, settings: KvAwareSettings | None = None) -> None:
        self.settings = settings or KvAwareSettings()
        self.ring = HashRing(vnodes=40)

    def cost(self, req: RouteView, c: Candidate) -> float:
        s = self.settings
        to_compute = max(0, req.num_tokens - c.cached_tokens)
        cost = c.pending_prefill_tokens + (1 + s.compute_weight) * to_compute + s.load_weight * c.in_flight
        return cost / max(c.weight, MIN_WEIGHT)

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        for c in cands:
            c.score = self.cost(req, c)
        # Over-bound targets go last; ties (equal cost) go to the less loaded, then the more cached.
        over: set[str] = set()
        busy: set[str] = set()
        cap = load_cap(cands, self.settings.load_bound, self.settings.load_slack)
        if cap is not None:
            over = {c.target for c in cands if c.load > cap}
            if len(over) == len(cands):
                over = set()
            busy = self.busy_targets(cands)
        out = sorted(cands, key=lambda c: (c.target in over, c.score, c.in_flight, -c.cached_tokens))
        return self.placed(req, cands, out, over, busy)

    def placed(
        self, req: RouteView, cands: list[Candidate], out: list[Candidate], over: set[str], busy: set[str]
    ) -> list[Candidate]:
        """``out`` (``cands`` ranked by score, ``over`` last) with its placement band reordered (see
        ``placement_band``): what a policy scoring in other units shares with this one."""
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
            placed = sum(c.placed_blocks for c in cands) / len(cands)
            head.sort(
                key=lambda c: (
                    c.target in busy,
                    c.placed_blocks > placed,
                    c.footprint > fill,
                    order.get(c.target, len(order)),
                )
            )
            out = head + out[band:]
        return out

    def busy_targets(self, cands: list[Candidate]) -> set[str]:
        """Targets where a burst of a new prefix (``load_slack`` requests) would be split by the bound, which
        rises with the burst's own share of the mean; in the band they come after those with room.  At a
        few requests in flight none is.  Judged on this router's own requests: other replicas' come a
        round trip late and the engines' counts a scrape late, each replica's at another moment, and a
        threshold on them puts one target on different sides in different replicas, which then split a
        burst of one prefix (each places its share of it by its own view).  The bound (``over``) itself
        counts everything in flight."""
        k, n = self.settings.load_slack, len(cands)
        own_mean = sum(c.own_load for c in cands) / n
        out: set[str] = set()
        for c in cands:
            burst = k / max(c.weight, MIN_WEIGHT)
            if c.own_load + burst > self.settings.load_bound * (own_mean + burst / n) + k:
                out.add(c.target)
        return out

    def reason(self, chosen: Candidate) -> str:
        return "cache" if chosen.cached_tokens > 0 else "load"

    def _band(self, ranked: list[Candidate], over: set[str]) -> int:
        """How many of the cost-ordered ``ranked`` form the placement band (see ``placement_band``)."""
        if len(ranked) < 2:
            return len(ranked)
        lead = ranked[0]
        limit = lead.score * (1 + self.settings.placement_band)
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
