"""Per-target latency models learned online: each target's time to first token (TTFT) and time per output
token (TPOT) as linear functions of what the router knows when it decides.

::

    dispatched(rid, view, chosen, now)  features snapshot + prediction   (request path: a dict insert)
    first_token(rid, now) / finished(rid, now, n)  ──▶ observations pending
    train()  ──▶ each target's models (off the request path: the front door schedules it)
    predict(view, candidate) ──▶ (TTFT s, TPOT s): two short dot products

Recursive least squares with exponential forgetting, from a prior (``LatencyModelConfig``), reweighted
so that it minimises the absolute relative error (what MAPE measures); a target is cold until ``warmup``
TTFT observations.  Wild observations (not finite, not positive, over ``max_latency_s``) are counted and
dropped; outliers past ``outlier_ratio`` of the prediction are counted and clipped; the covariance is
bounded.  The features and the reasons for each: docs/predicted-latency.md.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import msgspec
import numpy as np

from ...types import RequestId, TargetKey
from .base import Candidate

TTFT = "ttft"
TPOT = "tpot"
KINDS = (TTFT, TPOT)

Outcome = str
"""What became of an observation: used, clipped (an outlier, bounded), invalid (dropped); or why a request
taught nothing: ``unary`` (its answer came whole, so neither its first token nor its pace was seen),
``no_pace`` (a stream that ended without its output tokens reported, or with one token)."""
NOT_LEARNED = ("invalid", "unary", "no_pace")
"""Outcomes that train nothing (counted at once; the others are counted when trained)."""


class LatencyModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The latency models' prior and learning (``routing.predicted_latency.model``)."""

    ttft_base_s: float = 0.05
    """Prior: TTFT of an empty prompt on an idle target (the API server, one step)."""
    prefill_s_per_1k_tokens: float = 0.1
    """Prior: seconds to prefill 1,000 prompt tokens (own and queued alike)."""
    load_s_per_1k_tokens: float = 0.02
    """Prior: seconds to load 1,000 cached tokens from a tier below the GPU."""
    ttft_s_per_10_decoding: float = 0.01
    """Prior: TTFT added by ten requests decoding there (their share of each step)."""
    tpot_base_s: float = 0.02
    """Prior: TPOT of a lone request."""
    tpot_s_per_10_decoding: float = 0.005
    """Prior: TPOT added by ten more requests decoding beside it."""
    tpot_s_per_1k_prefill: float = 0.002
    """Prior: TPOT added by 1,000 prompt tokens to prefill there (chunks sharing its steps)."""
    prior_variance: float = 10.0
    """How loosely the prior is held (each coefficient's variance, in relative-error units): large
    learns fast from few observations; small trusts the prior longer."""
    forgetting: float = 0.998
    """Weight kept by the past at each observation (1: never forget; 0.998: a memory of about 500)."""
    warmup: int = 16
    """TTFT observations a target's model needs before it is trusted (warm)."""
    outlier_ratio: float = 4.0
    """A warm model's observation further than this factor from its prediction is clipped to it."""
    cold_outlier_ratio: float = 20.0
    """The same bound while the model is cold (the prior may be far off)."""
    robust_error: float = 0.5
    """Relative error under which an observation weighs fully; past it, its weight falls as 1 / its
    error, so the fit minimises the absolute relative error (what MAPE measures: nearer the median than
    the mean) and a far-off observation moves it little.  0: every observation weighs alike (the squared
    relative error).  Why 0.5: docs/predicted-latency.md, "The model"."""
    max_latency_s: float = 600.0
    """Longer observations are dropped as wild (a clock jump, a stream that never ended)."""
    max_pending: int = 100_000
    """Requests awaiting their first token or end that are remembered (the oldest are forgotten)."""

    def validate(self) -> None:
        positive = (
            ("ttft_base_s", self.ttft_base_s),
            ("tpot_base_s", self.tpot_base_s),
            ("prior_variance", self.prior_variance),
            ("max_latency_s", self.max_latency_s),
        )
        for name, v in positive:
            if not v > 0:
                raise ValueError(f"model.{name} must be > 0")
        if not 0 < self.forgetting <= 1:
            raise ValueError("model.forgetting must be in (0, 1]")
        if self.outlier_ratio <= 1 or self.cold_outlier_ratio <= 1:
            raise ValueError("model.outlier_ratio and model.cold_outlier_ratio must be > 1")
        if not 0 <= self.robust_error < math.inf:
            raise ValueError("model.robust_error must be >= 0 and finite")
        if self.warmup < 0 or self.max_pending < 1:
            raise ValueError("model.warmup must be >= 0 and model.max_pending >= 1")

    def prior(self, kind: str) -> tuple[float, ...]:
        if kind == TTFT:
            p = self.prefill_s_per_1k_tokens
            return (
                self.ttft_base_s,
                p,
                self.load_s_per_1k_tokens,
                p,
                self.ttft_s_per_10_decoding,
                0.0,
                0.0,
                0.0,
            )
        return (self.tpot_base_s, self.tpot_s_per_10_decoding, self.tpot_s_per_1k_prefill, 0.0)


