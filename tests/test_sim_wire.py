"""The simulator's events on the wire: each release's layout, decoded by the indexer's own decoder."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from indexer.encode import version_tuple
from indexer.wire import BatchDecoder
from indexer.wire import BlockRemoved as WireRemoved
from indexer.wire import BlockStored as WireStored
from kvrouter.sim import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.sim.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvrouter.sim.payload import PayloadWriter
from kvrouter.sim.types import BlockHash

GOLDEN_033 = bytes.fromhex(
    "93cb41d954fc4000000091de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd1111cd2222"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00200102030405060708090a0b0c0d0e0f10111213"
    "1415161718191a1b1c1d1e1f20aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e"
    "616d65c0a967726f75705f6964780000"
)
GOLDEN_023 = bytes.fromhex(
    "93cb41d954fc40000000919cab426c6f636b53746f72656492cd1111cd2222c0dc00200102030405060708090a0b0c0d0e0f1011"
    "12131415161718191a1b1c1d1e1f2010c0a3475055c0c000c0c000"
)


def test_the_writer_reproduces_vllm_golden_bytes() -> None:
    ev = BlockStored([BlockHash(0x1111), BlockHash(0x2222)], None, list(range(1, 33)), 16)
    assert PayloadWriter("0.33.0").payload([ev], 1700000000.0) == GOLDEN_033
    assert PayloadWriter("0.23.0").payload([ev], 1700000000.0) == GOLDEN_023


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
    }
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
    assert "group_idx" not in cpu and "extra_keys" not in cpu  # the connector sets neither
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
