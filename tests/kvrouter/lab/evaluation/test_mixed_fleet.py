"""Mixed fleets: each instance runs its own timing profile (an A100 instance prefills at about a third of an
H100's rate), the eval command reads ``--profiles``, and derived profiles keep the model's figures."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from kvrouter.lab.commands import eval as eval_command
from kvrouter.lab.commands import sim as sim_command
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig, RequestRecord, VirtualFleet
from kvrouter.lab.sim.engine import SimConfigError, UnknownProfile, get_profile
from kvrouter.lab.sim.engine.timing import PROFILES, parse_profiles
from kvrouter.lab.workloads.spec import OpenLoop, Request, Segment, TokenSpace, Workload
from kvrouter.routing import RouterConfig

H100, A100 = "llama-3.1-70b-8xh100", "llama-3.1-70b-8xa100"


def alone(n_tokens: int, instances: int) -> Workload:
    """One uncached prompt per instance, each far apart: round-robin gives instance i request i."""
    reqs = [
        Request(
            id=f"r{i}",
            arrival_s=30.0 * i,
            max_output_tokens=2,
            num_prompt_tokens=n_tokens,
            segments=(Segment(100 + i, n_tokens),),
        )
        for i in range(instances)
    ]
    return Workload(name="t", requests=reqs, mode=OpenLoop(), token_space=TokenSpace(), metadata={})


def ttft(r: RequestRecord) -> float:
    assert r.first_token_s is not None
    return r.first_token_s - r.arrival_s


def test_each_instance_runs_its_own_profile() -> None:
    fleet = FleetSimConfig(instances=2, profiles=[H100, A100], events=False, frontend=False)
    runs = VirtualFleet(alone(8000, 2), fleet, RouterConfig(policy="round-robin", shadow=False)).run()
    by = {r.instance: ttft(r) for r in runs.records}
    h, a = get_profile(H100), get_profile(A100)
    # the prefill is compute-bound: the ratio of the two setups' achieved FLOPs
    want = (h.peak_flops * h.mfu) / (a.peak_flops * a.mfu)
    assert by["sim-1"] / by["sim-0"] == pytest.approx(want, rel=0.05)


def test_derived_profiles_keep_the_model_and_change_the_hardware() -> None:
    base, derived = get_profile(H100), get_profile(A100)
    assert (derived.weight_bytes, derived.kv_bytes_per_token, derived.mfu) == (
        base.weight_bytes,
        base.kv_bytes_per_token,
        base.mfu,
    )
    assert derived.peak_flops == 312e12 and derived.num_gpus == 8
    tp1 = get_profile("qwen3-32b-1xh100")
    tp2 = get_profile("qwen3-32b-2xh100")
    assert tp1.num_gpus == 1 and tp1.kv_capacity_blocks(16) < tp2.kv_capacity_blocks(16)
    for p in PROFILES.values():
        p.validate()


def test_profiles_are_parsed_with_counts() -> None:
    assert parse_profiles(f"{H100}*2,{A100}") == [H100, H100, A100]
    with pytest.raises(UnknownProfile, match="h200"):
        parse_profiles("llama-3.1-70b-8xh200")
    with pytest.raises(SimConfigError, match="count"):
        parse_profiles(f"{H100}*x")
    with pytest.raises(SimConfigError, match="2 profiles for 3 instances"):
        FleetSimConfig(instances=3, profiles=[H100, A100]).validate()


def test_eval_command_builds_a_mixed_fleet() -> None:
    p = argparse.ArgumentParser()
    eval_command.add_arguments(p)
    a = p.parse_args(["--workload", "short-chat", "--profiles", f"{H100}*2,{A100}*2"])
    spec = eval_command.spec_from_args(a)
    assert spec.fleet.instances == 4
    assert spec.fleet.instance_profiles() == [H100, H100, A100, A100]


def test_eval_command_reads_the_predicted_latency_settings() -> None:
    p = argparse.ArgumentParser()
    eval_command.add_arguments(p)
    a = p.parse_args(["--workload", "short-chat", "--predicted-latency", '{"recompute_weight": 2}'])
    assert eval_command.spec_from_args(a).settings.predicted_latency.recompute_weight == 2
    bad = p.parse_args(["--workload", "short-chat", "--predicted-latency", '{"recompute_wieght": 2}'])
    with pytest.raises(ValueError, match="recompute_wieght"):
        eval_command.spec_from_args(bad)


def test_live_sim_fleet_gives_each_instance_its_profile() -> None:
    p = argparse.ArgumentParser()
    sim_command.add_arguments(p)
    a = p.parse_args(["--fleet-out", "f.yaml", "--profiles", "test*2,test-slow"])
    cfg = sim_command.config_from_args(a)
    assert cfg.instances == 3
    assert [i.engine.profile for i in cfg.instance_configs(20000)] == ["test", "test", "test-slow"]
    with pytest.raises(SimConfigError, match="2 profiles for 3 instances"):
        msgspec.structs.replace(cfg, profiles=["test", "test"]).validate()
