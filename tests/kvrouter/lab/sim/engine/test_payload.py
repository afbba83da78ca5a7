"""The simulator's events on the wire: each release's layout, decoded by the indexer's own decoder."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from indexer.encode import version_tuple
from indexer.wire import BatchDecoder
from indexer.wire import BlockRemoved as WireRemoved
from indexer.wire import BlockStored as WireStored
from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvrouter.lab.sim.engine.payload import PayloadWriter

# The writer against bytes written by vLLM's own classes, every release:
# tests/kvrouter/lab/sim/engine/test_payload_golden.py


def scenario() -> list[KVEvent]:
    """Real engine events of every kind: stores (salt + LoRA), removals, CPU placeholders, a clear."""
    e = Engine(
        EngineConfig(
            cache=CacheConfig(block_size=4, num_gpu_blocks=4, cpu_offload_blocks=8),
            scheduler=SchedulerConfig(max_num_batched_tokens=64),
        )
    )
    events: list[KVEvent] = []
    e.add_request("a", list(range(1, 10)), 1, lora_name="sql", cache_salt="t1")
    e.add_request("b", [50] * 8, 1)
    while e.has_work():
        e.step()
        events += e.take_events()
    e.add_request("c", [60] * 12, 1)  # evicts
    while e.has_work():
        e.step()
        events += e.take_events()
    assert e.reset_prefix_cache()
    events += e.take_events()
    kinds = {(type(ev).__name__, getattr(ev, "medium", None)) for ev in events}
    assert kinds == {
        ("BlockStored", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),
        ("AllBlocksCleared", None),
    }
    return events


def raw(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload)


def test_033_maps_with_extra_keys_and_zero_size_placeholders() -> None:
    events = scenario()
    batch = raw(PayloadWriter("0.33.0", dp_rank=2).payload(events, 5.0))
    assert len(batch) == 3 and batch[0] == 5.0 and batch[2] == 2
    first = batch[1][0]
    assert set(first) == {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",  # the KV-cache manager labels stores with their group's kind from 0.23
    }
    assert first["kv_cache_spec_kind"] == "full_attention"
    assert first["type"] == "BlockStored" and first["lora_name"] == "sql" and first["lora_id"] == 1
    assert first["extra_keys"] == [["sql", "t1"], ["sql"]]
    plain = next(
        ev
        for ev in batch[1]
        if ev["type"] == "BlockStored" and ev["medium"] == "GPU" and ev["lora_id"] is None
    )
    assert plain["extra_keys"] == [None, None]
    cpu = next(ev for ev in batch[1] if ev["type"] == "BlockStored" and ev["medium"] == "CPU")
    assert cpu["token_ids"] == [] and cpu["block_size"] == 0 and cpu["parent_block_hash"] is None
    # the connector's placeholder (tests/fixtures/vllm_offload): group 0, no extra_keys nor kind
    assert cpu["group_idx"] == 0 and "extra_keys" not in cpu and "kv_cache_spec_kind" not in cpu
    removed = next(ev for ev in batch[1] if ev["type"] == "BlockRemoved")
    # the block pool's eviction names its KV-cache group (0.20+; tests/fixtures/wire)
    assert set(removed) == {"type", "block_hashes", "medium", "group_idx"} and removed["group_idx"] == 0
    assert len(removed["block_hashes"]) == 1
    assert batch[1][-1] == {"type": "AllBlocksCleared"}


def test_023_positional_events() -> None:
    events = scenario()
    batch = raw(PayloadWriter("0.23.0").payload(events, 5.0))
    first = batch[1][0]
    assert first[0] == "BlockStored" and len(first) == 12
    assert first[4] == 4 and first[6] == "GPU" and first[7] == "sql" and first[8] == [["sql", "t1"], ["sql"]]
    cpu = next(ev for ev in batch[1] if ev[0] == "BlockStored" and ev[6] == "CPU")
    assert cpu[3] == [] and cpu[4] == 4  # block_size 0 only from 0.33
    removed = next(ev for ev in batch[1] if ev[0] == "BlockRemoved")
    assert removed[2:] == ["GPU", 0]  # medium, group_idx (the block pool names group 0 from 0.20)
    assert batch[1][-1] == ["AllBlocksCleared"]


def test_09_has_no_rank_and_short_events() -> None:
    batch = raw(PayloadWriter("0.9.0", dp_rank=3).payload(scenario(), 5.0))
    assert len(batch) == 2
    stored = [ev for ev in batch[1] if ev[0] == "BlockStored"]
    assert {len(ev) for ev in stored} == {6}  # hashes, parent, tokens, block_size, lora_id
    assert {len(ev) for ev in batch[1] if ev[0] == "BlockRemoved"} == {2}


@pytest.mark.parametrize("release", ["0.9.0", "0.10.2", "0.16.0", "0.20.0", "0.23.0", "0.25.0", "0.33.0"])
def test_the_indexer_decoder_reads_every_release(release: str) -> None:
    events = scenario()
    got = BatchDecoder().decode(PayloadWriter(release, dp_rank=1).payload(events, 5.0))
    assert not got.skipped and len(got.events) == len(events)
    assert got.dp_rank == (None if release == "0.9.0" else 1)
    for mine, wire in zip(events, got.events):
        if isinstance(mine, BlockStored):
            assert isinstance(wire, WireStored)
            assert wire.block_hashes == mine.block_hashes
            assert wire.parent_block_hash == mine.parent_block_hash
            assert msgspec.msgpack.decode(bytes(wire.token_ids)) == mine.token_ids
            if version_tuple(release) >= (0, 16, 0):
                assert wire.lora_name == mine.lora_name
        elif isinstance(mine, BlockRemoved):
            assert isinstance(wire, WireRemoved) and wire.block_hashes == mine.block_hashes
        else:
            assert isinstance(mine, AllBlocksCleared)
