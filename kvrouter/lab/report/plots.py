"""Figures from evaluation results (matplotlib, object API only).

Every function returns a ``Chart``, a ``matplotlib.figure.Figure`` built without ``pyplot`` that renders
itself as PNG for Jupyter: no global figure registry to leak between notebook cells (a notebook shows the
returned figure once, and nothing else), no inline backend to activate, no GUI backend in tests.
Per-request TTFTs and load samples come from runs made with ``series=True``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kvrouter.lab.evaluation.pd import SETUPS
from kvrouter.lab.report.tables import policies_of
from kvrouter.routing import ALL_POLICIES

Result = dict[str, Any]

LABELS = {
    "hit_rate": "token cache hit rate",
    "ttft_p50_s": "TTFT p50 (s)",
    "ttft_p90_s": "TTFT p90 (s)",
    "ttft_p99_s": "TTFT p99 (s)",
    "ttft_mean_s": "mean TTFT (s)",
    "throughput_tok_s": "output tokens/s",
    "max_over_mean_load": "busiest / mean instance work",
    "slo_attainment": "within SLO (TTFT and TPOT)",
    "tpot_p50_s": "TPOT p50 (s)",
    "tpot_p90_s": "TPOT p90 (s)",
    "itl_max_p90_s": "worst gap p90 (s)",
}
_LOG_METRICS = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "itl_max_p90_s"}


class Chart(Figure):
    """A figure that Jupyter shows as PNG (``_repr_png_``)."""

    def _repr_png_(self) -> bytes:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(self)
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=90)
        return buf.getvalue()


def _colors(policies: Sequence[str]) -> dict[str, Any]:
    # Fixed colours per policy (and disaggregation setup) name, so every figure of every notebook agrees.
    fixed = [*ALL_POLICIES, *SETUPS]
    names = fixed + [p for p in policies if p not in fixed]
    return {p: f"C{i % 10}" for i, p in enumerate(names)}


def _grid(n: int, cols: int, w: float = 3.6, h: float = 2.8) -> tuple[Chart, list[Axes]]:
    cols = max(1, min(cols, n))
    rows = max(1, math.ceil(n / cols))
    fig = Chart(figsize=(w * cols, h * rows), layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def _plain_log(axis: Axis) -> None:
    """Log-axis ticks as plain numbers (0.1, 0.2, 0.5, 1, ...), without minor labels."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _series(p: Result, key: str) -> Any:
    s = p.get("series")
    if s is None:
        raise ValueError("this figure needs runs made with EvalSpec(series=True)")
    return s[key]


def ttft_cdf(r: Result, ax: Axes | None = None) -> Chart | None:
    """Cumulative distribution of TTFT per policy (log time axis)."""
    return series_cdf(r, "ttft_s", "TTFT (s)", ax)


def series_cdf(r: Result, key: str, x_label: str, ax: Axes | None = None) -> Chart | None:
    """Cumulative distribution of a per-request series (``ttft_s``, ``tpot_s``, ``itl_max_s``) per policy
    (log axis)."""
    fig = None
    if ax is None:
        fig, (ax,) = _grid(1, 1, 6.0, 3.8)
    colors = _colors(list(r["policies"]))
    for name, p in r["policies"].items():
        t = np.sort(np.asarray(_series(p, key), dtype=float))
        if len(t):
            ax.step(np.maximum(t, 1e-3), np.arange(1, len(t) + 1) / len(t), where="post", label=name,
                    color=colors[name])  # fmt: skip
    ax.set_xscale("log")
    _plain_log(ax.xaxis)
    ax.set_ylim(0, 1.0)
    ax.set_xlabel(x_label)
    ax.set_ylabel("fraction of requests")
    ax.set_title(str(r.get("label") or r["workload"]), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if fig is not None:
        ax.legend(fontsize=8)
    return fig


def panels(draw: Sequence[Callable[[Axes], object]], cols: int = 3) -> Chart:
    """Panels side by side (each ``draw(ax)`` fills one), one legend for all."""
    fig, axes = _grid(len(draw), cols, 4.2, 3.2)
    for d, ax in zip(draw, axes):
        d(ax)
    legend: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    fig.legend(list(legend.values()), list(legend), loc="outside upper center", ncols=max(1, len(legend)),
               fontsize=9)  # fmt: skip
    return fig


def ttft_cdfs(results: Sequence[Result], cols: int = 4) -> Chart:
    """One TTFT CDF panel per case, one legend for all."""
    fig, axes = _grid(len(results), cols)
    for r, ax in zip(results, axes):
        ttft_cdf(r, ax)
    legend: dict[str, Any] = {}  # every policy of any panel, once
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    fig.legend(list(legend.values()), list(legend), loc="outside upper center", ncols=max(1, len(legend)),
               fontsize=9)  # fmt: skip
    return fig


def bars(results: Sequence[Result], metric: str = "hit_rate", *, log: bool | None = None) -> Chart:
    """Grouped bars: one group per case, one bar per policy; hit rates get the pooled-cache bound as a
    black tick over each group."""
    pols = policies_of(results)
    colors = _colors(pols)
    fig, (ax,) = _grid(1, 1, min(15.0, max(6.0, 1.1 * len(results) + 2)), 4.0)
    width = 0.8 / max(1, len(pols))
    x = np.arange(len(results))
    for k, p in enumerate(pols):
        vals = [r["policies"][p][metric] if p in r["policies"] else np.nan for r in results]
        ax.bar(x + (k - (len(pols) - 1) / 2) * width, vals, width, label=p, color=colors[p])
    if metric == "hit_rate":
        bound = [(r.get("bounds") or {}).get("pooled_cache", np.nan) for r in results]
        ax.hlines(bound, x - 0.42, x + 0.42, colors="black", linewidth=1.5, label="pooled-cache bound")
    if log if log is not None else metric in _LOG_METRICS:
        ax.set_yscale("log")
        _plain_log(ax.yaxis)
    ax.set_xticks(x, [str(r.get("label") or r["workload"]) for r in results], rotation=30, ha="right",
                  fontsize=8)  # fmt: skip
    ax.set_ylabel(LABELS.get(metric, metric))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncols=min(6, len(pols) + 1))
    return fig


