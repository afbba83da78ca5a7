"""Tables from evaluation results, as plain rows (no pandas), shown by Jupyter as Markdown.

::

    results (run_grid / evaluate) ──policy_table / summary_table / change_table / seeds_table──▶ Table
    Table.rows        raw values (tests and further code read these)
    Table.records()   [{column: value}]
    str(table)        aligned plain text;  table._repr_markdown_()  what a notebook shows

Changes are fractions relative to a baseline policy (``-0.5`` = half the baseline's value); figures others
published (``published.py``) are printed beside ours, never mixed into them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvrouter.lab.report.published import Reported

Result = dict[str, Any]

_FORMATS: dict[str, Callable[[Any], str]] = {
    "str": str,
    "int": lambda v: f"{int(v):,}",
    "pct": lambda v: f"{v * 100:.1f} %",
    "chg": lambda v: f"{v * 100:+.1f} %" if 0.995 <= abs(v) <= 1.0 else f"{v * 100:+.0f} %",  # not -100 %
    "s": lambda v: f"{v * 1e3:.0f} ms" if abs(v) < 1 else f"{v:.2f} s",
    "x": lambda v: f"{v:.2f}",
    "tok": lambda v: f"{v:,.0f}",
}


def fmt(value: Any, kind: str) -> str:
    """One cell as shown: None and NaN as an em dash, strings as they are."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, str):
        return value
    return _FORMATS[kind](value)


