"""A study: named cases (usually a sweep of one parameter) plus an optional reference case, run together.

::

    Study(name, title, cases=[Case...], reference=Case | None, x_label, log_x)
        ──run_studies([...])──▶ {name: StudyResult(study, results, reference)}
                                   .table(metric)      Table: one row per swept value
                                   .figure(metrics)    Figure: one line per policy

A reference holds the policies a swept parameter cannot affect (event delay and event loss only reach
kv-aware, which alone reads the index), run once and drawn as horizontal lines instead of once per point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvrouter.lab.report import plots
from kvrouter.lab.report.grid import Case, run_grid
from kvrouter.lab.report.plots import Chart
from kvrouter.lab.report.tables import Table, sweep_table

Result = dict[str, Any]


class Study(msgspec.Struct, frozen=True):
    name: str
    """Key in ``run_studies``' answer."""
    title: str
    """What is varied, and on what; the tables' caption."""
    cases: list[Case]
    reference: Case | None = None
    x_label: str = ""
    log_x: bool = False


class StudyResult:
    def __init__(self, study: Study, results: list[Result], reference: Result | None) -> None:
        self.study = study
        self.results = results
        self.reference = reference

    def table(self, metric: str = "hit_rate") -> Table:
        """One row per swept value; reference policies as a last row (``any``)."""
        t = sweep_table(self.results, metric, x_name=self.study.x_label or "x", title=self.study.title)
        if self.reference is not None:
            row: list[Any] = ["any"]
            for col in t.columns[1:]:
                p = self.reference["policies"].get(col)
                row.append(p[metric] if p else None)
            t.rows.append(row)
            extra = [p for p in self.reference["policies"] if p not in t.columns]
            for p in extra:
                t.columns.append(p)
                t.formats.append(t.formats[1] if len(t.formats) > 1 else "x")
                for r in t.rows[:-1]:
                    r.append(None)
                t.rows[-1].append(self.reference["policies"][p][metric])
        return t

    def figure(self, metrics: Sequence[str] = ("hit_rate", "ttft_p90_s")) -> Chart:
        return plots.sweep(
            self.results,
            metrics,
            x_label=self.study.x_label,
            log_x=self.study.log_x,
            references=self.reference,
        )


def run_studies(
    studies: Sequence[Study],
    *,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, StudyResult]:
    """Every case and reference of every study, in one process pool."""
    cases: list[Case] = []
    index: dict[bytes, int] = {}  # equal cases (a reference shared by two studies) run once

    def add(c: Case) -> int:
        key = msgspec.json.encode(c)
        if key not in index:
            index[key] = len(cases)
            cases.append(c)
        return index[key]

    plan = [([add(c) for c in s.cases], add(s.reference) if s.reference else None) for s in studies]
    results = run_grid(cases, jobs=jobs, progress=progress)
    return {
        s.name: StudyResult(s, [results[i] for i in idx], results[ref] if ref is not None else None)
        for s, (idx, ref) in zip(studies, plan)
    }
