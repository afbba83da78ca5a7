"""The indexer fed the events of vLLM 0.33's own OffloadingConnector (tests/fixtures/vllm_offload, recorded
by tools/record_vllm_offload.py) knows what vLLM's CPU tier holds, and predicts the cached tokens vLLM
reports (GPU hit + blocks loaded from CPU).

What the recordings show about the connector's events, asserted here so a new vLLM cannot change them
unnoticed: without ``self_describing_kv_events`` every stored chunk is a placeholder of ONE hash (the
chunk's last block, no tokens, ``block_size`` 0, ``group_idx`` 0), a batch's chunks come in no particular
order, removals list every evicted chunk in one event; with it, each chunk is a full store (tokens, parent,
``block_size`` 16), again in no particular order (a child may precede its parent).  With chunks of two
blocks, a placeholder names one block of two: the index cannot know the other, the CPU tier's prefix is
full of holes (what ``kvrouter check`` explains), while self-describing events name both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from indexer import Indexer, SourceKey
from indexer.types import Medium
from indexer.wire import engine_hash_i64
from tests.support.recorded import VLLM_OFFLOAD, scenarios

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_offload"
SCENARIOS = scenarios(FIXTURES, VLLM_OFFLOAD)
SRC = SourceKey("vllm", 0)


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def cpu_chains(ix: Indexer) -> set[int]:
    """Our chain hashes the index holds in the CPU medium for the source."""
    from indexer.index import BlockIndex

    assert isinstance(ix.index, BlockIndex)
    rows = ix.index._chains.dump(int(Medium.CPU))
    return {int(c) for s, c, _ in rows.tolist() if s == ix.index.slot_id(SRC)}


@pytest.mark.parametrize("name", SCENARIOS)
def test_connector_event_shapes(name: str) -> None:
    fx = load(name)
    cfg = fx["config"]
    stores = removals = 0
    for rec in fx["steps"]:
        if "payload" not in rec:
            continue
        for ev in msgspec.msgpack.decode(bytes.fromhex(rec["payload"]))[1]:
            if ev.get("medium") != "CPU":
                continue
            assert ev["group_idx"] == 0
            if ev["type"] == "BlockRemoved":
                removals += 1
                continue
            stores += 1
            if cfg["self_describing_kv_events"]:
                assert len(ev["block_hashes"]) == cfg["blocks_per_chunk"]
                assert len(ev["token_ids"]) == cfg["blocks_per_chunk"] * cfg["block_size"]
                assert ev["block_size"] == cfg["block_size"]
            else:
                assert len(ev["block_hashes"]) == 1 and ev["token_ids"] == [] and ev["block_size"] == 0
    assert stores and removals


@pytest.mark.parametrize("name", SCENARIOS)
def test_index_holds_what_the_cpu_tier_holds(name: str) -> None:
    """After every step, the CPU blocks the index holds are those of the chunks vLLM's CPU manager holds:
    all of their blocks with self-describing events, only each chunk's last block with placeholders."""
    fx = load(name)
    bpc = fx["config"]["blocks_per_chunk"]
    full = fx["config"]["self_describing_kv_events"]
    ix = Indexer(fx["config"]["block_size"])
    resident_chunks: set[int] = set()
    engine_to_chain: dict[int, int] = {}
    for rec in fx["steps"]:
        if "payload" in rec:
            payload = bytes.fromhex(rec["payload"])
            ix.apply_payload("vllm", payload)
            for ev in msgspec.msgpack.decode(payload)[1]:
                if ev["type"] == "BlockStored" and ev.get("medium") == "GPU":
                    for h in ev["block_hashes"]:
                        c = ix.index.engine_chain(SRC, engine_hash_i64(h))
                        if c is not None:
                            engine_to_chain[engine_hash_i64(h)] = c
        resident_chunks = {engine_hash_i64(h) for h in rec["cpu"]}
        want_last = {engine_to_chain[e] for e in resident_chunks}
        got = cpu_chains(ix)
        if full:
            assert want_last <= got and len(got) == bpc * len(resident_chunks), rec["step"]
        else:
            assert got == want_last, rec["step"]
    assert resident_chunks
    errors = dict(ix.counters.event_errors)
    assert not errors and not ix.counters.decode_errors and not ix.counters.skipped_events
    if not full:
        assert ix.counters.placeholder_events > 0 and ix.counters.placeholder_blocks > 0


