"""kvrouter.lab.report.tiers: the policy x tier grid, run for real at a tiny size, and its tables."""

from __future__ import annotations

import math

import pytest

from kvrouter.lab.evaluation.compare import EvalSpec, load_workload
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.report import SCALES
from kvrouter.lab.report.grid import run_grid
from kvrouter.lab.report.tiers import (
    STUDY_WORKLOADS,
    TIER_SETTINGS,
    TierSizes,
    hyperpod_table,
    study_cases,
    tier_cases,
    tier_of,
    tier_table,
)

# Conversations of their own (no shared system prompt) on 3 instances whose GPUs hold about one
# conversation's context each: later turns find their history in the CPU tier or the L2, or nowhere.
SPEC = EvalSpec(
    workload="multi-turn",
    overrides={
        "num_conversations": 6,
        "turns": 3,
        "system_len": 600,
        "shared_system": False,
        "turn_len": 40,
        "output_len": 8,
        "think_time_s": 0.2,
    },
    fleet=FleetSimConfig(instances=3, profile="test"),
    policies=("round-robin", "kv-aware"),
)
SIZES = TierSizes(gpu_blocks=60, l1_blocks=120, l2_blocks=4000, l2_gbps=10.0)


def test_cases_give_each_setting_its_tiers() -> None:
    cases = tier_cases(SPEC, SIZES, [1.0, 2.0])
    assert [(c.x, tier_of({"cpu_offload_blocks": c.spec.fleet.cpu_offload_blocks,
                           "shared_l2_blocks": c.spec.fleet.shared_l2_blocks})) for c in cases] == [
        (r, t) for r in (1.0, 2.0) for t in TIER_SETTINGS
    ]  # fmt: skip
    assert all(c.spec.fleet.capacity_blocks == 60 for c in cases)
    assert cases[3].spec.overrides != SPEC.overrides  # x2: the arrivals changed


def test_the_grid_runs_and_the_tables_compare_against_gpu_only_round_robin() -> None:
    results = run_grid(tier_cases(SPEC, SIZES, [1.0]), jobs=1)
    by = {(tier_of(r["fleet"]), p): v for r in results for p, v in r["policies"].items()}
    for (tier, _), v in by.items():
        split = v["hit_rate_by_tier"]
        assert split["GPU"] + split["CPU"] + split["L2"] == pytest.approx(v["hit_rate"])
        assert split["CPU"] == 0 or "l1" in tier  # a tier serves only where it exists
        assert split["L2"] == 0 or "l2" in tier
    # round-robin scatters each conversation's turns: only the shared L2 finds them on other instances
    assert by[("l1+l2", "round-robin")]["hit_rate_by_tier"]["L2"] > 0
    assert by[("l1+l2", "round-robin")]["hit_rate"] > by[("l1", "round-robin")]["hit_rate"]
    t = tier_table(results)
    rows = t.records()
    base = next(r for r in rows if r["tiers"] == "gpu" and r["policy"] == "round-robin")
    assert base["cost vs base"] == 0 and base["TTFT p50 vs base"] == 0
    for r in rows:
        want = by[(r["tiers"], r["policy"])]["gpu_s_per_request"] / base["GPU s/req"] - 1
        assert r["cost vs base"] == pytest.approx(want)
    h = hyperpod_table(results).records()
    assert [r["setting"] for r in h][:3] == [f"kv-aware, {t}" for t in TIER_SETTINGS]
    assert h[-1]["workload"] == "HyperPod (published)"
    assert not any(isinstance(v, float) and math.isnan(v) for r in h[:-1] for v in r.values())


def test_the_notebook_study_builds_at_both_scales() -> None:
    for scale in SCALES.values():
        cases = study_cases(scale)
        assert len(cases) == len(STUDY_WORKLOADS) * 2 * len(TIER_SETTINGS)
        for c in cases[:: len(TIER_SETTINGS)]:
            assert load_workload(c.spec).requests
