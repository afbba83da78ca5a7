"""predicted-latency: the target with the lowest predicted time to first token, learned per target from the
times the router observes (``latency_model``), so a slower machine's tokens cost what they cost there.

::

    every candidate warm?  no ──▶ kv-aware's ranking (predictions still shown), reason "cold"
                           yes ─▶ score = predicted TTFT + recompute_weight x this prompt's own prefill
                                  there; over the load bound last, then predicted TPOT over the objective,
                                  then by score; a new prefix among those within kv-aware's placement
                                  band of the best placed as kv-aware places it
                           best scores >= (1 - defer_margin) x kv-aware's choice ─▶ kv-aware's ranking,
                                  reason "deferred" (the scores shown stay the predicted ones)

The load bound is kv-aware's (``routing.kv_aware.load_bound`` and ``load_slack``): a model that is
wrong cannot pile the traffic onto one target beyond it.
"""

from __future__ import annotations

from typing import ClassVar

from .base import Candidate, PolicyConfig, PolicyContext, RouteView, load_cap
from .kv_aware import KvAware
from .latency_model import LatencyBook, LatencyModelConfig

PREDICTED_LATENCY = "predicted-latency"


class PredictedLatencySettings(PolicyConfig, frozen=True, forbid_unknown_fields=True):
    name: ClassVar[str] = PREDICTED_LATENCY
    reads_index: ClassVar[bool] = True

    tpot_objective_s: float = 0.0
    """Time per output token a target must be predicted to meet to be preferred (0: no objective)."""
    recompute_weight: float = 1.0
    """Extra weight of this prompt's own predicted prefill time there: the capacity it takes from later
    requests (kv-aware's ``compute_weight``, in seconds of that target rather than tokens).  Tuned with
    ``kvrouter eval`` (docs/measurements.md, "Predicted latency on mixed fleets")."""
    placement_band: bool = True
    """Among the targets predicted within kv-aware's ``placement_band`` of the fastest that hold as much
    of the prompt, place a new prefix as kv-aware does (least-filled caches, then the prefix's ring
    order), so its later requests find it where routers agree it goes."""
    defer_margin: float = 0.25
    """Keep kv-aware's choice unless the target predicted best scores below (1 - defer_margin) x kv-aware's
    choice: act on the models only where they tell the targets apart by more than their error (0: off)."""
    model: LatencyModelConfig = LatencyModelConfig()
    """The latency models' prior and learning (every target's, whatever the active policy)."""

    def validate(self) -> None:
        if self.tpot_objective_s < 0 or self.recompute_weight < 0:
            raise ValueError("tpot_objective_s and recompute_weight must be >= 0")
        if not 0 <= self.defer_margin < 1:
            raise ValueError("defer_margin must be in [0, 1)")
        self.model.validate()

    def build(self, context: PolicyContext) -> PredictedLatency:
        book = context.latency if context.latency is not None else LatencyBook(self.model)
        return PredictedLatency(self, book, KvAware(context.settings.kv_aware))


class PredictedLatency:
    name = PREDICTED_LATENCY

    def __init__(self, settings: PredictedLatencySettings, book: LatencyBook, cold: KvAware) -> None:
        self.settings = settings
        self.book = book
        self.cold = cold
        """The ranking while any candidate's model is cold."""
        self._was_cold = False
        self._deferred = False

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        book, n = self.book, req.num_tokens
        for c in cands:
            c.predicted_ttft_s, c.predicted_tpot_s = book.predict(n, c)
        cold = not all(book.warm(c.target) for c in cands)
        if not dry_run:
            self._was_cold = cold
        if cold:
            return self.cold.rank(req, cands, dry_run=dry_run)
        s = self.settings
        kv_order = self.cold.rank(req, cands, dry_run=dry_run) if s.defer_margin else None
        w = s.recompute_weight
        for c in cands:
            c.score = (c.predicted_ttft_s or 0.0) + (w * book.prefill_s(n, c) if w else 0.0)
        kv = self.cold.settings
        cap = load_cap(cands, kv.load_bound, kv.load_slack)
        over = set() if cap is None else {c.target for c in cands if c.load > cap}
        if len(over) == len(cands):
            over = set()
        slo = s.tpot_objective_s
        missed = {c.target for c in cands if slo and (c.predicted_tpot_s or 0.0) > slo}
        out = sorted(
            cands,
            key=lambda c: (c.target in over, c.target in missed, c.score, c.in_flight, -c.cached_tokens),
        )
        if s.placement_band:
            # kv-aware's placement of a new prefix among the targets predicted within the band of the
            # fastest (a target over the bound or missing the objective is never in it)
            busy = self.cold.busy_targets(cands) if cap is not None else set()
            out = self.cold.placed(req, cands, out, over | missed, busy)
        deferred = False
        if kv_order is not None:
            pick = kv_order[0]
            deferred = (
                pick.target != out[0].target
                and pick.target not in over | missed
                and out[0].score >= (1 - s.defer_margin) * pick.score
            )
        if not dry_run:
            self._deferred = deferred
        return kv_order if deferred and kv_order is not None else out

    def reason(self, chosen: Candidate) -> str:
        if self._was_cold:
            return "cold"
        return "deferred" if self._deferred else "latency"