def predict(ix: Indexer, prompt: list[int], bs: int) -> int:
    best = max((m.matched_blocks for m in ix.lookup(prompt).instances), default=0)
    return min(best, (len(prompt) - 1) // bs) * bs


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.endswith("chunk1")])
def test_index_predicts_cached_tokens_with_the_cpu_tier(name: str) -> None:
    """Just before a request is first scheduled, the index's match (GPU + CPU tiers) is the number of cached
    tokens vLLM reports for it, loads from CPU included (chunks of one block)."""
    fx = load(name)
    bs = fx["config"]["block_size"]
    reqs = {r["id"]: r for r in fx["requests"]}
    ix = Indexer(bs)
    ix.register(SRC)
    seen: set[str] = set()
    from_cpu = 0
    for rec in fx["steps"]:
        first = [rid for rid in rec["scheduled"] if rid not in seen] + [
            rid for rid in rec["load_jobs"] if rid not in seen
        ]
        for rid in dict.fromkeys(first):
            seen.add(rid)
            got = predict(ix, reqs[rid]["prompt"], bs)
            assert got == reqs[rid]["num_cached_tokens"], (rid, rec["step"])
            res = ix.lookup(reqs[rid]["prompt"]).instances[0]
            from_cpu += res.tiers.get("CPU", 0)
        if "payload" in rec:
            ix.apply_payload("vllm", bytes.fromhex(rec["payload"]))
    assert from_cpu > 0, "the scenario never found a prompt on the CPU tier"


def test_placeholders_of_two_block_chunks_leave_holes() -> None:
    """With two-block chunks and placeholders, the index knows one block of each chunk on CPU: when request
    d comes, its system prompt has left the GPU and sits on CPU as two chunks, vLLM loads all 64 tokens,
    and the index predicts none (its first block's CPU copy was never named).  Self-describing events name
    both blocks and the prediction is vLLM's.  (What is left: vLLM loads from CPU whole chunks only, from
    a chunk boundary; a GPU hit of 3 blocks followed by a CPU chunk gives 48 tokens where the index, which
    does not know the chunk size, says 64: request h.)"""
    got = {}
    for name in ("cpu_placeholders_chunk2", "cpu_self_describing_chunk2"):
        fx = load(name)
        bs = fx["config"]["block_size"]
        reqs = {r["id"]: r for r in fx["requests"]}
        ix = Indexer(bs)
        for rec in fx["steps"]:
            if "d" in rec["load_jobs"]:
                assert reqs["d"]["num_cached_tokens"] == 64
                got[name] = ix.lookup(reqs["d"]["prompt"]).instances[0].tiers.get("CPU", 0) * bs
                break
            if "payload" in rec:
                ix.apply_payload("vllm", bytes.fromhex(rec["payload"]))
    assert got == {"cpu_placeholders_chunk2": 0, "cpu_self_describing_chunk2": 64}


@pytest.mark.parametrize("name", SCENARIOS)
def test_check_counts_the_placeholders_vllm_sent(name: str) -> None:
    """``kvrouter check``'s count (``wire.offload_placeholders``) on vLLM's own batches: every ``S1cp`` of
    the recording without ``self_describing_kv_events``, none with it."""
    from indexer.wire import BatchDecoder, offload_placeholders

    dec = BatchDecoder()
    steps = [s for s in load(name)["steps"] if "payload" in s]
    got = sum(offload_placeholders(dec.decode(bytes.fromhex(s["payload"]))) for s in steps)
    want = sum(s["events"].split().count("S1cp") for s in steps)
    assert got == want
    assert (want > 0) == ("placeholders" in name)
