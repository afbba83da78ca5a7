"""The simulation agrees with the live path: the same workload through the gateway (real HTTP and ZeroMQ)
and through ``VirtualFleet`` reaches the same cache hit rate within 2 points; and both build prefix-hash's
key from the same text."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from kvrouter.api import parse_body
from kvrouter.lab import agreement
from kvrouter.lab.commands import agreement as command
from kvrouter.lab.evaluation.virtual_fleet import prefix_text
from kvrouter.lab.workloads import http_call, make_workload, materialize


@pytest.mark.parametrize(
    ("name", "form"),
    [
        ("sglang-gsp", "chat"),
        ("sglang-gsp", "text"),
        ("sglang-gsp", "tokens"),
        ("mooncake-conversation", None),
    ],
)
@pytest.mark.parametrize("n_chars", [16, 1024, 65536])
def test_prefix_text_is_what_the_gateway_hashes(name: str, form: str | None, n_chars: int) -> None:
    over = {"limit": 3} if form is None else {"form": form, "num_groups": 2, "prompts_per_group": 2}
    w = make_workload(name, **over)
    if form == "text":
        w = materialize(w, lambda r: [1] * len((r.text or "").split()))  # text is still what is sent
    for r in w.requests:
        call = http_call(r, w.token_space, model="m")
        parsed = parse_body(msgspec.json.encode(call.body), "chat" if r.messages else "completions")
        assert prefix_text(r, w.token_space, n_chars) == parsed.prefix_text()[:n_chars]


def test_sim_fleet_config_scales_live_overheads_by_speed() -> None:
    cfg = agreement.AgreementConfig(speed=4.0, instances=3, capacity_blocks=999)
    f = agreement.sim_fleet_config(cfg)
    assert (f.instances, f.capacity_blocks, f.profile) == (3, 999, cfg.profile)
    assert f.event_delay_s == pytest.approx(4 * cfg.live_event_delay_s)
    assert f.net_latency_s == pytest.approx(4 * cfg.live_net_latency_s)
    w = agreement.workload_for(cfg)
    assert w.closed_loop and len(w.requests) == 144 and all(r.messages for r in w.requests)


def test_command_arguments() -> None:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    cfg = command.config_from_args(
        p.parse_args(["--set", "num_groups=3", "--set", "form=text", "--speed", "2"])
    )
    assert cfg.overrides["num_groups"] == 3 and cfg.overrides["form"] == "text" and cfg.speed == 2.0
    assert cfg.overrides["system_len"] == agreement.DEFAULT_OVERRIDES["system_len"]


def test_live_and_simulated_hit_rates_agree_within_two_points() -> None:
    cfg = agreement.AgreementConfig(
        overrides={**agreement.DEFAULT_OVERRIDES, "num_groups": 8, "prompts_per_group": 12},
        instances=3,
        concurrency=8,
    )
    res = agreement.check(cfg)
    assert res.live_errors == 0
    assert res.prompt_token_mismatches == 0  # the simulation saw the very token ids the fleet served
    assert 0.5 < res.sim_hit_rate < 1.0
    assert abs(res.difference) <= 0.02, agreement.report(res)
    assert res.within_tolerance
