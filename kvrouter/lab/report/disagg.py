"""Disaggregated prefill and decode (notebook 4): the same instances aggregated, split, and split on
condition, on the Mooncake trace, long prompts and multi-turn chat.

::

    setup_cases(label, spec, roles) ─▶ one Case per setup (``evaluation.pd.pd_spec``) ─▶ run_grid
    by_setup(results)                ─▶ one result per label (and x), its "policies" keyed by setup:
                                        what tables.summary_table, plots.sweep and the CDFs below read
    setup_table(r)                      SLO attainment, hits, TTFT, TPOT, worst gap, throughput, split share
    reasons_table(results)              why conditional kept requests whole
    cdfs(r)                             per-request TTFT, TPOT and worst gap (runs with ``series=True``)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from matplotlib.axes import Axes

from kvrouter.lab.evaluation.compare import EvalSpec
from kvrouter.lab.evaluation.pd import DEFAULT_SETUPS, pd_spec
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.report import plots
from kvrouter.lab.report.grid import Case, with_param, with_rate
from kvrouter.lab.report.plots import Chart
from kvrouter.lab.report.scale import Scale
from kvrouter.lab.report.tables import Table
from kvrouter.routing.disagg import parse_roles, roles_label
from kvrouter.types import Role

Result = dict[str, Any]
SEP = " | "

MAIN_SETUPS = ("aggregated", "disaggregated", "conditional")


def base_spec(workload: str, overrides: dict[str, Any], scale: Scale, **fleet: Any) -> EvalSpec:
    """A workload on 4 Llama-3.1-70B instances (8 x H100 each), with per-request series, at ``scale``."""
    spec = EvalSpec(
        workload=workload,
        overrides=overrides,
        fleet=FleetSimConfig(instances=4, profile="llama-3.1-70b-8xh100", **fleet),
        series=True,
    )
    return scale.size(spec)


def setup_cases(
    label: str,
    spec: EvalSpec,
    roles: Sequence[Role],
    setups: Sequence[str] = DEFAULT_SETUPS,
    x: float | int | str | None = None,
) -> list[Case]:
    """One case per setup of ``spec`` on ``roles`` (no bounds: they do not depend on the setup)."""
    return [Case(f"{label}{SEP}{s}", pd_spec(spec, s, roles), x, bounds=False) for s in setups]


def rate_cases(
    label: str, spec: EvalSpec, roles: Sequence[Role], rates: Sequence[float], setups: Sequence[str]
) -> list[Case]:
    return [c for m in rates for c in setup_cases(label, with_rate(spec, m), roles, setups, x=m)]


def param_cases(
    label: str, spec: EvalSpec, roles: Sequence[Role], path: str, values: Sequence[Any], setup: str
) -> list[Case]:
    """``setup`` with the parameter at ``path`` (``disagg.local_prefill_tokens``...) at each value."""
    return [c for v in values for c in setup_cases(label, with_param(spec, path, v), roles, [setup], x=v)]


def by_setup(results: Sequence[Result]) -> list[Result]:
    """Results of ``setup_cases`` regrouped: one per (label, x), its ``policies`` keyed by setup."""
    out: dict[tuple[str, Any], Result] = {}
    for r in results:
        label, _, setup = str(r["label"]).rpartition(SEP)
        key = (label, r["x"])
        g = out.get(key)
        if g is None:
            g = out[key] = {**r, "label": label, "policies": {}}
            g["roles"] = roles_label(r["fleet"]["roles"]) if r["fleet"]["roles"] else None
        (run,) = r["policies"].values()
        g["policies"][setup] = run
        if r["fleet"]["roles"]:
            g["roles"] = roles_label(r["fleet"]["roles"])
    return list(out.values())


def case(results: Sequence[Result], label: str, x: Any = None) -> Result:
    return next(r for r in results if r["label"] == label and (x is None or r["x"] == x))


def sweep_of(
    results: Sequence[Result], label: str, base: Result, setups: Sequence[str] = MAIN_SETUPS
) -> list[Result]:
    """The points of the sweep ``label`` plus ``base`` (a case run once, at its own ``x``), in order of
    the swept value, each with ``setups`` only: what ``plots.sweep`` draws."""
    points = [r for r in results if r["label"] == label] + [base]
    out = [{**r, "policies": {k: v for k, v in r["policies"].items() if k in setups}} for r in points]
    return sorted(out, key=lambda r: r["x"])


# ---------------------------------------------------------------------------------------------- notebook 4
MOONCAKE = "Mooncake conversation"
MOONCAKE_2P2D = "Mooncake conversation, 2P2D"
LOAD = "Mooncake load"
LONG = "Long prompts"
CHAT = "Multi-turn chat"
THRESHOLD = "local_prefill_tokens"
BUSY = "prefill_busy_ratio"


def notebook_cases(scale: Scale) -> list[Case]:
    """Every run of notebook 4, on 4 instances (Llama-3.1-70B on 8 x H100 each):

    * the first 1,000 requests of the Mooncake conversation trace (13.7k prompt tokens, 350 output
      tokens a request on average) at its recorded rate, on 3 prefill + 1 decode instances, every setup;
      on 2 + 2, the split setups; at 0.5 and 1.5 times the rate, aggregated / disaggregated / conditional;
      conditional with other thresholds;
    * long prompts: 14k tokens, half of them one of 20 shared prefixes, 200 output tokens, 20 clients
      (Dynamo's prefix-ratio benchmark) on 2 + 2, every setup;
    * multi-turn chat: 100 conversations of 5 turns (200-token turns and answers behind a 1k system
      prompt) on 2 + 2.
    """
    p3d1, p2d2 = parse_roles("3P1D"), parse_roles("2P2D")
    moon = base_spec("mooncake-conversation", {"limit": 1000}, scale)
    rates = [0.5, 1.5] if scale.points is None else [1.5]
    return [
        *setup_cases(MOONCAKE, moon, p3d1, x=1.0),
        *setup_cases(MOONCAKE_2P2D, moon, p2d2, ["disaggregated", "conditional"], x=1.0),
        *rate_cases(LOAD, moon, p3d1, rates, MAIN_SETUPS),
        *param_cases(THRESHOLD, moon, p3d1, "disagg.local_prefill_tokens", [512, 8192], "conditional"),
        *param_cases(BUSY, moon, p3d1, "disagg.prefill_busy_ratio", [0.0, 16.0], "conditional"),
        *setup_cases(LONG, base_spec("dynamo-prefix-ratio", {}, scale), p2d2),
        *setup_cases(CHAT, base_spec("multi-turn", {"num_conversations": 100}, scale), p2d2, MAIN_SETUPS),
    ]


def setup_table(r: Result, title: str = "") -> Table:
    rows = [
        [
            name,
            p["slo_attainment"],
            p["hit_rate"],
            p["ttft_p50_s"],
            p["ttft_p90_s"],
            p["tpot_p50_s"],
            p["tpot_p90_s"],
            p["itl_max_p90_s"],
            p["throughput_tok_s"],
            p["split_fraction"],
        ]
        for name, p in r["policies"].items()
    ]
    cols = ["setup", "within SLO", "hit rate", "TTFT p50", "p90", "TPOT p50", "p90", "worst gap p90",
            "out tok/s", "split"]  # fmt: skip
    formats = ["str", "pct", "pct", "s", "s", "s", "s", "s", "tok", "pct"]
    head = f"{r['label']}: {r['requests']:,} requests on {r.get('roles') or r['instances']}"
    return Table(cols, formats, rows, title or head)


def reasons_table(results: Sequence[Result], setup: str = "conditional") -> Table:
    """Per case, the share of requests each plan reason covered under ``setup``."""
    reasons: dict[str, None] = {}
    for r in results:
        reasons.update(dict.fromkeys(r["policies"].get(setup, {}).get("pd_reasons", {})))
    rows = []
    for r in results:
        p = r["policies"].get(setup)
        if p is None:
            continue
        n = sum(p["pd_reasons"].values()) or 1
        x = "" if r["x"] is None else f" ({r['x']:g})" if isinstance(r["x"], int | float) else f" ({r['x']})"
        rows.append([f"{r['label']}{x}", *[p["pd_reasons"].get(k, 0) / n for k in reasons]])
    return Table(["case", *reasons], ["str", *["pct"] * len(reasons)], rows, f"{setup}: requests by reason")


_CDF_LABELS = {"ttft_s": "TTFT (s)", "tpot_s": "time per output token (s)", "itl_max_s": "worst gap (s)"}


def cdfs(r: Result, keys: Sequence[str] = ("ttft_s", "tpot_s", "itl_max_s")) -> Chart:
    """Per-request distributions of ``keys`` (series of runs with ``series=True``) side by side, one line
    per setup: time to first token, mean time per later token, and the worst gap between two tokens."""

    def draw(key: str) -> Callable[[Axes], object]:
        def one(ax: Axes) -> None:
            plots.series_cdf(r, key, _CDF_LABELS.get(key, key), ax)
            ax.set_title(f"{r['label']} on {r.get('roles') or r['instances']}", fontsize=9)

        return one

    return plots.panels([draw(k) for k in keys], cols=len(keys))
