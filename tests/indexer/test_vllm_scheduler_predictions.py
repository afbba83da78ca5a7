"""The indexer fed vLLM's own events predicts the cached tokens vLLM then reports.

tests/fixtures/vllm_scheduler holds runs of vLLM 0.33's scheduler and block pool (tools/
record_vllm_scheduler.py): each step's published payload, and each request's ``num_cached_tokens``.  The
payloads are applied in order; just before the step in which a request is first scheduled, the index is
asked for the request's prompt (with its LoRA adapter and cache salt), and its answer, capped as vLLM caps
a hit (the last prompt token is always computed: at most ``(len - 1) // block_size`` blocks), must equal
what vLLM reported.

A router sees a step's events only after the step, so one thing can make them differ, and only it: a
request scheduled earlier *in the same step* evicted blocks the prediction counted (the index over-predicts)
or stored blocks the request then hit (it under-predicts).  Such a mismatch must be explained by that
step's own events, checked here from the payload, and must stay rare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from indexer import Indexer, SourceKey
from indexer.wire import engine_hash_i64
from tests.support.recorded import VLLM_SCHEDULER, scenarios

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_scheduler"
SCENARIOS = scenarios(FIXTURES, VLLM_SCHEDULER)
SRC = SourceKey("vllm", 0)


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def predict(ix: Indexer, req: dict[str, Any], bs: int) -> int:
    res = ix.lookup(req["prompt"], lora_name=req["lora"], cache_salt=req["cache_salt"])
    best = max((m.matched_blocks for m in res.instances), default=0)
    return min(best, (len(req["prompt"]) - 1) // bs) * bs


def removed_chains(ix: Indexer, payload: bytes) -> set[int]:
    """Our chain hashes of the blocks the step's batch removes (resolved before it is applied)."""
    out = set()
    for ev in msgspec.msgpack.decode(payload)[1]:
        if ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                c = ix.index.engine_chain(SRC, engine_hash_i64(h))
                if c is not None:
                    out.add(c)
    return out


@pytest.mark.parametrize("name", SCENARIOS)
def test_index_predicts_vllms_cached_tokens(name: str) -> None:
    fx = load(name)
    bs = fx["config"]["block_size"]
    reqs = {r["id"]: r for r in fx["requests"]}
    ix = Indexer(bs)
    seen: set[str] = set()
    exact = same_step = 0
    for rec in fx["steps"]:
        payload = bytes.fromhex(rec["payload"]) if "payload" in rec else None
        first = [rid for rid in rec["scheduled"] if rid not in seen]
        seen.update(first)
        predicted = {rid: predict(ix, reqs[rid], bs) for rid in first}
        gone = removed_chains(ix, payload) if payload is not None else set()
        if payload is not None:
            assert ix.apply_payload("vllm", payload) > 0
        for rid in first:
            req, want, got = reqs[rid], reqs[rid]["num_cached_tokens"], predicted[rid]
            if got == want:
                exact += 1
                continue
            same_step += 1
            others = [r for r in rec["scheduled"] if r != rid]
            assert others, f"{rid}: predicted {got}, vLLM {want}, alone in step {rec['step']}"
            chains = ix.chain_hashes(req["prompt"], lora_name=req["lora"], cache_salt=req["cache_salt"])
            if got > want:  # blocks the prediction counted were evicted in this very step
                assert gone & {int(c) for c in chains[want // bs : got // bs]}, f"{rid} step {rec['step']}"
            else:  # blocks stored in this very step: visible once the step's batch is applied
                assert predict(ix, req, bs) >= want, f"{rid} step {rec['step']}"
    assert exact + same_step == len(reqs)
    assert same_step <= max(1, len(reqs) // 10)
    assert not ix.counters.event_errors and not ix.counters.decode_errors and not ix.counters.skipped_events
