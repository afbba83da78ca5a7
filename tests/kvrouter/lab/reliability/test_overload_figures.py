"""The overload phase's figures: refusals against admissions of the same second, queue growth above the
held latency, and a phase that did not overload reported as such (not as a failed NaN)."""

from __future__ import annotations

import math

from kvrouter.lab.reliability.driver import Shot, summary
from kvrouter.lab.reliability.overload import overload_figures, p99_growth, same_second_ratio


def shot(sent: float, status: int, latency_s: float) -> Shot:
    return Shot(sent=sent, status=status, latency_s=latency_s, retry_after="1" if status == 429 else None)


def test_refusals_are_compared_with_admissions_of_the_same_second() -> None:
    # second 0: quiet, only admissions (5 ms); second 1: the loop behind, 429s at 60 ms and 200s at 120 ms
    shots = [shot(0.1 * i, 200, 0.005) for i in range(10)]
    shots += [shot(1.0 + 0.1 * i, 429 if i % 2 else 200, 0.06 if i % 2 else 0.12) for i in range(10)]
    assert same_second_ratio(shots) == 0.5  # sooner than service at the same moment
    # across the whole phase the same answers read as refusals slower than service
    figs = {f.name: f for f in overload_figures(100.0, 50, 200.0, summary(shots, 2.0), shots, 0.2)}
    assert float(figs["2R: 429 answer time p50 / admitted requests' p50, whole phase"].value) > 1.0
    same = next(f for f in figs.values() if "same second" in f.name)
    assert same.ok is True
    # refusals slower than admissions of their own second fail
    slow = [shot(1.0 + 0.1 * i, 429 if i % 2 else 200, 0.2 if i % 2 else 0.01) for i in range(10)]
    assert same_second_ratio(slow) == 20.0
    assert math.isnan(same_second_ratio([shot(0.0, 200, 0.01)]))


def test_a_phase_that_did_not_overload_has_no_refusal_figures_and_small_growth_passes() -> None:
    shots = [shot(0.05 * i, 200, 0.01 if i < 100 else 0.14) for i in range(300)]
    assert (
        abs(p99_growth(shots, 0.2) - 0.7) < 1e-9
    )  # 10 ms -> 140 ms, below the 200 ms held: no runaway queue
    assert p99_growth(shots, 0.0) > 10
    figs = overload_figures(100.0, 50, 200.0, summary(shots, 15.0), shots, 0.2)
    assert all(f.ok is not False for f in figs), [(f.name, f.value) for f in figs if f.ok is False]
    assert any(f.value == "none: the gateway kept up at this rate" for f in figs)
    # a queue that keeps growing past the held latency fails
    runaway = [shot(0.05 * i, 200, 0.05 + 0.01 * i) for i in range(300)]
    figs = overload_figures(100.0, 50, 200.0, summary(runaway, 15.0), runaway, 0.2)
    assert any(f.ok is False and "last third" in f.name for f in figs)
