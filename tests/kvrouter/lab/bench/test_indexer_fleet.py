"""The fleet-scale indexer bench on a small fleet: every lookup finds the instance it was built from, with
its cached blocks, whether or not the index was sized ahead, and the figures it reports add up."""

from __future__ import annotations

import pytest

from kvrouter.lab.bench.fleet_workload import Fleet, FleetSpec
from kvrouter.lab.bench.indexer_fleet import run_ours


@pytest.mark.parametrize("reserve", [False, True])
def test_small_fleet_lookups_find_their_instance(reserve: bool) -> None:
    spec = FleetSpec(instances=70, blocks=400, queries=40)  # two groups of 64 sources
    out = run_ours(spec, "0.33.0", reserve)
    assert out["expected_match"] == "40/40"
    assert out["pairs"] == Fleet(spec).pairs() >= 70 * 400
    assert out["reserved"] is reserve
    assert out["ingest_total_blocks_per_s"] > 0 and out["ingest_total_blocks_per_cpu_s"] > 0
    assert out["table_bytes_per_pair"] > 0
