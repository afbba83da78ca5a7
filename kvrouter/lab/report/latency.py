"""Routing by predicted latency on mixed and uniform fleets (issue 33), as a notebook's cases, tables and
figures.

``study_cases(scale)``: the Mooncake conversation trace's first 1,200 requests on four instances, mixed
(two H100 instances and two A100 instances of the same model) and uniform (four H100s), at the trace's
rate x0.33 ("1x" for this fleet) and x1.0 ("3x"), kv-aware against predicted-latency, with the
pooled-cache bound, per-request TTFTs and every warm prediction kept (``series``).  ``ratio_table`` sets
predicted-latency beside kv-aware and the pooled run against the issue's targets; ``prediction_scatter``
draws predicted against observed TTFT per instance; ``error_table`` gives the error per instance.

``pd_cases(scale)``: the same trace's first 1,000 requests on a mixed 2P2D fleet (an H100 and an A100
instance in each pool) at half the trace's rate and at its rate, split or whole by the conditional rules
against the latency models (``routing.disaggregation.mode: predicted``); ``pd_table`` sets them side by
side against the issue's target (within both objectives, at least conditional's share).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kvrouter.lab.evaluation.compare import EvalSpec
from kvrouter.lab.evaluation.pd import pd_spec
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.report.grid import Case
from kvrouter.lab.report.plots import Chart
from kvrouter.lab.report.scale import Scale
from kvrouter.lab.report.tables import Table
from kvrouter.routing.disagg import parse_roles

Result = dict[str, Any]

H100, A100 = "llama-3.1-70b-8xh100", "llama-3.1-70b-8xa100"
FLEETS = {
    "mixed": FleetSimConfig(instances=4, profile=H100, profiles=[H100, H100, A100, A100]),
    "uniform": FleetSimConfig(instances=4, profile=H100),
}
RATES = (0.33, 1.0)
POLICIES = ("kv-aware", "predicted-latency")


def study_cases(scale: Scale) -> list[Case]:
    cases = []
    for name, fleet in FLEETS.items():
        for rate in RATES:
            spec = EvalSpec(
                workload="mooncake-conversation",
                overrides={"limit": 1200, "rate_multiplier": rate},
                fleet=fleet,
                policies=POLICIES,
                series=True,
            )
            cases.append(Case(name, scale.size(spec), x=rate))
    return cases


PD_SETUPS = ("conditional", "predicted")
PD_RATES = (0.5, 1.0)


def pd_cases(scale: Scale) -> list[Case]:
    """The mixed 2P2D fleet at ``PD_RATES``, each of ``PD_SETUPS`` (labelled ``2P2D <setup>``)."""
    fleet = FleetSimConfig(instances=4, profile=H100, profiles=[H100, A100, H100, A100])
    cases = []
    for rate in PD_RATES:
        spec = EvalSpec(
            workload="mooncake-conversation",
            overrides={"limit": 1000, "rate_multiplier": rate},
            fleet=fleet,
        )
        for setup in PD_SETUPS:
            cases.append(
                Case(
                    f"2P2D {setup}", pd_spec(scale.size(spec), setup, parse_roles("2P2D")), rate, bounds=False
                )
            )
    return cases


def pd_table(results: Sequence[Result]) -> Table:
    """Per rate and setup: the share within both objectives, TTFT, TPOT, output throughput, and how many
    requests the models' own plans decided (``predicted_*`` reasons)."""
    rows = []
    for r in sorted(results, key=lambda r: (r["x"], r["label"])):
        (p,) = r["policies"].values()
        reasons = p.get("pd_reasons", {})
        n = sum(reasons.values()) or 1
        by_models = sum(v for k, v in reasons.items() if k.startswith("predicted_")) / n
        rows.append(
            [
                f"x{r['x']:g}",
                r["label"].removeprefix("2P2D "),
                p["slo_attainment"],
                p["ttft_p50_s"],
                p["ttft_p90_s"],
                p["tpot_p90_s"],
                p["throughput_tok_s"],
                p["split_fraction"],
                by_models,
            ]
        )
    cols = [
        "rate",
        "setup",
        "within SLO",
        "TTFT p50",
        "p90",
        "TPOT p90",
        "out tok/s",
        "split",
        "by the models",
    ]
    formats = ["str", "str", "pct", "s", "s", "s", "tok", "pct", "pct"]
    return Table(cols, formats, rows, "mixed 2P2D: split or whole by the conditional rules or by the models")