class Table:
    """Named columns, raw rows, one display format per column (keys of ``_FORMATS``)."""

    def __init__(
        self, columns: Sequence[str], formats: Sequence[str], rows: Sequence[Sequence[Any]], title: str = ""
    ) -> None:
        if len(columns) != len(formats):
            raise ValueError("one format per column")
        for r in rows:
            if len(r) != len(columns):
                raise ValueError(f"row {r!r} has {len(r)} cells for {len(columns)} columns")
        self.columns = list(columns)
        self.formats = list(formats)
        self.rows = [list(r) for r in rows]
        self.title = title

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r)) for r in self.rows]

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]

    def cells(self) -> list[list[str]]:
        return [[fmt(v, f) for v, f in zip(r, self.formats)] for r in self.rows]

    def __str__(self) -> str:
        body = [self.columns, *self.cells()]
        widths = [max(len(r[i]) for r in body) for i in range(len(self.columns))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
        return "\n".join([self.title, *lines] if self.title else lines)

    def _repr_markdown_(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "|".join(":---" if f == "str" else "---:" for f in self.formats) + "|"
        body = ["| " + " | ".join(r) + " |" for r in self.cells()]
        title = [f"**{self.title}**", ""] if self.title else []
        return "\n".join([*title, head, rule, *body])


def change(value: float, base: float) -> float:
    """Relative change of ``value`` against ``base`` (NaN when the base is 0 or missing)."""
    if base is None or value is None or base == 0 or math.isnan(base) or math.isnan(value):
        return float("nan")
    return value / base - 1.0


def describe_case(r: Result) -> str:
    b = r.get("bounds") or {}
    text = f"{r.get('label') or r['workload']}: {r['requests']:,} requests, {r['instances']} instances"
    if b:
        text += f"; reuse ceiling {b['reuse_ceiling']:.1%}, pooled-cache bound {b['pooled_cache']:.1%}"
    return text


def policy_table(r: Result) -> Table:
    """Every policy's figures on one case."""
    pooled = (r.get("bounds") or {}).get("pooled_cache")
    rows = []
    for name, p in r["policies"].items():
        rows.append(
            [
                name,
                p["hit_rate"],
                p["hit_rate"] / pooled if pooled else None,
                p["ttft_p50_s"],
                p["ttft_p90_s"],
                p["ttft_p99_s"],
                p["ttft_mean_s"],
                p["e2e_p50_s"],
                p["throughput_tok_s"],
                p["rejected"],
                p["max_over_mean_load"],
            ]
        )
    cols = ["policy", "hit rate", "of pooled", "TTFT p50", "p90", "p99", "mean", "e2e p50", "out tok/s",
            "rejected", "max/mean work"]  # fmt: skip
    formats = ["str", "pct", "pct", "s", "s", "s", "s", "s", "tok", "int", "x"]
    return Table(cols, formats, rows, describe_case(r))


METRIC_FORMAT = {
    "hit_rate": "pct",
    "ttft_p50_s": "s",
    "ttft_p90_s": "s",
    "ttft_p99_s": "s",
    "ttft_mean_s": "s",
    "e2e_p50_s": "s",
    "throughput_tok_s": "tok",
    "rejected": "int",
    "max_over_mean_load": "x",
    "slo_attainment": "pct",
    "tpot_p50_s": "s",
    "tpot_p90_s": "s",
    "itl_max_p90_s": "s",
    "split_fraction": "pct",
}


def policies_of(results: Sequence[Result]) -> list[str]:
    """Every policy that appears in any result, in first-seen order."""
    seen: dict[str, None] = {}
    for r in results:
        seen.update(dict.fromkeys(r["policies"]))
    return list(seen)


def summary_table(results: Sequence[Result], metric: str, *, title: str = "") -> Table:
    """One row per case, one column per policy; hit rates also get the two bounds."""
    pols = policies_of(results)
    bounds = metric == "hit_rate" and any(r.get("bounds") for r in results)
    rows = []
    for r in results:
        row: list[Any] = [r.get("label") or r["workload"], r["requests"], r["instances"]]
        row += [r["policies"][p][metric] if p in r["policies"] else None for p in pols]
        if bounds:
            b = r.get("bounds") or {}
            row += [b.get("pooled_cache"), b.get("reuse_ceiling")]
        rows.append(row)
    cols = ["case", "requests", "instances", *pols] + (["pooled bound", "reuse ceiling"] if bounds else [])
    kind = METRIC_FORMAT.get(metric, "x")
    formats = ["str", "int", "int", *[kind] * len(pols)] + ([kind, kind] if bounds else [])
    return Table(cols, formats, rows, title or metric)


def sweep_table(results: Sequence[Result], metric: str, *, x_name: str = "x", title: str = "") -> Table:
    """One row per swept value, one column per policy (and the pooled bound for hit rates, if run)."""
    pols = policies_of(results)
    bounds = metric == "hit_rate" and any(r.get("bounds") for r in results)
    rows = []
    for r in results:
        row: list[Any] = [
            f"{r['x']:g}" if isinstance(r["x"], int | float) else str(r["x"]),
            *[r["policies"][p][metric] if p in r["policies"] else None for p in pols],
        ]
        if bounds:
            row.append((r.get("bounds") or {}).get("pooled_cache"))
        rows.append(row)
    kind = METRIC_FORMAT.get(metric, "x")
    cols = [x_name, *pols] + (["pooled bound"] if bounds else [])
    return Table(cols, ["str", *[kind] * (len(cols) - 1)], rows, title or metric)


CHANGE_METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "throughput_tok_s")


def change_table(r: Result, baseline: str, *, metrics: Sequence[str] = CHANGE_METRICS) -> Table:
    """Each policy against ``baseline``: its hit rate, and the relative change of ``metrics``."""
    base = r["policies"][baseline]
    rows = []
    for name, p in r["policies"].items():
        rows.append([name, p["hit_rate"], *[change(p[m], base[m]) for m in metrics]])
    cols = ["policy", "hit rate", *[f"Δ {m.removesuffix('_s').replace('_', ' ')}" for m in metrics]]
    return Table(
        cols, ["str", "pct", *["chg"] * len(metrics)], rows, f"change vs {baseline}; {describe_case(r)}"
    )


def published_table(
    r: Result,
    baseline: str,
    policies: Sequence[str],
    published: Mapping[str, Reported],
    *,
    published_name: str,
    published_hit: Mapping[str, float] | None = None,
    title: str = "",
) -> Table:
    """Rows per metric: our baseline's value, each policy's change against it, and the published change.

    Hit rates are shown as values (baseline -> policy), the rest as changes."""
    base = r["policies"][baseline]
    rows: list[list[Any]] = []
    names = {"ttft_p50_s": "median TTFT", "ttft_p90_s": "P90 TTFT", "throughput_tok_s": "throughput"}
    for m, rep in published.items():
        row: list[Any] = [names.get(m, m), fmt(base[m], METRIC_FORMAT.get(m, "x"))]
        row += [fmt(change(r["policies"][p][m], base[m]), "chg") for p in policies]
        rows.append([*row, rep.text()])
    hit: list[Any] = ["KV hit rate", fmt(base["hit_rate"], "pct")]
    hit += [fmt(r["policies"][p]["hit_rate"], "pct") for p in policies]
    if published_hit:
        vals = list(published_hit.values())
        hit.append(" -> ".join(f"{v:.0%}" for v in vals))
    else:
        hit.append("—")
    rows.append(hit)
    cols = ["metric", f"{baseline} (ours)", *[f"{p} (ours)" for p in policies], published_name]
    return Table(cols, ["str"] * len(cols), rows, title or describe_case(r))


def stacked_published_table(
    cases: Sequence[tuple[str, Result]],
    baseline: str,
    policies: Sequence[str],
    published: Mapping[str, Reported],
    *,
    published_name: str,
    published_hit: Mapping[str, float] | None = None,
    title: str = "",
) -> Table:
    """``published_table`` of several labelled cases (e.g. two models of one fleet), one block of rows
    per case, with the label in a first column."""
    if not cases:
        raise ValueError("no cases")
    rows: list[list[Any]] = []
    cols: list[str] = []
    for label, r in cases:
        t = published_table(
            r, baseline, policies, published, published_name=published_name, published_hit=published_hit
        )
        cols = ["case", *t.columns]
        rows += [[label, *row] for row in t.rows]
    return Table(cols, ["str"] * len(cols), rows, title)


def closest(results: Sequence[Result], policy: str, metric: str, target: float) -> Result:
    """The case whose ``policy`` came closest to ``target`` on ``metric`` (first on ties)."""
    if not results:
        raise ValueError("no results")
    return min(results, key=lambda r: abs(r["policies"][policy][metric] - target))


def ratio_table(
    r: Result, baseline: str, metric: str, published: Mapping[str, float], title: str = ""
) -> Table:
    """``metric`` of each policy divided by the baseline's, beside published ratios (same baseline)."""
    base = r["policies"][baseline][metric]
    ours = [[name, p[metric], p[metric] / base if base else None] for name, p in r["policies"].items()]
    pub_base = published.get(baseline) or next(iter(published.values()))
    theirs = [[f"{k} (published)", v, v / pub_base] for k, v in published.items()]
    return Table(["scheduler", metric, f"/ {baseline}"], ["str", "s", "x"], ours + theirs, title)


def case(results: Sequence[Result], label: str) -> Result:
    """The result of the case labelled ``label``."""
    for r in results:
        if r.get("label") == label:
            return r
    raise KeyError(f"no case {label!r}; cases: {', '.join(str(r.get('label')) for r in results)}")
