"""Disaggregated prefill and decode: which instance prefills, which decodes, and whether to split at all.
Pure and clock-free; the gateway's pipeline and the evaluator both call ``DisaggPlanner.plan``.

D comes from the decode pool (role decode | both) by the decode policy, P from the prefill pool (role
prefill | both, not D) by the model's policy.  The request runs whole on D when: conditional mode, D
lacks at most ``local_prefill_tokens`` and D's queue + what D lacks <= P's queue + what P computes
(``short_uncached``); no prefill instance can take it (``no_prefill``, ``prefill_full``); conditional
mode and P's queue + what P computes > ``prefill_busy_ratio`` x D's (``prefill_busy``).  Otherwise
two legs: P computes the prompt and holds its KV cache, D pulls it and generates (``remote_prefill``).
Predicted mode: where D's and P's latency models (warm) predict that only one plan meets both
objectives, that plan (``predicted_split``, ``predicted_whole``); split where neither is and whole misses the
TTFT objective (``predicted_neither``); the conditional rules otherwise.

The decode policy is kv-aware's cost with a light charge per uncached token (``decode_cache_weight``):
by load first, then by what D caches itself, which is what makes ``short_uncached`` fire for the next
turn of a conversation.  A model is planned here only when one of its instances has a role other than
``both``; a fleet of ``both`` instances is routed aggregated.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection, Sequence

import msgspec

from indexer import LookupResult

from ..types import Role, TargetKey
from .policies import ALL_POLICIES, Candidate, KvAware, KvAwareSettings, Policy
from .policies.latency_model import received
from .router import Decision, RouteInput, Router, Target


class DisaggMode(enum.StrEnum):
    OFF = "off"
    """Never split: the model's instances are routed as one aggregated pool, whatever their roles."""
    ALWAYS = "always"
    """Split every request that a prefill instance other than its decode instance can take."""
    CONDITIONAL = "conditional"
    """Split unless the decode instance lacks little of the prompt or the prefill pool is the bottleneck."""
    PREDICTED = "predicted"
    """As conditional, except where the decode and the prefill instance's latency models (once warm)
    predict that only one plan, split or whole, meets ``slo_ttft_s`` and ``slo_tpot_s``: that plan
    (``predicted_split``, ``predicted_whole``); split where neither does and whole misses ``slo_ttft_s``
    (``predicted_neither``)."""


class DisaggSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The fleet file's ``routing.disaggregation`` section."""

    mode: DisaggMode = DisaggMode.CONDITIONAL
    local_prefill_tokens: int = 2048
    """Conditional: a decode instance that lacks at most this many prompt tokens computes them itself."""
    prefill_busy_ratio: float = 4.0
    """Conditional: keep a request whole on its decode instance when the prefill instance's queued prefill
    plus the prompt it must compute exceed this many times the decode instance's queued prefill plus what
    it lacks (0: never).  A local prefill costs the decode batch a stall, hence a ratio above 1."""
    decode_cache_weight: float = 0.1
    """Decode choice: cost of one prompt token the decode instance does not cache (it must be transferred,
    or computed locally), in the unit of kv-aware's cost (queued prefill tokens)."""
    decode_load_weight: float = 32.0
    """Decode choice: cost of one request in flight there (each decodes in every later step)."""
    decode_load_bound: float = 1.25
    """Decode choice: bounded load as in kv-aware (``load_bound``): a decode instance with more than this
    many times the mean load (+ ``decode_load_slack``) is chosen only if all are."""
    decode_load_slack: float = 4.0
    prefill_policy: str | None = None
    """The prefill pool's policy (default: the model's; ``least-loaded`` is the load-only baseline)."""
    slo_ttft_s: float = 2.0
    """Predicted mode: the time to first token a plan must be predicted to meet."""
    slo_tpot_s: float = 0.05
    """Predicted mode: the time per output token a plan must be predicted to meet."""

    def validate(self, policies: Collection[str] = ALL_POLICIES) -> None:
        """``policies``: the names a router knows (``PolicySettings.names``)."""
        fields = ("local_prefill_tokens", "prefill_busy_ratio", "decode_cache_weight", "decode_load_weight")
        bad = [f for f in fields if getattr(self, f) < 0]
        if bad:
            raise ValueError(f"routing.disaggregation: {', '.join(bad)} must be >= 0")
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise ValueError("routing.disaggregation: slo_ttft_s and slo_tpot_s must be > 0")
        if self.prefill_policy is not None and self.prefill_policy not in policies:
            raise ValueError(f"unknown policy {self.prefill_policy!r}; choose from {', '.join(policies)}")

    def decode_settings(self, base: KvAwareSettings) -> KvAwareSettings:
        """kv-aware's settings that make it the decode policy (``base`` gives the offload value)."""
        return KvAwareSettings(
            compute_weight=self.decode_cache_weight - 1.0,  # its cost charges (1 + compute_weight) per token
            load_weight=self.decode_load_weight,
            load_bound=self.decode_load_bound,
            load_slack=self.decode_load_slack,
            offload_value=base.offload_value,
        )


