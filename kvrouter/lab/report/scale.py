"""How big the notebooks' runs are: ``full`` (the committed outputs) or ``small`` (the test suite).

The notebooks read ``KVROUTER_NOTEBOOK_SCALE`` through ``scale_from_env`` in their first code cell, so the
test suite can execute every notebook in seconds with the very cells that produced the committed figures.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from kvrouter.lab.evaluation.compare import EvalSpec
from kvrouter.lab.workloads.arrivals import Staged
from kvrouter.lab.workloads.registry import make_workload, workload_params

ENV_VAR = "KVROUTER_NOTEBOOK_SCALE"
T = TypeVar("T")


class Scale(msgspec.Struct, frozen=True):
    """Sizes of every study, as fractions of the full-scale request counts."""

    name: str
    """``full`` or ``small``."""
    fraction: float
    """Request counts (or staged-arrival durations) are multiplied by this."""
    min_requests: int
    """No workload is cut below this many requests (or 1/5 as many conversations)."""
    jobs: int | None
    """Worker processes (None: one per core; 1: in this process, no pool to start)."""
    points: int | None = None
    """Values per sweep (None: all); fewer keep the first and the last."""

    def size(self, spec: EvalSpec) -> EvalSpec:
        """``spec`` at this scale (``sized(spec, fraction)``)."""
        return spec if self.fraction == 1.0 else sized(spec, self.fraction, self.min_requests)

    def values(self, values: Sequence[T]) -> list[T]:
        """The sweep values run at this scale: all, or ``points`` of them spread from first to last."""
        vals = list(values)
        if self.points is None or len(vals) <= self.points:
            return vals
        if self.points < 2:
            return vals[:1]
        step = (len(vals) - 1) / (self.points - 1)
        return [vals[round(i * step)] for i in range(self.points)]


SCALES: Mapping[str, Scale] = {
    "full": Scale("full", 1.0, 1, None),
    # Tiny runs cost less than starting a process pool (workers import the engine and the indexer).
    "small": Scale("small", 0.02, 12, 1, points=2),
}


def scale_from_env(environ: Mapping[str, str] | None = None) -> Scale:
    """The scale named by ``KVROUTER_NOTEBOOK_SCALE`` (default ``full``).  Raises ``ValueError``."""
    env = os.environ if environ is None else environ
    name = env.get(ENV_VAR, "full").strip().lower() or "full"
    try:
        return SCALES[name]
    except KeyError:
        raise ValueError(f"{ENV_VAR}={name!r}: choose from {', '.join(SCALES)}") from None


def sized(spec: EvalSpec, fraction: float, min_requests: int = 1) -> EvalSpec:
    """``spec`` with about ``fraction`` of its workload's requests, keeping the workload's shape.

    A staged schedule keeps its rates and shortens every stage (its later, busier stages survive); a
    multi-turn workload keeps its turns and loses conversations (the multimodal agent: sessions and
    questions); a trace keeps its first requests;
    anything else keeps its arrival process and loses requests."""
    if spec.workload is None:
        raise ValueError("sized needs a named workload")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    params = workload_params(spec.workload, **spec.overrides)
    fields = params.__struct_fields__
    arrival = getattr(params, "arrival", None)
    over: dict[str, Any]
    if "limit" in fields:  # a trace
        limit = getattr(params, "limit", None)
        total = limit if limit is not None else len(make_workload(spec.workload).requests)
        over = {"limit": max(min_requests, round(total * fraction))}
    elif "num_conversations" in fields:
        turns = max(1, int(getattr(params, "turns", 1)))
        n = max(-(-min_requests // turns), round(getattr(params, "num_conversations", 0) * fraction))
        over = {"num_conversations": n}
    elif "num_sessions" in fields:  # sessions keep their turns; questions are cut alike
        over = {
            k: max(min_requests if k == "num_questions" else 1, round(getattr(params, k) * fraction))
            for k in ("num_sessions", "num_questions")
        }
    elif isinstance(arrival, Staged) and getattr(params, "num_requests", None) is None:
        n = len(make_workload(spec.workload, **spec.overrides).requests)
        f = max(fraction, min(1.0, min_requests / max(n, 1)))
        stages = [{"rate": s.rate, "duration_s": s.duration_s * f} for s in arrival.stages]
        over = {"arrival": {"type": "staged", "stages": stages, "poisson": arrival.poisson}}
    else:
        n = getattr(params, "num_requests", None)
        if n is None:
            n = len(make_workload(spec.workload, **spec.overrides).requests)
        over = {"num_requests": max(min_requests, round(n * fraction))}
    return msgspec.structs.replace(spec, overrides={**spec.overrides, **over})