def ratio_table(results: Sequence[Result]) -> Table:
    """Per fleet and rate: each policy's mean and p90 TTFT and hit rate, predicted-latency's ratios to
    kv-aware (targets: at most 0.8 on the mixed fleet, 1.02 on the uniform one), to the pooled-cache run
    (1.2 mean, 1.3 p90) and its TTFT prediction error (MAPE, target 0.10)."""
    rows = []
    for r in results:
        kv, pl = r["policies"]["kv-aware"], r["policies"]["predicted-latency"]
        pooled = r["bounds"].get("pooled_cache_run", {})
        rows.append(
            [
                r["label"],
                f"x{r['x']:g}",
                kv["ttft_mean_s"],
                pl["ttft_mean_s"],
                pooled.get("ttft_mean_s", math.nan),
                pl["ttft_mean_s"] / kv["ttft_mean_s"],
                pl["ttft_p90_s"] / kv["ttft_p90_s"],
                pl["ttft_mean_s"] / pooled["ttft_mean_s"] if pooled else math.nan,
                pl["ttft_p90_s"] / pooled["ttft_p90_s"] if pooled else math.nan,
                pl["hit_rate"] / pooled["hit_rate"] if pooled and pooled["hit_rate"] else math.nan,
                pl["ttft_mape"] if pl["ttft_mape"] is not None else math.nan,
            ]
        )
    return Table(
        [
            "fleet",
            "rate",
            "kv-aware mean",
            "predicted mean",
            "pooled mean",
            "mean / kv-aware",
            "p90 / kv-aware",
            "mean / pooled",
            "p90 / pooled",
            "hit / pooled",
            "TTFT MAPE",
        ],
        ["str", "str", "s", "s", "s", "x", "x", "x", "x", "x", "x"],
        rows,
        title="predicted-latency against kv-aware and the pooled cache, same runs",
    )


def _samples(r: Result, policy: str) -> dict[str, np.ndarray]:
    by: dict[str, list[tuple[float, float]]] = {}
    for target, _kind, predicted, observed in r["policies"][policy].get("latency_samples", []):
        by.setdefault(target, []).append((predicted, observed))
    return {t: np.array(v) for t, v in sorted(by.items())}


def _profile_of(r: Result, target: str) -> str:
    fleet = r["fleet"]
    profiles = fleet.get("profiles") or [fleet["profile"]] * fleet["instances"]
    i = int("".join(ch for ch in target.split(":")[0] if ch.isdigit()) or 0)
    return str(profiles[i]).rsplit("-", 1)[-1] if i < len(profiles) else "?"


def error_table(results: Sequence[Result], policy: str = "predicted-latency") -> Table:
    """Per fleet, rate and instance: warm predictions, their MAPE and median ratio predicted / observed."""
    rows = []
    for r in results:
        for target, s in _samples(r, policy).items():
            ape = np.abs(s[:, 0] - s[:, 1]) / s[:, 1]
            rows.append(
                [
                    r["label"],
                    f"x{r['x']:g}",
                    target,
                    _profile_of(r, target),
                    len(s),
                    float(ape.mean()),
                    float(np.median(s[:, 0] / s[:, 1])),
                ]
            )
    return Table(
        ["fleet", "rate", "instance", "hardware", "predictions", "MAPE", "median predicted / observed"],
        ["str", "str", "str", "str", "int", "x", "x"],
        rows,
        title=f"{policy}'s warm TTFT predictions, per instance",
    )


def prediction_scatter(results: Sequence[Result], policy: str = "predicted-latency") -> Chart:
    """Predicted against observed TTFT of every warm prediction, one panel per fleet and rate, one colour
    per instance; the diagonal is a perfect prediction."""
    fig = Chart(figsize=(3.6 * len(results), 3.4))
    for k, r in enumerate(results):
        ax = fig.add_subplot(1, len(results), k + 1)
        lo, hi = math.inf, 0.0
        for target, s in _samples(r, policy).items():
            if not len(s):
                continue
            ax.scatter(s[:, 1], s[:, 0], s=3, alpha=0.4, label=f"{target} ({_profile_of(r, target)})")
            lo, hi = min(lo, float(s.min())), max(hi, float(s.max()))
        if hi > 0:
            lo = max(lo, hi / 1e4)
            ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):  # decades only, labelled plainly: 0.01, 0.1, 1, 10
                axis.set_major_locator(LogLocator(base=10, numticks=6))
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                axis.set_minor_formatter(NullFormatter())
            ax.set_xlim(lo, hi * 1.5)
            ax.set_ylim(lo, hi * 1.5)
        ax.set_title(f"{r['label']} x{r['x']:g}", fontsize=9)
        ax.set_xlabel("observed TTFT (s)")
        if k == 0:
            ax.set_ylabel("predicted TTFT (s)")
        if hi > 0:
            ax.legend(fontsize=6, markerscale=3)
    fig.tight_layout()
    return fig
