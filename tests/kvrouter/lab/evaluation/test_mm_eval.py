"""The multimodal agent workload in the evaluator: the index sees the engines' image keys as the gateway
would compute them (predictions exact), repeated screenshots and shared figures are hit only through
their identifiers, and a miss pays the encoder."""

from __future__ import annotations

import msgspec

from kvrouter.lab.evaluation.compare import EvalSpec, load_workload
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig, VirtualFleet
from kvrouter.lab.workloads.spec import MediaItem, Workload
from kvrouter.routing import RouterConfig

SPEC = EvalSpec(
    workload="multimodal-agent",
    overrides={"num_sessions": 6, "turns": 4, "num_questions": 24, "num_documents": 3},
    fleet=FleetSimConfig(instances=3, profile="qwen2.5-vl-72b-8xh100"),
)


def _run(w: Workload, policy: str) -> tuple[VirtualFleet, dict[str, int], int]:
    vf = VirtualFleet(w, SPEC.fleet, RouterConfig(policy=policy, shadow=False))
    run = vf.run()
    assert all(r.finish_s is not None and not r.rejected for r in run.records)
    return vf, {r.id: r.cached_tokens for r in run.records}, sum(run.encoder_tokens)


def test_kv_aware_predicts_the_image_blocks_it_finds() -> None:
    w = load_workload(SPEC)
    vf = VirtualFleet(w, SPEC.fleet, RouterConfig(policy="kv-aware", shadow=False))
    run = vf.run()
    recs = {r.id: r for r in run.records}
    exact = sum(r.predicted_cached_tokens == r.cached_tokens for r in run.records) / len(run.records)
    assert exact > 0.9
    # later turns are predicted (and found) past their first screenshot: the keys matched
    later = [r for r in w.requests if r.turn >= 2]
    assert later and all(recs[r.id].predicted_cached_tokens > r.items[1].offset for r in later)
    assert not run.index_errors


def test_images_are_told_apart_by_their_identifiers_only() -> None:
    """The same workload with every image renamed per request: the placeholder tokens are unchanged,
    yet nothing past a request's first image is a hit any more, and the encoder runs for every image."""
    w = load_workload(SPEC)
    renamed = msgspec.structs.replace(
        w,
        requests=[
            msgspec.structs.replace(
                r, items=tuple(MediaItem(f"{r.id}/{i}", it.offset, it.length) for i, it in enumerate(r.items))
            )
            for r in w.requests
        ],
    )
    _, cached, encoded = _run(w, "kv-aware")
    _, cached_renamed, encoded_renamed = _run(renamed, "kv-aware")
    first_image = {r.id: r.items[0].offset for r in w.requests}
    assert all(cached_renamed[k] <= first_image[k] for k in cached_renamed)
    assert sum(cached.values()) > sum(cached_renamed.values())
    every_image = sum(it.length for r in w.requests for it in r.items)
    assert encoded_renamed == every_image > encoded


def test_a_miss_costs_the_encoder_round_robin_pays_more_of_it() -> None:
    w = load_workload(SPEC)
    _, kv_cached, kv_encoded = _run(w, "kv-aware")
    _, rr_cached, rr_encoded = _run(w, "round-robin")
    assert sum(kv_cached.values()) > sum(rr_cached.values())
    assert rr_encoded > kv_encoded > 0
