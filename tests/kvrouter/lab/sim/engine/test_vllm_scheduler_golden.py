"""The simulated engine against vLLM 0.33's own scheduler and block pool (tests/fixtures/vllm_scheduler).

Each fixture was recorded by tools/record_vllm_scheduler.py: vLLM's ``Scheduler`` stepped with a fake
model, requests arriving at given steps.  The engine here gets the same requests at the same steps, the
same capacity (vLLM's ``num_gpu_blocks`` less its null block) and the same output tokens, and must:

* report the same ``cached_tokens`` per request (vLLM's ``prefill_stats.num_cached_tokens``);
* schedule the same number of requests and tokens, and preempt the same requests, step by step;
* publish the same events step by step, compared on the wire (vLLM's 0.33 payload against
  ``PayloadWriter("0.33.0")``) with every field, block hashes replaced by what they stand for: the
  engine's hashes are not vLLM's sha256, so a hash is named by (its parent's name, its block's tokens, its
  extra keys), the structure vLLM hashes.  A removal names the block it removes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.engine.payload import PayloadWriter
from tests.support.recorded import VLLM_SCHEDULER, BlockNamer, scenarios

FIXTURES = Path(__file__).resolve().parents[4] / "fixtures" / "vllm_scheduler"
SCENARIOS = scenarios(FIXTURES, VLLM_SCHEDULER)


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def simulate(fx: dict[str, Any]) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Run the engine through the recorded steps: cached tokens per request, and per step what it did."""
    cfg = fx["config"]
    eng = Engine(
        EngineConfig(
            cache=CacheConfig(block_size=cfg["block_size"], num_gpu_blocks=cfg["num_gpu_blocks"] - 1),
            scheduler=SchedulerConfig(
                max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"]
            ),
        )
    )
    writer = PayloadWriter("0.33.0")
    cached: dict[str, int] = {}
    steps: list[dict[str, Any]] = []
    for rec in fx["steps"]:
        k = rec["step"]
        for r in fx["requests"]:
            if r["arrival"] == k:
                eng.add_request(
                    r["id"],
                    r["prompt"],
                    r["max_tokens"],
                    cache_salt=r["cache_salt"],
                    lora_name=r["lora"],
                    output_token_ids=r["outputs"],
                )
        res = eng.step()
        for o in res.outputs:
            if o.first_token:
                cached[o.request_id] = o.cached_tokens
        events = eng.take_events()
        steps.append(
            {
                "num_scheduled": res.num_scheduled,
                "tokens": res.prefill_tokens + res.decode_tokens,
                "preempted": sorted(res.preempted),
                "payload": writer.payload(events, float(k)) if events else None,
            }
        )
    assert not eng.has_work(), "the engine has requests left after vLLM finished them all"
    return cached, steps


@pytest.mark.parametrize("name", SCENARIOS)
def test_cached_tokens_per_request_equal_vllms(name: str) -> None:
    fx = load(name)
    cached, _ = simulate(fx)
    want = {r["id"]: r["num_cached_tokens"] for r in fx["requests"]}
    assert cached == want


@pytest.mark.parametrize("name", SCENARIOS)
def test_steps_schedule_and_preempt_as_vllm(name: str) -> None:
    fx = load(name)
    _, steps = simulate(fx)
    for rec, got in zip(fx["steps"], steps, strict=True):
        want = (len(rec["scheduled"]), sum(rec["scheduled"].values()), rec["preempted"])
        assert (got["num_scheduled"], got["tokens"], got["preempted"]) == want, f"step {rec['step']}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_events_equal_vllms_step_by_step(name: str) -> None:
    fx = load(name)
    _, steps = simulate(fx)
    namer = BlockNamer()
    ours: dict[Any, int] = {}
    theirs: dict[Any, int] = {}
    for rec, got in zip(fx["steps"], steps, strict=True):
        want = namer.canonical(bytes.fromhex(rec["payload"]), theirs) if "payload" in rec else None
        have = namer.canonical(got["payload"], ours) if got["payload"] is not None else None
        assert have == want, f"step {rec['step']}"