class PDPlan(msgspec.Struct):
    """Where one request goes in a disaggregated fleet."""

    reason: str
    """remote_prefill (split), or why it stays whole: short_uncached, prefill_busy, no_prefill,
    prefill_full, no_decode; or the decode decision's reason when it has no target (at_capacity,
    no_target)."""
    decode: Decision
    """The instance that answers the client (when not split, it also computes the prompt)."""
    prefill: Decision | None = None
    """Set when the request is split: the instance that computes the prompt."""
    uncached_tokens: int = 0
    """Prompt tokens the decode instance does not cache (what it computes or receives)."""

    @property
    def split(self) -> bool:
        return self.prefill is not None and self.prefill.chosen is not None

    @property
    def prefill_target(self) -> Candidate | None:
        return self.prefill.chosen if self.prefill is not None else None


_ROLE_LETTERS: dict[str, Role] = {"P": "prefill", "D": "decode", "B": "both"}


def parse_roles(spec: str) -> list[Role]:
    """``2P2D`` -> [prefill, prefill, decode, decode]: counts of prefill (P), decode (D) and both (B)
    instances, in order.  ``ValueError`` for anything else."""
    if re.fullmatch(r"(?:\d+[PDBpdb])+", spec.strip()) is None:
        raise ValueError(f"roles {spec!r}: expected counts and letters, as 2P2D or 1P3D1B")
    out: list[Role] = []
    for n, letter in re.findall(r"(\d+)([PDBpdb])", spec):
        out += [_ROLE_LETTERS[letter.upper()]] * int(n)
    if not out:
        raise ValueError(f"roles {spec!r}: no instance")
    return out


def roles_label(roles: Sequence[Role]) -> str:
    """``[prefill, prefill, decode]`` -> ``2P1D`` (``parse_roles``' inverse)."""
    letters = {v: k for k, v in _ROLE_LETTERS.items()}
    out, i = "", 0
    while i < len(roles):
        j = i
        while j < len(roles) and roles[j] == roles[i]:
            j += 1
        out += f"{j - i}{letters[roles[i]]}"
        i = j
    return out


def is_disaggregated(targets: list[Target]) -> bool:
    """Whether a model's targets form a disaggregated fleet (some instance is not ``both``)."""
    return any(t.role != "both" for t in targets)