def load_over_time(r: Result, *, policies: Sequence[str] | None = None) -> Chart:
    """Requests in flight on each instance over time, one panel per policy (shared axes)."""
    names = [p for p in (policies or list(r["policies"])) if p in r["policies"]]
    fig, axes = _grid(len(names), 2, 6.0, 2.6)
    top = 0.0
    for name, ax in zip(names, axes):
        p = r["policies"][name]
        t = np.asarray(_series(p, "load_times_s"), dtype=float)
        load = np.asarray(_series(p, "load_in_flight"), dtype=float)
        if load.size:
            ax.plot(t, load, linewidth=0.7)
            top = max(top, float(load.max()))
        ax.set_title(f"{name}: max/mean work {p['max_over_mean_load']:.2f}", fontsize=9)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("in flight per instance")
        ax.grid(True, alpha=0.3)
    for ax in axes:
        ax.set_ylim(0, top * 1.05 + 1)
    return fig


def sweep(
    results: Sequence[Result],
    metrics: Sequence[str] = ("hit_rate", "ttft_p90_s"),
    *,
    x_label: str = "",
    log_x: bool = False,
    references: Result | None = None,
) -> Chart:
    """Metric against the swept value, one line per policy; ``references`` (a result run once, e.g. the
    policies a parameter cannot affect) are drawn as dashed horizontal lines; the pooled-cache bound as a
    dotted black line when the cases ran it."""
    pols = policies_of(results)
    refs = [p for p in (references or {}).get("policies", {}) if p not in pols]
    colors = _colors(pols + refs)
    fig, axes = _grid(len(metrics), len(metrics), 4.6, 3.2)
    numeric = all(isinstance(r["x"], int | float) for r in results)
    xs: list[Any] = [r["x"] if numeric else i for i, r in enumerate(results)]
    for m, ax in zip(metrics, axes):
        for p in pols:
            ys = [r["policies"][p][m] if p in r["policies"] else np.nan for r in results]
            ax.plot(xs, ys, marker="o", label=p, color=colors[p])
        for p in refs:
            assert references is not None
            ax.axhline(
                references["policies"][p][m], linestyle="--", color=colors[p], label=f"{p} (any value)"
            )
        if m == "hit_rate" and any(r.get("bounds") for r in results):
            ys = [(r.get("bounds") or {}).get("pooled_cache", np.nan) for r in results]
            ax.plot(xs, ys, linestyle=":", color="black", label="pooled-cache bound")
        if log_x and numeric:
            positive = [float(x) for x in xs if x > 0]
            if len(positive) == len(xs):
                ax.set_xscale("log")
            else:  # a zero among the values: linear up to the smallest positive one, log beyond
                ax.set_xscale("symlog", linthresh=min(positive) if positive else 1.0)
                ax.set_xlim(left=0.0)
        # Ticks exactly at the swept values, labelled as given.
        ax.set_xticks(xs, [f"{r['x']:g}" if numeric else str(r["x"]) for r in results])
        ax.xaxis.set_minor_formatter(NullFormatter())
        if m in _LOG_METRICS:
            ax.set_yscale("log")
            _plain_log(ax.yaxis)
        ax.set_xlabel(x_label)
        ax.set_ylabel(LABELS.get(m, m))
        ax.grid(True, which="both", alpha=0.3)
    if axes:
        axes[0].legend(fontsize=8)
    return fig
