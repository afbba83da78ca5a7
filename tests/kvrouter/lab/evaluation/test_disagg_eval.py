"""``kvrouter eval`` on disaggregated fleets: split requests run as the gateway runs them, every load and
held block is released, and what disaggregation is for shows (decodes no longer stall behind prefills)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvrouter.lab.commands import eval as eval_cmd
from kvrouter.lab.commands import sim as sim_cmd
from kvrouter.lab.evaluation.compare import EvalSpec, load_workload, run_one
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig, VirtualFleet
from kvrouter.lab.workloads.spec import OpenLoop, Request, Segment, TokenSpace, Workload
from kvrouter.routing import DisaggMode, DisaggSettings, RouterConfig
from kvrouter.types import Role

RC = RouterConfig(shadow=False, concurrency_threshold=256)


def fleet(roles: list[Role], **kw: object) -> FleetSimConfig:
    return FleetSimConfig(instances=len(roles), roles=roles, **kw)  # type: ignore[arg-type]


def stall_workload() -> Workload:
    """A short prompt decoding a long answer, then a 16k-token prompt arriving while it decodes."""
    reqs = [
        Request(
            id="decoder",
            arrival_s=0.0,
            max_output_tokens=300,
            num_prompt_tokens=64,
            segments=(Segment(1, 64),),
        ),
        Request(
            id="long",
            arrival_s=0.5,
            max_output_tokens=4,
            num_prompt_tokens=16000,
            segments=(Segment(2, 16000),),
        ),
    ]
    return Workload(name="stall", requests=reqs, mode=OpenLoop(), token_space=TokenSpace(), metadata={})


def test_a_long_prefill_stalls_decodes_only_on_an_aggregated_instance() -> None:
    w = stall_workload()
    agg = VirtualFleet(w, fleet(["both"]), RC).run()
    pd = VirtualFleet(
        w, fleet(["prefill", "decode"]), RC, disagg=DisaggSettings(mode=DisaggMode.ALWAYS)
    ).run()
    worst = {
        run: next(r for r in recs.records if r.id == "decoder").itl_max_s
        for run, recs in (("agg", agg), ("pd", pd))
    }
    # aggregated: one step computes a chunk of the 16k prompt beside the decode (8192-token budget)
    assert worst["agg"] > 0.3
    # disaggregated: the decode instance only decodes (and pulls the long prompt's KV cache meanwhile)
    assert worst["pd"] < 0.05
    long_pd = next(r for r in pd.records if r.id == "long")
    assert long_pd.prefill_instance == "sim-0" and long_pd.instance == "sim-1"
    assert long_pd.transfer_tokens == 16000


def test_every_split_request_completes_and_releases_everything() -> None:
    spec = EvalSpec(
        workload="sglang-gsp",
        overrides={"num_requests": 120, "num_groups": 6, "arrival": {"type": "poisson", "rate": 40}},
        fleet=fleet(["prefill", "prefill", "decode", "decode"], profile="qwen3-32b-2xh100"),
    )
    w = load_workload(spec)
    vf = VirtualFleet(w, spec.fleet, RC, disagg=DisaggSettings(mode=DisaggMode.ALWAYS))
    run = vf.run()
    assert all(r.finish_s is not None and not r.rejected for r in run.records)
    assert all(
        r.prefill_instance in ("sim-0", "sim-1") and r.instance in ("sim-2", "sim-3") for r in run.records
    )
    assert vf.router.load.total_in_flight() == 0
    assert all(e.num_held == 0 and e.num_loading == 0 for e in vf.engines)
    # prefill instances computed the prompts; decode instances received them and computed one token each
    prefill_work, decode_work = sum(run.work_tokens[:2]), sum(run.work_tokens[2:])
    assert prefill_work > 10 * len(run.records) and decode_work >= sum(r.output_tokens for r in run.records)
    # the cached tokens reported are the prefill instances' hits, and the router predicted them
    assert sum(r.cached_tokens for r in run.records) > 0
    exact = sum(r.predicted_cached_tokens == r.cached_tokens for r in run.records) / len(run.records)
    assert exact > 0.9
    # decode instances announced what they received: the index credits them with the shared prefixes
    for r in run.records[-5:]:
        tokens = vf.hashes.chain_hashes(w.requests[[q.id for q in w.requests].index(r.id)])
        found = {m.instance for m in vf.indexer.lookup_chains(tokens, r.prompt_tokens).instances}
        assert r.instance in found


def test_conditional_serves_later_turns_whole_on_the_decode_instance_that_holds_them() -> None:
    spec = EvalSpec(
        workload="multi-turn",
        overrides={"num_conversations": 12, "turns": 3},
        fleet=fleet(["prefill", "decode", "decode"]),
        policies=("kv-aware",),
    )
    res = run_one(spec, "kv-aware")
    reasons = res["pd_reasons"]
    assert reasons.get("short_uncached", 0) >= 24 - 2  # turns 2 and 3: the decode instance holds the history
    always = msgspec_replace(spec, mode=DisaggMode.ALWAYS)
    res_always = run_one(always, "kv-aware")
    assert res_always["split_fraction"] == 1.0
    assert res["ttft_p50_s"] < res_always["ttft_p50_s"]  # no second hop, no transfer for a short new part
    assert res["hit_rate"] > res_always["hit_rate"]  # the decode instance also holds the answers


def msgspec_replace(spec: EvalSpec, **disagg: object) -> EvalSpec:
    import msgspec

    return msgspec.structs.replace(spec, disagg=msgspec.structs.replace(spec.disagg, **disagg))


def test_roles_must_match_the_instances() -> None:
    w = stall_workload()
    with pytest.raises(ValueError, match="roles"):
        VirtualFleet(w, FleetSimConfig(instances=3, roles=["prefill", "decode"]), RC)


def test_kvrouter_eval_roles_compares_the_setups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    eval_cmd.add_arguments(p)
    out = tmp_path / "pd.json"
    args = p.parse_args(
        ["--workload", "sglang-gsp", "--set", "num_requests=16", "--set", "num_groups=2", "--roles", "1P1D",
         "--setups", "aggregated,conditional-load,predicted", "--profile", "test", "--jobs", "1",
         "--no-progress", "--json", str(out)]
    )  # fmt: skip
    assert eval_cmd.run(args) == 0
    res = json.loads(out.read_text())
    assert res["roles"] == "1P1D" and list(res["policies"]) == ["aggregated", "conditional-load", "predicted"]
    assert res["policies"]["aggregated"]["split_fraction"] == 0.0
    # each setup runs its own policy (predicted: the latency models rank the prefill pool too)
    assert {k: v["policy"] for k, v in res["policies"].items()} == {
        "aggregated": "kv-aware",
        "conditional-load": "kv-aware",
        "predicted": "predicted-latency",
    }
    assert all(r["completed"] == 16 for r in res["policies"].values())
    printed = capsys.readouterr().out
    assert "conditional-load" in printed and "SLO" in printed
    bad = p.parse_args(["--workload", "sglang-gsp", "--roles", "2Q", "--no-progress"])
    assert eval_cmd.run(bad) == 2


def test_kvrouter_sim_roles() -> None:
    p = argparse.ArgumentParser()
    sim_cmd.add_arguments(p)
    cfg = sim_cmd.config_from_args(
        p.parse_args(["--fleet-out", "x.yaml", "--roles", "2P1D", "--kv-lease", "5"])
    )
    assert cfg.instances == 3 and cfg.roles == ["prefill", "prefill", "decode"]
    assert [c.name for c in cfg.instance_configs(20000)] == ["sim-prefill-0", "sim-prefill-1", "sim-decode-0"]
    assert cfg.kv_transfer.lease_s == 5
