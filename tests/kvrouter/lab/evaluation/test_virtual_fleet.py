"""``VirtualFleet``'s fast paths change no decision: baselines run without the index route as with it."""

from __future__ import annotations

import msgspec
import pytest

from kvrouter.lab.evaluation.compare import EvalSpec, load_workload
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig, VirtualFleet
from kvrouter.routing import ALL_POLICIES, READS_INDEX, RouterConfig

SPEC = EvalSpec(
    workload="sglang-gsp",
    overrides={"num_requests": 200, "num_groups": 8, "arrival": {"type": "poisson", "rate": 150}},
    fleet=FleetSimConfig(instances=4, events=False),
)


@pytest.mark.parametrize("policy", sorted(set(ALL_POLICIES) - READS_INDEX))
def test_baselines_route_the_same_without_lookups(policy: str) -> None:
    w = load_workload(SPEC)
    rc = RouterConfig(policy=policy, shadow=False, concurrency_threshold=8)

    def run(lookups: bool) -> list[tuple[str, str | None, int, float | None]]:
        vf = VirtualFleet(w, SPEC.fleet, rc)
        assert vf.lookups is False  # events off and a policy that never reads the index
        vf.lookups = lookups
        return [(r.id, r.instance, r.cached_tokens, r.first_token_s) for r in vf.run().records]

    with_index = run(True)
    assert run(False) == with_index
    assert len({inst for _, inst, _, _ in with_index}) == 4  # the comparison saw real routing


def test_policies_that_read_the_index_keep_lookups() -> None:
    w = load_workload(SPEC)
    for policy in READS_INDEX:
        assert VirtualFleet(w, SPEC.fleet, RouterConfig(policy=policy)).lookups
    on = msgspec.structs.replace(SPEC.fleet, events=True)
    assert VirtualFleet(w, on, RouterConfig(policy="round-robin")).lookups


def test_eval_max_prefill_tokens_holds_requests_in_the_router() -> None:
    """``kvrouter eval --max-prefill-tokens N`` reaches the router: past N prompt tokens still to prefill
    at every target, a request waits in the router (dispatched after it arrived); without it, none does."""
    import argparse

    from kvrouter.lab.commands.eval import add_arguments, spec_from_args
    from kvrouter.lab.evaluation.compare import _router_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    w = load_workload(SPEC)
    waited = {}
    for cap in (0, 256):
        args = p.parse_args(
            ["--workload", "sglang-gsp", "--instances", "4", "--max-prefill-tokens", str(cap)]
        )
        spec = spec_from_args(args)
        assert spec.saturation.max_prefill_tokens == cap
        rc = _router_config(msgspec.structs.replace(SPEC, saturation=spec.saturation), "kv-aware")
        recs = VirtualFleet(w, SPEC.fleet, rc).run().records
        waited[cap] = sum(r.dispatch_s is not None and r.dispatch_s > r.arrival_s + 1e-9 for r in recs)
        assert all(r.first_token_s is not None for r in recs)
    assert waited[0] == 0 and waited[256] > 20, waited