MAX_TRACE = 1e6
"""Bound on the covariance's trace (forgetting with features that do not vary grows it without end)."""
FLOOR_S = 1e-3
"""Observed times below this weigh as this (the relative-error weight stays finite)."""


class Rls:
    """One linear model, ``y ~ theta . x``, fitted by weighted recursive least squares with forgetting:
    after observations (x_i, y_i, w_i) it holds the minimiser of
    ``sum_i lam^(n-i) w_i (y_i - theta.x_i)^2 + lam^n (theta - theta0)' P0^-1 (theta - theta0)``.
    ``buf``: where theta and P live (d + d*d floats, already holding them), e.g. a row of memory the host's
    worker processes share; None: this process's own arrays."""

    __slots__ = ("_coef", "lam", "p", "shared", "theta")

    def __init__(
        self, theta0: tuple[float, ...], variance: float, forgetting: float, buf: np.ndarray | None = None
    ) -> None:
        d = len(theta0)
        self.shared = buf is not None
        if buf is None:
            self.theta = np.array(theta0, dtype=np.float64)
            self.p = np.eye(d) * variance
        else:
            self.theta = buf[:d]
            self.p = buf[d : d + d * d].reshape(d, d)
        self.lam = forgetting
        self._coef: tuple[float, ...] = tuple(self.theta.tolist())

    @staticmethod
    def initial(theta0: tuple[float, ...], variance: float) -> list[float]:
        """What ``buf`` holds before any observation: theta0, then P0 (row-major)."""
        d = len(theta0)
        return [*theta0, *(np.eye(d) * variance).ravel().tolist()]

    @property
    def coef(self) -> tuple[float, ...]:
        """``theta`` as floats: what ``predict`` reads (a tuple dot product beats numpy at this size); read
        afresh when shared (another process may have trained it)."""
        return tuple(self.theta.tolist()) if self.shared else self._coef

    def predict(self, x: tuple[float, ...]) -> float:
        coef = tuple(self.theta.tolist()) if self.shared else self._coef  # not through the property: hot
        return sum(a * b for a, b in zip(coef, x))

    def set(self, theta: tuple[float, ...]) -> None:
        """Hold ``theta`` (a recorded fit, say), P unchanged."""
        self.theta[:] = theta
        self._coef = tuple(self.theta.tolist())

    def update(self, x: tuple[float, ...], y: float, w: float = 1.0) -> None:
        """One observation ``y`` at ``x`` with weight ``w`` (> 0); in place (under the host's lock when
        shared: an update reads, then writes)."""
        xs = np.array(x, dtype=np.float64) * math.sqrt(w)
        ys = y * math.sqrt(w)
        px = self.p @ xs
        gain = px / (self.lam + xs @ px)
        self.theta[:] = self.theta + gain * (ys - xs @ self.theta)
        self.p[:] = (self.p - np.outer(gain, px)) / self.lam
        tr = float(np.trace(self.p))
        if tr > MAX_TRACE:
            self.p *= MAX_TRACE / tr
        self._coef = tuple(self.theta.tolist())


TTFT_D, TPOT_D = 8, 4
SHARED_WORDS = 3 + TTFT_D + TTFT_D**2 + TPOT_D + TPOT_D**2
"""One target's models in shared memory: [initialised, TTFT observations, TPOT observations, TTFT theta
and P, TPOT theta and P]."""