class DisaggPlanner:
    """Plans requests of disaggregated models over one router's index and load."""

    def __init__(self, router: Router, settings: DisaggSettings | None = None) -> None:
        self.router = router
        self.settings = settings or DisaggSettings()
        self.settings.validate(router.policy_names)
        self.decode_policy = KvAware(self.settings.decode_settings(router.config.settings.kv_aware))
        self._prefill_policy = (
            router.config.settings.build(self.settings.prefill_policy)
            if self.settings.prefill_policy
            else None
        )

    def applies(self, targets: list[Target]) -> bool:
        """Whether ``plan`` decides for these targets (otherwise route them aggregated, as ever)."""
        return self.settings.mode != DisaggMode.OFF and is_disaggregated(targets)

    def prefill_policy(self, model: str | None) -> Policy:
        return self._prefill_policy or self.router.policy_for(model)

    def plan(
        self,
        inp: RouteInput,
        targets: list[Target],
        now: float | None = None,
        *,
        remote: LookupResult | None = None,
        dry_run: bool = False,
        shadow: bool = True,
    ) -> PDPlan:
        """The plan for one request (``dry_run``: explain, no policy state advanced; ``shadow``: as
        ``Router.route``, for the prefill decision)."""
        router, s = self.router, self.settings
        roles = {t.key: t.role for t in targets}
        cands = router.candidates(inp, targets, now, remote)
        decoders = [c for c in cands if roles[c.target] != "prefill"]
        if not decoders:
            # Only prefill instances are up: any vLLM instance can serve a request whole.
            d = router.route_among(inp, cands, now=now, dry_run=dry_run, shadow=shadow)
            return PDPlan("no_decode" if d.chosen else d.reason, d, uncached_tokens=_uncached(inp, d))
        dd = router.route_among(
            inp, _copies(decoders), now=now, policy=self.decode_policy, dry_run=dry_run, shadow=False
        )
        if dd.chosen is None:
            return PDPlan(dd.reason, dd)
        dc = dd.chosen
        uncached = max(0, inp.num_tokens - dc.cached_tokens)
        pool = [c for c in cands if roles[c.target] != "decode" and c.target != dc.target]
        pd = self.prefill_decision(inp, pool, dry_run=dry_run, shadow=shadow)
        pc = pd.chosen
        # Prefill tokens queued before this request's own, plus its own: where it would wait.
        local_wait = dc.pending_prefill_tokens + uncached
        remote_wait = (
            pc.pending_prefill_tokens + max(0, inp.num_tokens - pc.cached_tokens) if pc else float("inf")
        )
        if s.mode == DisaggMode.PREDICTED and pc is not None:
            why = self.predicted_plan(inp, dc, pc)
            if why is not None:
                return (
                    PDPlan(why, dd, uncached_tokens=uncached)
                    if why == "predicted_whole"
                    else PDPlan(why, dd, pd, uncached)
                )
        conditional = s.mode in (DisaggMode.CONDITIONAL, DisaggMode.PREDICTED)
        if conditional and uncached <= s.local_prefill_tokens and local_wait <= remote_wait:
            return PDPlan("short_uncached", dd, uncached_tokens=uncached)
        if pc is None:
            reason = "prefill_full" if pd.reason == "at_capacity" else "no_prefill"
            return PDPlan(reason, dd, uncached_tokens=uncached)
        if conditional and s.prefill_busy_ratio > 0 and remote_wait > s.prefill_busy_ratio * local_wait:
            return PDPlan("prefill_busy", dd, uncached_tokens=uncached)
        return PDPlan("remote_prefill", dd, pd, uncached)

    def predicted_plan(self, inp: RouteInput, dc: Candidate, pc: Candidate) -> str | None:
        """The predicted mode's override of the conditional rules, as its reason (None: they decide, as while
        either instance's model is cold).  Whole: ``dc``'s TTFT and TPOT with the prompt it lacks computed
        there.  Split: ``pc``'s TTFT (the prefill leg) and ``dc``'s TPOT with the prompt received.  The
        transfer is not predicted.
        - ``predicted_split`` / ``predicted_whole``: only that plan is predicted to meet both objectives.
        - ``predicted_neither`` (split): neither is, and whole misses the TTFT objective.  Kept whole, the
          request would miss it and its prefill would slow every request decoding on ``dc`` as well; split,
          that cost falls on the prefill pool's queue (within both objectives on a mixed 2P2D fleet:
          28.8 % against 12.4 % at the trace's rate; docs/measurements.md).
        Why not the plan with the better predicted figures: under load a whole request's TPOT misses nearly
        always, so that rule split until the prefill pool's queue was seconds deep (5.3 % against 12.4 %)."""
        lat, s = self.router.latency, self.settings
        if not (lat.warm(dc.target) and lat.warm(pc.target)):
            return None
        n = inp.num_tokens
        whole_ttft, whole_tpot = lat.predict(n, dc)
        split_ttft = lat.predict(n, pc)[0]
        split_tpot = lat.predict(n, received(dc, n))[1]
        whole = whole_ttft <= s.slo_ttft_s and whole_tpot <= s.slo_tpot_s
        split = split_ttft <= s.slo_ttft_s and split_tpot <= s.slo_tpot_s
        if whole != split:
            return "predicted_split" if split else "predicted_whole"
        if whole_ttft > s.slo_ttft_s:  # whole == split here: so neither meets both
            return "predicted_neither"
        return None

    def prefill_decision(
        self,
        inp: RouteInput,
        pool: list[Candidate],
        *,
        dry_run: bool = False,
        shadow: bool = True,
    ) -> Decision:
        """The prefill pool's decision among ``pool`` (candidates of prefill-capable targets)."""
        return self.router.route_among(
            inp, pool, policy=self.prefill_policy(inp.model), dry_run=dry_run, shadow=shadow
        )

    def reroute_prefill(
        self,
        inp: RouteInput,
        targets: list[Target],
        decode: TargetKey,
        tried: set[str],
        now: float | None = None,
        remote: LookupResult | None = None,
    ) -> Candidate | None:
        """The next prefill instance after failed prefill legs on ``tried`` (None: none is left)."""
        pool = [
            t for t in targets if t.role != "decode" and t.key != decode and t.key not in tried and t.healthy
        ]
        cands = self.router.candidates(inp, pool, now, remote)
        return self.prefill_decision(inp, cands, shadow=False).chosen


def _copies(cands: list[Candidate]) -> list[Candidate]:
    """Ranking writes scores into candidates; a pool ranked apart gets its own."""
    return [msgspec.structs.replace(c) for c in cands]


def _uncached(inp: RouteInput, d: Decision) -> int:
    return max(0, inp.num_tokens - d.chosen.cached_tokens) if d.chosen is not None else 0


def explain_plan(plan: PDPlan) -> dict[str, object]:
    """The ``disaggregation`` part of ``/v1/route/explain``."""
    d, p = plan.decode.chosen, plan.prefill_target
    return {
        "split": plan.split,
        "reason": plan.reason,
        "decode": None if d is None else d.target,
        "prefill": None if p is None else p.target,
        "decode_uncached_tokens": plan.uncached_tokens,
        "decode_ranking": [{"target": c.target, "score": c.score} for c in plan.decode.ranked],
        "prefill_ranking": []
        if plan.prefill is None
        else [
            {"target": c.target, "score": c.score, "cached_tokens": c.cached_tokens}
            for c in plan.prefill.ranked
        ],
    }
