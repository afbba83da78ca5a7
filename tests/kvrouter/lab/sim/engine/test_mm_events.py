"""The simulated engine's multimodal events against vLLM's recordings (tests/fixtures/multimodal/).

Each recorded prompt (vLLM's ids and items) is run through the simulated engine with small prefill chunks;
the ``extra_keys`` of its BlockStored events, block by block, must be what vLLM's own block-key code gave
for that prompt, and the router's chains must match every stored block in the index.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from indexer import Indexer
from indexer.extra_keys import mm_request_chains
from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.engine.events import BlockStored
from kvrouter.lab.sim.engine.payload import PayloadWriter

FIXTURES = Path(__file__).resolve().parents[4] / "fixtures" / "multimodal"


def _cases(name: str) -> list[tuple[str, dict[str, Any]]]:
    fx = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    corpus = {c["id"]: c for c in json.loads((FIXTURES / "corpus.json").read_text(encoding="utf-8"))["cases"]}
    out = []
    for cid, want in fx["cases"].items():
        if want.get("items") and len(want["ids"]) >= fx["block_size"]:
            out.append((cid, {**want, "cache_salt": corpus[cid]["body"].get("cache_salt")}))
    return out


@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3_mm"])
def test_sim_events_carry_vllms_keys(name: str) -> None:
    cases = _cases(name)
    assert len(cases) > 50
    for cid, want in cases[:80]:
        bs = 16
        e = Engine(
            EngineConfig(
                cache=CacheConfig(block_size=bs, num_gpu_blocks=4096, enable_kv_cache_events=True),
                scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=16384),
            )
        )
        items = [tuple(x) for m in want["items"].values() for x in m]
        items.sort(key=lambda t: t[1])
        e.add_request("r", want["ids"], 1, cache_salt=want["cache_salt"], mm_items=items)
        stored: list[BlockStored] = []
        ix = Indexer(block_size=bs)
        pub = PayloadWriter()
        while e.has_work():
            e.step()
            evs = e.take_events()
            stored += [ev for ev in evs if isinstance(ev, BlockStored)]
            if evs:
                ix.apply_payload("sim", pub.payload(evs, ts=1.0))
        got = [list(k) if k else None for ev in stored for k in (ev.extra_keys or [])]
        n = len(want["ids"]) // bs
        vllm = want["event_extra_keys"]
        norm = [[list(x) if isinstance(x, tuple) else x for x in k] if k else None for k in got]
        assert norm[:n] == vllm, cid
        chains = mm_request_chains(want["ids"], bs, items, cache_salt=want["cache_salt"])
        assert [m.matched_blocks for m in ix.lookup_chains(chains, len(want["ids"])).instances] == [n], cid