class StoreLock(Protocol):
    """A lock the processes sharing the models share (``kvrouter.host.memory.HostLock``)."""

    def __enter__(self) -> object: ...

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None, /
    ) -> object: ...


class ModelStore(Protocol):
    """Where targets' models live when several processes learn them together (``kvrouter.host``)."""

    @property
    def lock(self) -> StoreLock:
        """Held while a model is initialised or trained."""

    def row(self, target: TargetKey) -> np.ndarray | None:
        """``target``'s row of ``SHARED_WORDS`` float64 (zeros until initialised); None: kept locally."""


class TargetModel:
    """A target's two models and how many observations trained each (in ``row`` when shared)."""

    __slots__ = ("models", "row", "seen")

    def __init__(self, cfg: LatencyModelConfig, row: np.ndarray | None = None) -> None:
        self.row = row
        self.seen = dict.fromkeys(KINDS, 0)
        if row is None:
            self.models = {k: Rls(cfg.prior(k), cfg.prior_variance, cfg.forgetting) for k in KINDS}
            return
        a, b = 3, 3 + TTFT_D + TTFT_D**2
        if not row[0]:  # the first process to see this target writes the prior (under the store's lock)
            row[a:b] = Rls.initial(cfg.prior(TTFT), cfg.prior_variance)
            row[b:] = Rls.initial(cfg.prior(TPOT), cfg.prior_variance)
            row[0] = 1.0
        self.models = {
            TTFT: Rls(cfg.prior(TTFT), cfg.prior_variance, cfg.forgetting, row[a:b]),
            TPOT: Rls(cfg.prior(TPOT), cfg.prior_variance, cfg.forgetting, row[b:]),
        }

    def count(self, kind: str) -> int:
        """Observations that trained the ``kind`` model (every process's, when shared)."""
        return int(self.row[1 + KINDS.index(kind)]) if self.row is not None else self.seen[kind]

    def counted(self, kind: str) -> None:
        if self.row is not None:
            self.row[1 + KINDS.index(kind)] += 1
        else:
            self.seen[kind] += 1


def ttft_features(num_tokens: int, c: Candidate) -> tuple[float, ...]:
    offload = c.hit_tokens * c.offload_blocks // c.matched_blocks if c.matched_blocks else 0
    uncached = max(0, num_tokens - c.hit_tokens)
    u, q, d = uncached / 1e3, c.pending_prefill_tokens / 1e3, c.decoding / 10
    h = c.hit_tokens / 1e3
    return (1.0, u, offload / 1e3, q, d, h - offload / 1e3, (u + q) * d, u * (h + u / 2) / 100)


def received(c: Candidate, num_tokens: int) -> Candidate:
    """``c`` as a disaggregated request's decode instance sees it: the whole prompt received, none of it
    computed there.  The decode leg is learned from (``Router.dispatched``) and predicted for
    (``DisaggPlanner.predicted_plan``) through this one view."""
    return msgspec.structs.replace(c, hit_tokens=num_tokens)


def tpot_features(num_tokens: int, c: Candidate) -> tuple[float, ...]:
    uncached = max(0, num_tokens - c.hit_tokens)
    prefilling = max(0, c.in_flight - c.decoding)
    return (1.0, (c.decoding + 1) / 10, (c.pending_prefill_tokens + uncached) / 1e3, prefilling / 10)


@dataclass(slots=True)
class _Pending:
    target: TargetKey
    sent: float
    x_ttft: tuple[float, ...]
    x_tpot: tuple[float, ...]
    pred_ttft: float
    pred_tpot: float
    warm: bool
    first: float | None = None
    ttft: bool = True
    """Its time to first token is the target's to learn (not a decode leg's: that is the prefill's)."""


class Observation(msgspec.Struct, frozen=True):
    """One observed time against what was predicted for it at dispatch."""

    target: TargetKey
    kind: str
    observed_s: float
    predicted_s: float
    warm: bool
    """The target's model was warm when the prediction was made."""
    outcome: Outcome = "used"


class ErrorStats(msgspec.Struct):
    """Absolute percentage errors of warm predictions, by kind."""

    n: int = 0
    sum_ape: float = 0.0

    @property
    def mape(self) -> float | None:
        return self.sum_ape / self.n if self.n else None


