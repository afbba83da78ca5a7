"""Figures: what every reliability scenario returns, and the table they make.

::

    scenario(cfg) ──▶ ScenarioResult(name, area, figures=[Figure(name, value, target, ok)], seconds)
                                          │
    kvrouter reliability ──render_table───┴──▶ | Area | Scenario | Figure | Value | Target | |

A figure with ``ok=None`` is informative (a measurement with no pass/fail line, e.g. a throughput).  A
scenario passes when none of its figures failed and it raised nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec


class Figure(msgspec.Struct, frozen=True):
    """One measured figure of a scenario."""

    name: str
    """What was measured, e.g. ``5xx answers``."""
    value: str
    """The measurement, formatted for the table."""
    target: str = ""
    """The line it must hold, e.g. ``0`` or ``<= 1 s`` (empty: informative)."""
    ok: bool | None = None
    """Whether it held (None: nothing to hold)."""
    raw: Any = None
    """The unformatted value, for ``--json``."""


class ScenarioResult(msgspec.Struct):
    """Everything one scenario measured."""

    name: str
    """Registry key (``kvrouter.lab.reliability.suite.SCENARIOS``)."""
    area: str
    """Faults, Bad input, Load or Security."""
    title: str
    figures: list[Figure] = []
    seconds: float = 0.0
    error: str | None = None
    """Set when the scenario raised: it failed without finishing its measurements."""
    notes: list[str] = []
    """What the figures do not show (a part that does not exist yet, a skipped dependency)."""

    @property
    def ok(self) -> bool:
        return self.error is None and all(f.ok is not False for f in self.figures)


def fig(name: str, raw: Any, target: str = "", ok: bool | None = None, *, fmt: str | None = None) -> Figure:
    """A figure whose table value is ``raw`` formatted with ``fmt`` (``{:.1f}`` style) or ``str``."""
    if fmt is not None:
        value = fmt.format(raw)
    elif isinstance(raw, float):
        value = f"{raw:.3g}"
    elif isinstance(raw, Mapping):
        value = ", ".join(f"{k} {v}" for k, v in sorted(raw.items(), key=lambda kv: (-_num(kv[1]), kv[0])))
        value = value or "none"
    else:
        value = str(raw)
    return Figure(name, value, target, ok, raw)


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) else 0.0


def at_most(name: str, raw: float, limit: float, *, unit: str = "", fmt: str = "{:.3g}") -> Figure:
    """A figure that must stay at or below ``limit``."""
    u = f" {unit}" if unit else ""
    return Figure(name, fmt.format(raw) + u, f"<= {fmt.format(limit)}{u}", raw <= limit, raw)


def at_least(name: str, raw: float, limit: float, *, unit: str = "", fmt: str = "{:.3g}") -> Figure:
    u = f" {unit}" if unit else ""
    return Figure(name, fmt.format(raw) + u, f">= {fmt.format(limit)}{u}", raw >= limit, raw)


def exactly(name: str, raw: Any, want: Any) -> Figure:
    return Figure(name, str(raw), str(want), raw == want, raw)


def render_table(results: Iterable[ScenarioResult], *, pad: bool = True) -> str:
    """A Markdown table: one row per figure, the scenario named on its first row (columns padded to
    line up for a terminal; ``pad=False`` for files, where one long value would pad every row)."""
    rows = [("Area", "Scenario", "Figure", "Value", "Target", "")]
    for r in results:
        figures = list(r.figures)
        if r.error is not None:
            figures.append(Figure("error", r.error[:120], "none", False))
        if not figures:
            figures.append(Figure("(no figures)", "", "", None))
        for i, f in enumerate(figures):
            mark = "" if f.ok is None else ("pass" if f.ok else "FAIL")
            first = i == 0
            rows.append(
                (
                    r.area if first else "",
                    f"{r.title} ({r.seconds:.0f} s)" if first else "",
                    f.name,
                    f.value.replace("|", "/"),
                    f.target.replace("|", "/"),
                    mark,
                )
            )
    widths = [max(len(row[i]) for row in rows) if pad else 3 for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(widths[i]) for i, c in enumerate(row)) + " |")
        if k == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def render_notes(results: Iterable[ScenarioResult]) -> str:
    out: list[str] = []
    for r in results:
        out.extend(f"- {r.title}: {n}" for n in r.notes)
    return "\n".join(out)
