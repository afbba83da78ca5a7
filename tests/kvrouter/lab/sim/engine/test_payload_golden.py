"""The simulator's writer and publisher against bytes and frames written by each vLLM release's own code.

Every golden batch made only of events the simulated engine can emit (GPU stores with LoRA and salt, GPU
evictions, CPU offload placeholders and removals, clears) is rebuilt from its description as simulator
events and written by ``PayloadWriter`` for that release: the bytes must be *equal* to vLLM's, not merely
decode alike, because the simulator stands in for vLLM in every end-to-end test and byte equality is the
only check that covers fields the indexer ignores.  Batches with events the engine never emits (STORAGE
media, other KV-cache groups, hybrid-model metadata, digests as hashes, negative hashes) are left out.
(The ``offload`` batch, values chosen by the recorder, is among those: its STORAGE event.  What vLLM's
connector sends is held by tests/kvrouter/lab/sim/engine/test_offload_golden.py.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvrouter.lab.sim.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvrouter.lab.sim.engine.payload import PayloadWriter
from kvrouter.lab.sim.engine.types import BlockHash
from kvrouter.lab.sim.server.publisher import EventPublisher, PublisherConfig

WIRE = Path(__file__).resolve().parents[4] / "fixtures" / "wire"
GROUPS: list[dict[str, Any]] = json.loads((WIRE / "index.json").read_text())["groups"]


def golden(file: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((WIRE / file).read_text())
    return data


def sim_event(ev: dict[str, Any]) -> KVEvent | None:
    """The simulator event with this description, or None if the engine never emits such an event."""
    if ev["type"] == "AllBlocksCleared":
        return AllBlocksCleared()
    medium = ev.get("medium", "GPU")
    if medium not in ("GPU", "CPU") or any(isinstance(h, dict) or h < 0 for h in ev["block_hashes"]):
        return None
    if any(ev.get(f) is not None for f in ("locality", "ownership", "session_id", "lookahead_token_ids")):
        return None
    gpu_store = ev["type"] == "BlockStored" and medium == "GPU"
    if ev.get("kv_cache_spec_kind") != (
        "full_attention" if gpu_store and "kv_cache_spec_kind" in ev else None
    ):
        return None  # the engine models one full-attention group
    hashes = [BlockHash(h) for h in ev["block_hashes"]]
    if ev["type"] == "BlockRemoved":
        # the engine's GPU evictions are the block pool's (group 0); its CPU removals the connector's
        if ev.get("group_idx") != (0 if medium == "GPU" and "group_idx" in ev else None):
            return None
        return BlockRemoved(hashes, medium=medium)
    if ev.get("group_idx") not in (None, 0):
        return None
    keys = ev.get("extra_keys")
    return BlockStored(
        hashes,
        None if ev["parent_block_hash"] is None else BlockHash(ev["parent_block_hash"]),
        ev["token_ids"],
        ev["block_size"],
        lora_id=ev["lora_id"],
        lora_name=ev.get("lora_name"),
        medium=medium,
        extra_keys=None if keys is None else [None if k is None else tuple(k) for k in keys],
    )


def expressible(file: str) -> list[tuple[str, list[KVEvent], dict[str, Any]]]:
    out = []
    for b in golden(file)["batches"]:
        evs = [sim_event(e) for e in b["events"]]
        if all(e is not None for e in evs):
            out.append((b["name"], [e for e in evs if e is not None], b))
    return out


def cases() -> list[tuple[str, str]]:
    return [(g["file"], r) for g in GROUPS for r in g["releases"]]


def test_most_batches_are_expressible() -> None:
    """Guards the filter above: it must not quietly leave out what the engine does emit."""
    for g in GROUPS:
        names = {n for n, _, _ in expressible(g["file"])}
        assert {"stored_chain", "lora_salt", "removed", "eviction_run", "cleared", "publisher_rank"} <= names


@pytest.mark.parametrize("file,release", cases())
def test_writer_bytes_equal_vllm_bytes(file: str, release: str) -> None:
    for name, events, b in expressible(file):
        writer = PayloadWriter(release, dp_rank=b["dp_rank"] or 0)
        assert writer.payload(events, b["ts"]).hex() == b["payload"], f"{release} {name}"


@pytest.mark.parametrize("file", [g["file"] for g in GROUPS])
async def test_publisher_frames_equal_vllm_frames(file: str) -> None:
    """Topic, sequence and replay framing (``[b"", seq, payload]`` up to 0.25, ``[b"", topic, seq,
    payload]`` from 0.26, and the end marker) as the release's ``ZmqEventPublisher`` sent them."""
    rec = golden(file)
    release = rec["releases"][0]
    batches = [(events, b) for _, events, b in expressible(file) if not b["dp_rank"]]
    replay_by_payload = {f[-1]: f for f in rec["replay"]}
    end = rec["replay"][-1]
    tag = release.replace(".", "_")
    cfg = PublisherConfig(
        endpoint=f"inproc://sim-pub-{tag}",
        replay_endpoint=f"inproc://sim-replay-{tag}",
        topic=rec["topic"],
        release=release,
    )
    ctx = zmq.asyncio.Context()
    pub = EventPublisher(cfg, ctx=ctx)
    await pub.start()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(cfg.endpoint)
        await asyncio.sleep(0.2)  # the subscription reaches the PUB
        for events, b in batches:
            pub.publish(events, ts=b["ts"])
        for seq, (_, b) in enumerate(batches):
            frames = await asyncio.wait_for(sub.recv_multipart(), 3)
            want = [*rec["pub"][0][:1], seq.to_bytes(8, "big").hex(), b["payload"]]
            assert [f.hex() for f in frames] == want
        dealer.connect(cfg.replay_endpoint or "")
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        for seq, (_, b) in enumerate(batches[1:], start=1):
            frames = [f.hex() for f in await asyncio.wait_for(dealer.recv_multipart(), 3)]
            want = list(replay_by_payload[b["payload"]])
            want[-2] = seq.to_bytes(8, "big").hex()  # the sim published fewer batches: its own numbering
            assert frames == want
        assert [f.hex() for f in await asyncio.wait_for(dealer.recv_multipart(), 3)] == end
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        await pub.stop()
        ctx.destroy(linger=0)