class LatencyBook:
    """Every target's latency models, the requests awaiting observation and the observations awaiting
    training.  Pure: the caller passes every time."""

    def __init__(self, cfg: LatencyModelConfig | None = None, store: ModelStore | None = None) -> None:
        """``store``: where the models live when the host's worker processes learn them together (each
        trains what it observed; all predict from the same models); None: this process's own."""
        self.cfg = cfg or LatencyModelConfig()
        self.store = store
        self.targets: dict[TargetKey, TargetModel] = {}
        self._pending: dict[RequestId, _Pending] = {}
        self._queue: list[tuple[Observation, tuple[float, ...]]] = []
        self.outcomes: Counter[tuple[str, str]] = Counter()
        """Observations by (kind, outcome)."""
        self.errors = {k: ErrorStats() for k in KINDS}
        self.samples: list[tuple[str, str, float, float]] | None = None
        """A list (the evaluator's plots): each warm observation's (target, kind, predicted, observed)."""

    def model(self, target: TargetKey) -> TargetModel:
        m = self.targets.get(target)
        if m is None:
            store = self.store
            row = store.row(target) if store is not None else None
            if store is None or row is None:
                m = TargetModel(self.cfg)
            else:
                with store.lock:  # the first process to see the target writes its prior
                    m = TargetModel(self.cfg, row)
            self.targets[target] = m
        return m

    def warm(self, target: TargetKey) -> bool:
        m = self.targets.get(target)
        return m is not None and m.count(TTFT) >= self.cfg.warmup

    def predict(self, num_tokens: int, c: Candidate) -> tuple[float, float]:
        """(TTFT, TPOT) in seconds for a request of ``num_tokens`` sent to ``c`` now (never below 0)."""
        m = self.targets.get(c.target) or self.model(c.target)
        ttft = m.models[TTFT].predict(ttft_features(num_tokens, c))
        tpot = m.models[TPOT].predict(tpot_features(num_tokens, c))
        return max(0.0, ttft), max(0.0, tpot)

    def prefill_s(self, num_tokens: int, c: Candidate) -> float:
        """The part of ``c``'s predicted TTFT that is this prompt's own prefill (uncached and loaded), in
        [0, predicted TTFT].  The bound is not cosmetic: observations at one prompt length cannot tell the
        intercept from the per-token slope, so a fit may carry a large slope against a negative intercept
        (the TTFT right, its split wrong); the prompt's own share is never more than the whole."""
        rls = self.model(c.target).models[TTFT]
        coef = rls.coef
        x = ttft_features(num_tokens, c)
        own = coef[1] * x[1] + coef[2] * x[2] + coef[6] * x[1] * x[4] + coef[7] * x[7]
        return min(max(0.0, own), max(0.0, rls.predict(x)))

    # ------------------------------------------------------------------ observing
    def dispatched(
        self, rid: RequestId, num_tokens: int, chosen: Candidate, now: float, *, ttft: bool = True
    ) -> None:
        """``rid`` was sent to ``chosen`` at ``now``: remember what was known and predicted.  Not ``ttft``:
        only its time per output token is observed (a disaggregated request's decode leg)."""
        if len(self._pending) >= self.cfg.max_pending:
            del self._pending[next(iter(self._pending))]
        m = self.model(chosen.target)
        xa, xb = ttft_features(num_tokens, chosen), tpot_features(num_tokens, chosen)
        pa = max(0.0, m.models[TTFT].predict(xa))
        pb = max(0.0, m.models[TPOT].predict(xb))
        warm = m.count(TTFT) >= self.cfg.warmup
        self._pending.pop(rid, None)
        self._pending[rid] = _Pending(chosen.target, now, xa, xb, pa, pb, warm, ttft=ttft)

    def first_token(self, rid: RequestId, now: float) -> Observation | None:
        p = self._pending.get(rid)
        if p is None or p.first is not None:
            return None
        p.first = now
        if not p.ttft:
            return None
        return self._observe(Observation(p.target, TTFT, now - p.sent, p.pred_ttft, p.warm), p.x_ttft)

    def unary(self, rid: RequestId) -> Observation | None:
        """``rid``'s answer came whole (not streamed): its first byte is its last, so neither its TTFT nor
        its pace can be observed.  Forgotten, counted as ``unary`` under the kind it would have taught."""
        p = self._pending.pop(rid, None)
        if p is None:
            return None
        return self._untaught(p, TTFT if p.ttft else TPOT, "unary")

    def finished(self, rid: RequestId, now: float, output_tokens: int | None) -> Observation | None:
        """``rid`` ended: with its first token seen and ``output_tokens`` >= 2, its mean time per later
        token is observed; with its first token seen and fewer (or none reported), counted as
        ``no_pace``.  Forgotten either way."""
        p = self._pending.pop(rid, None)
        if p is None or p.first is None:
            return None
        if output_tokens is None or output_tokens < 2:
            return self._untaught(p, TPOT, "no_pace")
        tpot = (now - p.first) / (output_tokens - 1)
        return self._observe(Observation(p.target, TPOT, tpot, p.pred_tpot, p.warm), p.x_tpot)

    def forget(self, rid: RequestId) -> None:
        self._pending.pop(rid, None)

    def _untaught(self, p: _Pending, kind: str, outcome: Outcome) -> Observation:
        o = Observation(
            p.target, kind, math.nan, p.pred_ttft if kind == TTFT else p.pred_tpot, p.warm, outcome
        )
        self.outcomes[(kind, outcome)] += 1
        return o

    def _observe(self, o: Observation, x: tuple[float, ...]) -> Observation:
        y = o.observed_s
        if not math.isfinite(y) or y <= 0 or y > self.cfg.max_latency_s:
            o = msgspec.structs.replace(o, outcome="invalid")
            self.outcomes[(o.kind, o.outcome)] += 1
            return o
        if o.warm and o.predicted_s > 0:
            e = self.errors[o.kind]
            e.n += 1
            e.sum_ape += abs(o.predicted_s - y) / y
            if self.samples is not None:
                self.samples.append((o.target, o.kind, o.predicted_s, y))
        self._queue.append((o, x))
        return o

    @property
    def pending_training(self) -> int:
        return len(self._queue)

    def train(self) -> list[tuple[str, Outcome]]:
        """Fit every queued observation into its target's model; each one's (kind, outcome)."""
        queue, self._queue = self._queue, []
        return [(o.kind, self._learn(o, x)) for o, x in queue]

    def _learn(self, o: Observation, x: tuple[float, ...]) -> str:
        m = self.model(o.target)
        if m.row is not None and self.store is not None:
            with self.store.lock:
                outcome = self._fit(m, o, x)
        else:
            outcome = self._fit(m, o, x)
        self.outcomes[(o.kind, outcome)] += 1
        return outcome

    def _fit(self, m: TargetModel, o: Observation, x: tuple[float, ...]) -> str:
        rls = m.models[o.kind]
        warm = m.count(TTFT) >= self.cfg.warmup
        ratio = self.cfg.outlier_ratio if warm else self.cfg.cold_outlier_ratio
        pred = rls.predict(x)
        y = o.observed_s
        outcome = "used"
        if pred > 0 and not pred / ratio <= y <= pred * ratio:
            y = min(max(y, pred / ratio), pred * ratio)
            outcome = "clipped"
        w = 1.0 / max(y, FLOOR_S) ** 2
        if self.cfg.robust_error:  # iteratively reweighted: |r| / y = r^2 / y^2 / (|r| / y)
            w /= max(abs(max(pred, 0.0) - y) / max(y, FLOOR_S), self.cfg.robust_error)
        rls.update(x, y, w)
        m.counted(o.kind)
        return outcome

    def state(self) -> dict[str, object]:
        """Each target's coefficients, observation counts and warmth; the error and outcome counts."""
        return {
            "targets": {
                t: {
                    "warm": m.count(TTFT) >= self.cfg.warmup,
                    "observations": {k: m.count(k) for k in KINDS},
                    "shared": m.row is not None,
                    "ttft_coef": [round(v, 6) for v in m.models[TTFT].coef],
                    "tpot_coef": [round(v, 6) for v in m.models[TPOT].coef],
                }
                for t, m in self.targets.items()
            },
            "mape": {k: e.mape for k, e in self.errors.items()},
            "outcomes": {f"{k}:{o}": n for (k, o), n in sorted(self.outcomes.items())},
        }
