"""The live replicas bench's pure parts: ``--set`` overrides, the workloads it drives, and the summary
that the figures in docs/results.md and the issue's targets are read from."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvrouter.lab.bench import replicas_bench as rb


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
    )
    b = rb.workload(a, "bursts", seed=1)
    assert [r.arrival_s for r in b.requests] == [0.0] * 4 + [0.5] * 4 + [1.0] * 4
    for k in range(3):
        assert len({r.group for r in b.requests[4 * k : 4 * k + 4]}) == 1
    i = rb.workload(a, "interleaved", seed=1)
    assert len(i.requests) == 6 and len({r.group for r in i.requests}) == 3


def run(hit: float, groups: float = 1.0) -> dict[str, Any]:
    return {"hit_rate": hit, "ttft_p50_ms": 1.0, "instances_per_group": groups}


def test_summary_holds_each_run_and_the_targets() -> None:
    a = args()
    rows = {
        "interleaved": {
            "one": [run(0.866), run(0.864)],
            "shared": [run(0.865), run(0.860)],
            "alone": [run(0.82)] * 2,
        },
        "bursts": {
            "one": [run(0.843)] * 2,
            "shared": [run(0.843), run(0.838)],
            "alone": [run(0.78), run(0.84)],
        },
    }
    s = rb.summary(a, rows)
    assert s["interleaved"]["shared"]["points_below_one"] == [0.1, 0.4]
    assert s["bursts"]["alone"]["median"] == pytest.approx(0.81)
    assert s["targets"]["shared_within_1_point_of_one_gateway"] is True
    assert s["targets"]["shared_ahead_of_alone_on_bursts_points"] == [6.3, -0.2]
    assert s["targets"]["shared_ahead_of_alone_on_bursts"] is False
    rows["interleaved"]["shared"][1] = run(0.85)  # 1.4 points below in the second run
    assert rb.summary(a, rows)["targets"]["shared_within_1_point_of_one_gateway"] is False
