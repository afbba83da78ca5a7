"""kvrouter.lab.report: parameter changes, sizing, grids of runs, tables (the logic under the notebooks)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvrouter.lab import report
from kvrouter.lab.evaluation.compare import EvalSpec, load_workload, run_one
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.report import comparison, grid, seeds, sensitivity
from kvrouter.lab.report.published import Reported
from kvrouter.lab.workloads import (
    Bursts,
    ClosedLoop,
    Constant,
    Poisson,
    Stage,
    Staged,
    make_workload,
    workload_params,
)
from kvrouter.lab.workloads.arrivals import AllAtOnce
from kvrouter.lab.workloads.registry import list_workloads
from kvrouter.routing.policies import PolicySettings

TINY = EvalSpec(
    workload="sglang-gsp",
    overrides={
        "num_groups": 3,
        "prompts_per_group": 4,
        "system_len": 256,
        "question_len": 32,
        "output_len": 8,
    },
    fleet=FleetSimConfig(instances=2, profile="test"),
    policies=("kv-aware", "round-robin"),
)


def fake_result(label: str, x: Any, hits: dict[str, float], **metrics: dict[str, float]) -> dict[str, Any]:
    pols = {}
    for p, h in hits.items():
        pols[p] = {"hit_rate": h, **{m: v[p] for m, v in metrics.items()}}
    return {
        "label": label,
        "x": x,
        "workload": "w",
        "requests": 10,
        "instances": 2,
        "bounds": {},
        "policies": pols,
    }


# ----------------------------------------------------------------------------------------- changing specs
def test_with_param_sets_nested_fields_and_workload_overrides() -> None:
    s = report.with_param(TINY, "fleet.instances", 5)
    assert s.fleet.instances == 5 and TINY.fleet.instances == 2
    s = report.with_param(s, "settings.prefix_hash.load_bound", 2.0)
    assert s.settings.prefix_hash.load_bound == 2.0
    assert s.settings.prefix_hash.prefix_length == PolicySettings().prefix_hash.prefix_length
    s = report.with_param(s, "overrides.system_len", 512)
    assert s.overrides["system_len"] == 512 and TINY.overrides["system_len"] == 256
    assert report.with_param(s, "policies", ("random",)).policies == ("random",)
    with pytest.raises(ValueError, match="no field"):
        report.with_param(TINY, "fleet.instancez", 1)
    with pytest.raises(ValueError, match="overrides"):
        report.with_param(TINY, "overrides", 1)


@pytest.mark.parametrize(
    ("arrival", "expected"),
    [
        (Poisson(2.0), Poisson(6.0)),
        (Constant(1.0), Constant(3.0)),
        (
            Staged((Stage(2.0, 30.0), Stage(4.0, 60.0)), poisson=False),
            Staged((Stage(6.0, 10.0), Stage(12.0, 20.0)), poisson=False),
        ),
        (Bursts(5, 3.0), Bursts(5, 1.0)),
        (ClosedLoop(4), ClosedLoop(12)),
        (AllAtOnce(), AllAtOnce()),
    ],
)
def test_scale_arrival(arrival: Any, expected: Any) -> None:
    assert report.scale_arrival(arrival, 3.0) == expected


def test_scale_arrival_rejects_bad_multipliers() -> None:
    for m in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError):
            report.scale_arrival(Poisson(1.0), m)


def test_with_rate_on_a_generator_and_on_a_trace() -> None:
    base = EvalSpec(workload="aws-8k-shared-prefix", overrides={"num_requests": 40})
    fast = report.with_rate(base, 2.0)
    arr = workload_params("aws-8k-shared-prefix", **fast.overrides).arrival  # type: ignore[attr-defined]
    assert arr == Staged((Stage(4.0, 1800.0),), poisson=True)
    a = make_workload("aws-8k-shared-prefix", **base.overrides).requests
    b = make_workload("aws-8k-shared-prefix", **fast.overrides).requests
    assert len(a) == len(b) == 40  # same requests, in half the time (the same draws, halved gaps)
    assert [r.arrival_s for r in b] == pytest.approx([(r.arrival_s or 0) / 2 for r in a])
    trace = EvalSpec(workload="mooncake-conversation", overrides={"limit": 10, "rate_multiplier": 3.0})
    assert report.with_rate(trace, 2.0).overrides["rate_multiplier"] == 6.0
    with pytest.raises(ValueError, match="named workload"):
        report.with_rate(EvalSpec(trace="x.jsonl"), 2.0)


def test_sweep_makes_one_case_per_value() -> None:
    cases = report.sweep(TINY, "fleet.event_delay_s", [0.01, 1.0])
    assert [c.x for c in cases] == [0.01, 1.0] and [c.label for c in cases] == [
        "event_delay_s=0.01",
        "event_delay_s=1.0",
    ]
    assert [c.spec.fleet.event_delay_s for c in cases] == [0.01, 1.0] and not any(c.bounds for c in cases)


# ------------------------------------------------------------------------------------------------ scale
def test_scale_from_env() -> None:
    assert report.scale_from_env({}).name == "full"
    assert report.scale_from_env({report.ENV_VAR: "small"}).name == "small"
    assert report.scale_from_env({report.ENV_VAR: " Full "}).fraction == 1.0
    with pytest.raises(ValueError, match="choose from"):
        report.scale_from_env({report.ENV_VAR: "huge"})


def test_scale_values_keep_first_and_last() -> None:
    full, small = report.SCALES["full"], report.SCALES["small"]
    assert full.values([1, 2, 3, 4, 5]) == [1, 2, 3, 4, 5]
    assert small.values([1, 2, 3, 4, 5]) == [1, 5] and small.values([7]) == [7]
    three = msgspec.structs.replace(full, points=3)
    assert three.values([1, 2, 3, 4, 5]) == [1, 3, 5] and three.values([1, 2, 3, 4]) == [1, 3, 4]
    assert msgspec.structs.replace(full, points=1).values([1, 2]) == [1]


def count(spec: EvalSpec) -> int:
    assert spec.workload is not None
    return len(make_workload(spec.workload, **spec.overrides).requests)


def test_sized_keeps_the_shape() -> None:
    # a staged schedule keeps every stage's rate and shortens it
    s = report.sized(EvalSpec(workload="llmd-shared-prefix"), 0.1)
    stages = s.overrides["arrival"]["stages"]
    assert [st["rate"] for st in stages] == [2, 5, 8, 10, 12, 15, 20] and stages[0][
        "duration_s"
    ] == pytest.approx(5.0)
    assert count(s) == pytest.approx(360, abs=2)
    # a fixed-size workload loses requests, not its arrival process
    s = report.sized(EvalSpec(workload="short-chat"), 0.05)
    assert s.overrides == {"num_requests": 100}
    assert report.sized(EvalSpec(workload="sglang-gsp"), 0.1).overrides == {"num_requests": 102}
    # conversations keep their turns
    s = report.sized(EvalSpec(workload="multi-turn"), 0.1)
    assert s.overrides == {"num_conversations": 20} and count(s) == 100
    # a trace keeps its first requests
    s = report.sized(EvalSpec(workload="mooncake-conversation", overrides={"limit": 1000}), 0.1)
    assert s.overrides["limit"] == 100
    # never below the floor
    assert report.sized(EvalSpec(workload="short-chat"), 0.001, 30).overrides == {"num_requests": 30}
    with pytest.raises(ValueError):
        report.sized(EvalSpec(workload="short-chat"), 1.5)


def test_every_study_is_buildable_at_both_scales() -> None:
    for scale in report.SCALES.values():
        cases = comparison.workload_cases(scale)
        assert [c.label for c in cases] == list_workloads()
        assert all(c.spec.series for c in cases)
        moon = next(c for c in cases if c.label == comparison.MOONCAKE)
        assert "random" in moon.spec.policies and moon.spec.fleet.instances == 8
        assert next(c for c in cases if c.label == "aws-8k-shared-prefix").spec.fleet.instances == 7
        assert len(comparison.prefix_hash_studies(scale)) == 4
        studies = {s.name: s for s in sensitivity.studies(scale)}
        assert set(studies) == {"instances", "capacity", "load", "event_delay", "event_loss", "prefix"}
        for name in ("event_delay", "event_loss"):
            assert all(c.spec.policies == ("kv-aware",) for c in studies[name].cases)
            ref = studies[name].reference
            assert ref is not None and ref.spec.policies == ("prefix-hash", "least-loaded")
        inst = studies["instances"].cases
        mult = [c.spec.overrides["rate_multiplier"] for c in inst]
        assert mult == pytest.approx(
            [3.0 * n / 8 for n in scale.values(sensitivity.INSTANCES)]
        )  # per instance
        assert all(c.bounds for c in studies["capacity"].cases)
        assert len(seeds.calibration_cases(scale)) == len(seeds.GROUPS)
    small = report.SCALES["small"]
    assert count(comparison.workload_spec("llmd-precise", small)) < 100


# ------------------------------------------------------------------------------------------------ running
def test_run_grid_matches_run_one_and_fills_bounds() -> None:
    cases = [
        report.Case("a", TINY, 1),
        report.Case("b", report.with_param(TINY, "fleet.instances", 1), 2, bounds=False),
    ]
    seen: list[tuple[int, int]] = []
    out = report.run_grid(cases, jobs=1, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (6, 6)  # 2 + pooled + ceiling, then 2 policies
    a, b = out
    assert (a["label"], a["x"], a["instances"], b["instances"]) == ("a", 1, 2, 1)
    assert set(a["policies"]) == {"kv-aware", "round-robin"} and a["requests"] == 12
    direct = run_one(TINY, "kv-aware")
    assert a["policies"]["kv-aware"]["hit_rate"] == direct["hit_rate"]
    bnd = a["bounds"]
    assert bnd["pooled_cache"] <= bnd["reuse_ceiling"] + 1e-9 and 0 < bnd["reuse_ceiling"] < 1
    assert a["policies"]["kv-aware"]["hit_rate"] <= bnd["reuse_ceiling"] + 1e-9
    assert b["bounds"] == {}
    # one instance: every policy places every request alike
    assert b["policies"]["kv-aware"]["hit_rate"] == b["policies"]["round-robin"]["hit_rate"]


def test_run_grid_in_processes_gives_the_same_figures() -> None:
    cases = [report.Case("a", TINY, bounds=False)]
    one = report.run_grid(cases, jobs=1)[0]["policies"]
    two = report.run_grid(cases, jobs=2)[0]["policies"]
    for p in one:
        for k in ("hit_rate", "ttft_p50_s", "throughput_tok_s"):
            assert one[p][k] == two[p][k]


def test_run_grid_rejects_unknown_policies() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        report.run_grid([report.Case("x", report.with_param(TINY, "policies", ("nope",)))], jobs=1)


def test_run_studies_runs_a_shared_reference_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = grid._task

    def counting(blob: bytes, what: str) -> dict[str, Any]:
        calls.append(what)
        return real(blob, what)

    monkeypatch.setattr(grid, "_task", counting)
    kv = report.with_param(TINY, "policies", ("kv-aware",))
    ref = report.Case("reference", report.with_param(TINY, "policies", ("round-robin",)), bounds=False)
    s1 = report.Study(
        "d", "delay", report.sweep(kv, "fleet.event_delay_s", [0.001, 0.5]), ref, "event_delay_s"
    )
    s2 = report.Study("l", "loss", report.sweep(kv, "fleet.event_loss", [0.0]), ref, "event_loss")
    res = report.run_studies([s1, s2], jobs=1)
    assert calls.count("round-robin") == 1 and calls.count("kv-aware") == 3
    t = res["d"].table("hit_rate")
    assert t.columns == ["event_delay_s", "kv-aware", "round-robin"]
    assert [r[0] for r in t.rows] == ["0.001", "0.5", "any"]
    assert (
        t.rows[0][2] is None
        and t.rows[-1][1] is None
        and t.rows[-1][2] == res["l"].reference["policies"]["round-robin"]["hit_rate"]
    )  # type: ignore[index]


# ------------------------------------------------------------------------------------------------ tables
def test_table_renders_and_checks_its_shape() -> None:
    t = report.Table(
        ["policy", "hit", "ttft"], ["str", "pct", "s"], [["a", 0.5, 0.0123], ["b", float("nan"), 2.5]], "T"
    )
    assert t.records()[0] == {"policy": "a", "hit": 0.5, "ttft": 0.0123}
    assert t.column("hit")[0] == 0.5
    md = t._repr_markdown_()
    assert md.splitlines()[0] == "**T**" and "| a | 50.0 % | 12 ms |" in md and "| b | — | 2.50 s |" in md
    assert "|:---|---:|---:|" in md
    assert str(t).splitlines()[0] == "T"
    with pytest.raises(ValueError):
        report.Table(["a"], ["str"], [["x", "y"]])
    with pytest.raises(ValueError):
        report.Table(["a"], ["str", "pct"], [])


def test_change_and_closest_and_case() -> None:
    assert report.change(0.25, 1.0) == -0.75
    assert report.change(1.0, 0.0) != report.change(1.0, 0.0)  # NaN
    rs = [
        fake_result("g1", 1, {"random": 0.9}),
        fake_result("g300", 300, {"random": 0.3}),
        fake_result("g600", 600, {"random": 0.2}),
    ]
    assert report.closest(rs, "random", "hit_rate", 0.25)["x"] == 300  # first of two equally close
    assert seeds.chosen_groups(rs) == 300
    assert report.case(rs, "g600")["x"] == 600
    with pytest.raises(KeyError):
        report.case(rs, "nope")
    assert seeds.at_rate(rs, 600)["label"] == "g600"


def test_summary_and_sweep_tables_with_missing_policies_and_bounds() -> None:
    a = fake_result("a", 1.0, {"kv-aware": 0.5, "random": 0.1})
    b = fake_result("b", 2.0, {"kv-aware": 0.6})
    b["bounds"] = {"pooled_cache": 0.7, "reuse_ceiling": 0.8}
    t = report.summary_table([a, b], "hit_rate")
    assert t.columns == [
        "case",
        "requests",
        "instances",
        "kv-aware",
        "random",
        "pooled bound",
        "reuse ceiling",
    ]
    assert t.rows[1] == ["b", 10, 2, 0.6, None, 0.7, 0.8]
    s = report.sweep_table([a, b], "hit_rate", x_name="n")
    assert s.columns == ["n", "kv-aware", "random", "pooled bound"] and s.rows[0][0] == "1"


def test_change_and_published_tables() -> None:
    metrics = {
        "ttft_p50_s": {"random": 1.0, "kv-aware": 0.2},
        "ttft_p90_s": {"random": 2.0, "kv-aware": 1.0},
        "ttft_mean_s": {"random": 1.0, "kv-aware": 0.5},
        "throughput_tok_s": {"random": 100.0, "kv-aware": 110.0},
    }
    r = fake_result("x", None, {"random": 0.25, "kv-aware": 0.8}, **metrics)
    t = report.change_table(r, "random")
    assert t.rows[1] == ["kv-aware", 0.8, pytest.approx(-0.8), -0.5, -0.5, pytest.approx(0.1)]
    p = report.published_table(
        r,
        "random",
        ("kv-aware",),
        report.AWS_8K_SHARED_PREFIX,
        published_name="AWS",
        published_hit=report.AWS_8K_HIT_RATE,
    )
    assert p.columns == ["metric", "random (ours)", "kv-aware (ours)", "AWS"]
    assert p.rows[0] == ["median TTFT", "1.00 s", "-80 %", "-77 % .. -71 %"]
    assert p.rows[2][2:] == ["+10 %", "+15 % .. +16 %"]
    assert p.rows[-1] == ["KV hit rate", "25.0 %", "80.0 %", "25% -> 82%"]
    q = report.ratio_table(r, "random", "ttft_mean_s", report.MOONCAKE_PAPER_MEAN_TTFT_S)
    assert q.rows[1] == ["kv-aware", 0.5, 0.5] and q.rows[-1][2] == pytest.approx(3.07 / 19.65)


def test_stacked_published_table_labels_each_case() -> None:
    metrics = {
        "ttft_p50_s": {"random": 1.0, "kv-aware": 0.2},
        "ttft_p90_s": {"random": 2.0, "kv-aware": 1.0},
        "throughput_tok_s": {"random": 100.0, "kv-aware": 100.0},
    }
    before = fake_result("x", None, {"random": 0.25, "kv-aware": 0.8}, **metrics)
    slower = {m: {p: v + 0.05 for p, v in row.items()} for m, row in metrics.items()}
    after = fake_result("y", None, {"random": 0.25, "kv-aware": 0.8}, **slower)
    t = report.stacked_published_table(
        [("engine only", before), ("with API server", after)],
        "random",
        ("kv-aware",),
        report.AWS_8K_SHARED_PREFIX,
        published_name="AWS",
    )
    assert t.columns == ["case", "metric", "random (ours)", "kv-aware (ours)", "AWS"]
    assert [r[0] for r in t.rows] == ["engine only"] * 4 + ["with API server"] * 4
    # a constant added to every request's TTFT shrinks the relative change
    assert t.rows[0][3] == "-80 %" and t.rows[4][3] == "-76 %"
    with pytest.raises(ValueError):
        report.stacked_published_table([], "random", (), {}, published_name="AWS")


def test_engine_only_cases_turn_the_front_end_off() -> None:
    small = report.SCALES["small"]
    calibration = [{"x": 9, "policies": {"random": {"hit_rate": 0.25}}}]
    cases = seeds.engine_only_cases(small, calibration)
    assert [c.spec.fleet.frontend for c in cases] == [False, False]
    assert all(seeds.ENGINE_ONLY in c.label for c in cases)
    assert cases[0].spec.overrides["num_groups"] == 9
    assert all(c.spec.fleet.frontend for c in seeds.rate_cases(small, calibration))


def test_closed_loop_case_holds_a_concurrency() -> None:
    calibration = [{"x": 9, "policies": {"random": {"hit_rate": 0.25}}}]
    c = seeds.closed_loop_case(report.SCALES["small"], calibration)
    arrival = c.spec.overrides["arrival"]
    assert arrival == {"type": "closed-loop", "concurrency": seeds.CLOSED_LOOP_CLIENTS}
    assert c.spec.overrides["num_groups"] == 9 and c.spec.fleet.frontend and not c.bounds
    assert load_workload(c.spec).closed_loop


def test_outside_latency_shifts_every_ttft_alike() -> None:
    metrics = {
        "ttft_p50_s": {"random": 0.8, "prefix-hash": 0.06, "kv-aware": 0.05},
        "ttft_p90_s": {"random": 2.0, "prefix-hash": 0.9, "kv-aware": 0.45},
        "ttft_p99_s": {"random": 3.0, "prefix-hash": 2.0, "kv-aware": 0.8},
        "ttft_mean_s": {"random": 1.0, "prefix-hash": 0.3, "kv-aware": 0.1},
        "throughput_tok_s": {"random": 100.0, "prefix-hash": 100.0, "kv-aware": 100.0},
    }
    r = fake_result("x", 16.0, {"random": 0.25, "prefix-hash": 0.7, "kv-aware": 0.83}, **metrics)
    s = seeds.with_outside_latency(r, 0.2)
    assert s["policies"]["kv-aware"]["ttft_p50_s"] == pytest.approx(0.25)
    assert s["policies"]["random"]["ttft_mean_s"] == pytest.approx(1.2)
    assert (
        s["policies"]["random"]["throughput_tok_s"] == 100.0 and s["policies"]["kv-aware"]["hit_rate"] == 0.83
    )
    assert r["policies"]["kv-aware"]["ttft_p50_s"] == 0.05  # the result itself is left alone
    t = seeds.outside_latency_table([r], (0.0, 0.2))
    assert t.columns[:4] == ["req/s", "outside", "random p50", "prefix-hash Δp50"]
    assert [row[:2] for row in t.rows] == [["16", "0 ms"], ["16", "200 ms"]]
    kv_p50 = t.columns.index("kv-aware Δp50")
    assert t.rows[0][kv_p50] == pytest.approx(0.05 / 0.8 - 1) and t.rows[1][kv_p50] == pytest.approx(
        0.25 / 1.0 - 1
    )


def test_reported_ranges_print_as_published() -> None:
    assert Reported(-0.77, -0.71).text() == "-77 % .. -71 %"
    assert Reported(0.017, 0.02).text() == "+1.7 % .. +2.0 %"
    assert Reported(0.5, 0.5).text(signed=False) == "50 %"


def test_a_chart_renders_png() -> None:
    r = report.run_grid([report.Case("a", report.with_param(TINY, "series", True), bounds=False)], jobs=1)[0]
    for chart in (report.plots.ttft_cdf(r), report.plots.bars([r]), report.plots.load_over_time(r)):
        assert chart is not None and chart._repr_png_().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="series"):
        report.plots.ttft_cdf(report.run_grid([report.Case("a", TINY, bounds=False)], jobs=1)[0])


def test_cases_cross_process_boundaries_as_json() -> None:
    cases = seeds.rate_cases(report.SCALES["small"], [fake_result("g", 3, {"random": 0.25})])
    c = next(c for c in cases if c.x == seeds.RATE)
    assert msgspec.json.decode(msgspec.json.encode(c.spec), type=EvalSpec) == c.spec
    assert c.spec.overrides["num_groups"] == 3 and c.bounds and c.spec.series
