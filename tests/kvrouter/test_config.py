"""The fleet file refuses a misspelt key anywhere, naming its path and the nearest valid name."""

from __future__ import annotations

from typing import Any

import pytest

from indexer.config import ConfigError, parse_fleet
from kvrouter.config import RouterFleetConfig

INST = {"name": "a", "url": "http://a:8000", "events": "tcp://a:5557"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"limits": {"concurency_threshold": 64}},
            "limits.concurency_threshold (did you mean concurrency_threshold?)",
        ),
        ({"routing": {"polcy": "random"}}, "routing.polcy (did you mean policy?)"),
        (
            {"instances": [INST, {**INST, "name": "b", "evnets": "x"}]},
            "instances[1].evnets (did you mean events?)",
        ),
        ({"models": {"m": {"tokeniser": "t"}}}, "models.m.tokeniser (did you mean tokenizer?)"),
        ({"routing": {"kv_aware": {"compute_wieght": 2}}}, "routing.kv_aware.compute_wieght"),
        ({"gateway": {"zzz": 1}}, "gateway.zzz"),
        ({"blok_size": 16}, "blok_size (did you mean block_size?)"),
    ],
)
def test_a_misspelt_key_is_refused_with_its_path(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match="unknown key") as e:
        parse_fleet(doc, RouterFleetConfig)
    assert message in str(e.value)


def test_every_unknown_key_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as e:
        parse_fleet({"limits": {"a": 1}, "routing": {"b": 2}}, RouterFleetConfig)
    assert "limits.a" in str(e.value) and "routing.b" in str(e.value)


def test_the_indexer_reads_the_routers_file_and_still_checks_its_own_sections() -> None:
    from indexer.config import FleetConfig

    doc = {"instances": [INST], "routing": {"policy": "random"}, "limits": {"max_in_flight": 4}}
    assert parse_fleet(doc, FleetConfig, other_sections=True).instances[0].name == "a"
    with pytest.raises(ConfigError, match=r"instances\[0\]\.evnets"):
        parse_fleet({"instances": [{**INST, "evnets": "x"}], "routing": {}}, FleetConfig, other_sections=True)


def test_roles_and_disaggregation_settings() -> None:
    doc = {
        "instances": [
            {**INST, "role": "prefill"},
            {**INST, "name": "b", "models": ["m1", "m2"], "model_roles": {"m2": "decode"}},
        ],
        "routing": {"disaggregation": {"mode": "always", "local_prefill_tokens": 1024}},
    }
    cfg = parse_fleet(doc, RouterFleetConfig)
    a, b = cfg.instances
    assert a.role_for("m1") == "prefill" and b.role_for("m1") == "both" and b.role_for("m2") == "decode"
    assert cfg.routing.disaggregation.mode == "always"
    assert cfg.routing.disaggregation.local_prefill_tokens == 1024
    bad: list[tuple[dict[str, Any], str]] = [
        ({"instances": [{**INST, "role": "decoder"}]}, "decoder"),
        ({"instances": [{**INST, "models": ["m1"], "model_roles": {"m3": "decode"}}]}, "does not serve"),
        ({"routing": {"disaggregation": {"mode": "sometimes"}}}, "sometimes"),
        ({"routing": {"disaggregation": {"local_prefill_token": 1}}}, "did you mean local_prefill_tokens"),
        ({"routing": {"disaggregation": {"prefill_busy_ratio": -1}}}, "must be >= 0"),
        ({"routing": {"disaggregation": {"prefill_policy": "fastest"}}}, "unknown policy"),
    ]
    for doc, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_fleet(doc, RouterFleetConfig)
