"""The simulated engine's CPU tier against vLLM 0.33's own OffloadingConnector (tests/fixtures/vllm_offload).

Each fixture was recorded by tools/record_vllm_offload.py: vLLM's ``Scheduler`` with the connector (its CPU
manager, LRU policy), a fake model whose worker completes every transfer in the step that queued it.  The
engine here gets the same requests at the same steps, the same GPU capacity (less vLLM's null block), the
same CPU tier (chunks of one or two blocks, placeholders or self-describing events) and the same output
tokens, and must:

* report the same ``cached_tokens`` per request (GPU hit + tokens loaded from CPU);
* schedule the same requests and tokens step by step, and start its loads from CPU in the same steps;
* hold the same chunks on CPU after every step (the recording's ``cpu``: the manager's ready chunks);
* publish the same events step by step on the wire (``PayloadWriter("0.33.0")``), every field compared,
  block hashes named by content (``BlockNamer``); the connector announces a batch's stores in the
  iteration order of a set, so a run of CPU stores is compared as a multiset.
"""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest

from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.engine.payload import PayloadWriter
from tests.support.recorded import VLLM_OFFLOAD, BlockNamer, scenarios

FIXTURES = Path(__file__).resolve().parents[4] / "fixtures" / "vllm_offload"
SCENARIOS = scenarios(FIXTURES, VLLM_OFFLOAD)


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def engine_for(cfg: dict[str, Any]) -> Engine:
    bpc = cfg["blocks_per_chunk"]
    return Engine(
        EngineConfig(
            cache=CacheConfig(
                block_size=cfg["block_size"],
                num_gpu_blocks=cfg["num_gpu_blocks"] - 1,
                cpu_offload_blocks=cfg["cpu_chunks"] * bpc,
                cpu_offload_blocks_per_chunk=bpc,
                cpu_offload_self_describing=cfg["self_describing_kv_events"],
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"]
            ),
        )
    )


def simulate(fx: dict[str, Any]) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Run the engine through the recorded steps: cached tokens per request, and per step what it did."""
    eng = engine_for(fx["config"])
    cpu = eng.kv.offload
    assert cpu is not None
    writer = PayloadWriter("0.33.0")
    cached: dict[str, int] = {}
    steps: list[dict[str, Any]] = []
    for rec in fx["steps"]:
        k = rec["step"]
        for r in fx["requests"]:
            if r["arrival"] == k:
                eng.add_request(r["id"], r["prompt"], r["max_tokens"], output_token_ids=r["outputs"])
        res = eng.step()
        for o in res.outputs:
            if o.first_token:
                cached[o.request_id] = o.cached_tokens
        events = eng.take_events()
        steps.append(
            {
                "num_scheduled": res.num_scheduled,
                "tokens": res.prefill_tokens + res.decode_tokens,
                "loads": res.loaded_tokens > 0,
                "payload": writer.payload(events, float(k)) if events else None,
                "cpu": cpu.chunk_keys(),
            }
        )
    assert not eng.has_work(), "the engine has requests left after vLLM finished them all"
    return cached, steps


def canonical(namer: BlockNamer, payload: bytes | None, seen: dict[Any, int]) -> list[Any] | None:
    """The batch's events named by content, each run of CPU stores sorted (its order is vLLM's set's)."""
    if payload is None:
        return None
    out: list[Any] = []
    events = namer.canonical(payload, seen)
    for cpu_store, run in groupby(events, lambda e: e["type"] == "BlockStored" and e["medium"] == "CPU"):
        items = list(run)
        out += sorted(items, key=lambda e: json.dumps(e, sort_keys=True)) if cpu_store else items
    return out


@pytest.mark.parametrize("name", SCENARIOS)
def test_cached_tokens_per_request_equal_vllms(name: str) -> None:
    fx = load(name)
    cached, _ = simulate(fx)
    want = {r["id"]: r["num_cached_tokens"] for r in fx["requests"]}
    assert cached == want
    assert any(c > 0 for c in want.values()), "the scenario never hit"


@pytest.mark.parametrize("name", SCENARIOS)
def test_steps_schedule_and_load_as_vllm(name: str) -> None:
    fx = load(name)
    _, steps = simulate(fx)
    for rec, got in zip(fx["steps"], steps, strict=True):
        want = (len(rec["scheduled"]), sum(rec["scheduled"].values()), bool(rec["load_jobs"]))
        assert (got["num_scheduled"], got["tokens"], got["loads"]) == want, f"step {rec['step']}"


def test_the_recordings_cover_what_the_tier_does() -> None:
    """Loads, CPU evictions, a whole prompt loaded, both chunk sizes and both event modes."""
    fxs = [load(n) for n in SCENARIOS]
    steps = [s for fx in fxs for s in fx["steps"]]
    assert any(s["load_jobs"] for s in steps)
    assert any(" Rc" in f" {s.get('events', '')}" for s in steps)
    assert any(r["num_cached_tokens"] == len(r["prompt"]) for fx in fxs for r in fx["requests"])
    configs = {(fx["config"]["blocks_per_chunk"], fx["config"]["self_describing_kv_events"]) for fx in fxs}
    assert configs == {(1, False), (2, False), (1, True), (2, True)}


@pytest.mark.parametrize("name", SCENARIOS)
def test_events_equal_vllms_step_by_step(name: str) -> None:
    fx = load(name)
    _, steps = simulate(fx)
    namer = BlockNamer()
    ours: dict[Any, int] = {}
    theirs: dict[Any, int] = {}
    cpu_events = 0
    for rec, got in zip(fx["steps"], steps, strict=True):
        want = canonical(namer, bytes.fromhex(rec["payload"]) if "payload" in rec else None, theirs)
        have = canonical(namer, got["payload"], ours)
        assert have == want, f"step {rec['step']}"
        cpu_events += sum(1 for e in want or [] if e.get("medium") == "CPU")
    assert cpu_events


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_cpu_tier_holds_vllms_chunks_after_every_step(name: str) -> None:
    """The chunks held, each named by its last block (the key both engines give it)."""
    fx = load(name)
    _, steps = simulate(fx)
    namer = BlockNamer()
    ours: dict[Any, int] = {}
    theirs: dict[Any, int] = {}
    for rec, got in zip(fx["steps"], steps, strict=True):
        if "payload" in rec:
            namer.canonical(bytes.fromhex(rec["payload"]), theirs)
        if got["payload"] is not None:
            namer.canonical(got["payload"], ours)
        assert {ours[h] for h in got["cpu"]} == {theirs[h] for h in rec["cpu"]}, f"step {rec['step']}"
    assert fx["steps"][-1]["cpu"]
