"""The live replicas bench's pure parts: ``--set`` overrides, the workloads it drives, and the summary
that the figures in docs/results.md and the issue's targets are read from."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvrouter.lab.bench import replicas_bench as rb
from kvrouter.lab.bench.replicas_scenarios import workload


def args(*extra: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    rb.add_args(ap)
    return ap.parse_args(list(extra))


def test_overrides_nest_paths_and_parse_values_as_yaml() -> None:
    got = rb.overrides(
        ["routing.kv_aware.placement_band=0", "replicas.interval_s=0.2", "indexer.speculative=off"]
    )
    assert got == {
        "routing": {"kv_aware": {"placement_band": 0}},
        "replicas": {"interval_s": 0.2},
        "indexer": {"speculative": False},
    }
    with pytest.raises(ValueError, match="PATH=VALUE"):
        rb.overrides(["routing.policy"])


def test_bursts_are_one_group_each_at_the_gap_and_interleaved_is_shuffled() -> None:
    a = args(
        "--groups", "3", "--burst", "4", "--burst-gap-s", "0.5", "--per-group", "2", "--system-words", "50"
    )  # fmt: skip
    sc = rb.scenario(a, "paced")
    b = workload(sc, "bursts", groups=a.groups, seed=1)
    assert [r.arrival_s for r in b.requests] == [0.0] * 4 + [0.5] * 4 + [1.0] * 4
    for k in range(3):
        assert len({r.group for r in b.requests[4 * k : 4 * k + 4]}) == 1
    i = workload(sc, "interleaved", groups=a.groups, seed=1)
    assert len(i.requests) == 6 and len({r.group for r in i.requests}) == 3


def test_the_clients_scenario_is_issue_29s() -> None:
    """Eight clients in a closed loop on a fast fleet that cannot hold every prompt; the same prompts
    shuffled (interleaved) or group after group (bursts, which the closed loop sends as fast as answers
    come back)."""
    a = args()
    sc = rb.scenario(a, "clients")
    assert (sc.clients, sc.profile, sc.speed, sc.capacity_blocks, sc.output_tokens) == (
        8,
        "test",
        20.0,
        420,
        4,
    )
    i = workload(sc, "interleaved", groups=16, seed=0)
    b = workload(sc, "bursts", groups=16, seed=0)
    assert len(i.requests) == len(b.requests) == 160
    groups = [r.group for r in b.requests]
    assert groups == sorted(groups) and groups != [r.group for r in i.requests]
    assert sorted(r.id for r in i.requests) == sorted(r.id for r in b.requests)
    assert rb.scenario(args("--clients", "4", "--speed", "5"), "clients").clients == 4
    assert rb.scenario(args("--speed", "5"), "paced").speed == 5.0
    assert rb.scenario(args("--profile", "qwen3-32b-2xh100"), "clients").profile == "qwen3-32b-2xh100"
    assert rb.scenario(args(), "paced").profile is None  # the simulator's default
    with pytest.raises(ValueError, match="workload"):
        workload(sc, "steady", groups=16, seed=0)


def run(hit: float, groups: float = 1.0) -> dict[str, Any]:
    return {"hit_rate": hit, "ttft_p50_ms": 1.0, "instances_per_group": groups}


def test_summary_holds_each_run_and_the_targets() -> None:
    rows: rb.Rows = {
        "paced": {
            "interleaved": {
                "one": [run(0.866), run(0.864), run(0.86)],
                "shared": [run(0.865), run(0.860), run(0.84)],
                "alone": [run(0.82)] * 3,
            },
            "bursts": {
                "one": [run(0.843)] * 3,
                "shared": [run(0.843), run(0.838), run(0.80)],
                "alone": [run(0.78), run(0.84), run(0.84)],
            },
        }
    }
    s = rb.summary(rows)
    inter, bursts = s["paced/interleaved"], s["paced/bursts"]
    assert inter["shared"]["points_below_one"] == [0.1, 0.4, 2.0]
    assert inter["shared"]["median_points_below_one"] == 0.4
    assert bursts["alone"]["median"] == pytest.approx(0.84)
    assert bursts["shared"]["points_ahead_of_alone"] == [6.3, -0.2, -4.0]
    assert s["targets"]["paced/interleaved"] == {
        "shared_within_1_point_of_one_gateway": True,
        "shared_not_below_alone": True,
    }
    assert s["targets"]["paced/bursts"] == {
        "shared_within_1_point_of_one_gateway": True,  # the median run: 0.5 points below
        "shared_not_below_alone": False,  # 0.838 against 0.84
    }
    rows["paced"]["interleaved"]["shared"][1] = run(0.85)  # 1.4 points below in the median run
    assert not rb.summary(rows)["targets"]["paced/interleaved"]["shared_within_1_point_of_one_gateway"]
