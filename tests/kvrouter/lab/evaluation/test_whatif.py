"""The what-if runs behind the predictor floor (docs/measurements.md): from a copy of the engine as it is at
dispatch, they give a request's TTFT exactly unless a request placed after it shares its steps."""

from __future__ import annotations

from kvrouter.lab.evaluation.whatif import run


def test_a_what_if_run_is_the_simulators_own_answer_unless_later_requests_share_the_steps() -> None:
    # A hundredth of the trace's rate: the only later arrivals are those of the same burst (the trace gives
    # several requests one timestamp).  The others' what-if is their TTFT to the nanosecond, and later
    # arrivals can only delay a request: none is over-predicted.
    r = run(0.03, "learned", limit=30)
    assert r["whatif_n"] == 30
    assert r["whatif_exact"] >= 0.5, r["whatif_exact"]
    assert r["whatif_over"] == 0.0
    assert 0 < r["whatif_mape"] < 0.15
