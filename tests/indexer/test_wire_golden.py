"""The indexer's decoder against payloads written by each vLLM release's own code.

tests/fixtures/wire/ holds, per group of releases with identical recordings, the bytes that release's
``kv_events.py`` classes and ``ZmqEventPublisher`` produced (tools/record_wire_golden.py) and the events as
that release's objects held them.  Nothing here is produced by our encoder.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest

from indexer import Indexer, SourceKey
from indexer.encode import RELEASES
from indexer.wire import AllBlocksCleared, BatchDecoder, BlockRemoved, BlockStored, engine_hash_u64

WIRE = Path(__file__).resolve().parent.parent / "fixtures" / "wire"

DECODED = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
IGNORED = {"locality", "ownership", "session_id", "lookahead_token_ids"}
"""Fields vLLM sends that routing does not use: the decoder skips them (their presence must not hurt)."""


@cache
def index() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((WIRE / "index.json").read_text())
    return data


@cache
def golden(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((WIRE / name).read_text())
    return data


def group_files() -> list[str]:
    return [g["file"] for g in index()["groups"]]


def batches() -> list[tuple[str, str]]:
    return [(f, b["name"]) for f in group_files() for b in golden(f)["batches"]]


def batch(file: str, name: str) -> dict[str, Any]:
    (b,) = [b for b in golden(file)["batches"] if b["name"] == name]
    return b


def value(v: Any) -> Any:
    """A description value as Python: ``{"bytes": hex}`` -> bytes; lists stay lists."""
    if isinstance(v, dict) and set(v) == {"bytes"}:
        return bytes.fromhex(v["bytes"])
    if isinstance(v, list):
        return [value(x) for x in v]
    return v


def test_every_supported_release_has_a_recording() -> None:
    assert set(index()["releases"]) == set(RELEASES)
    for g in index()["groups"]:
        assert golden(g["file"])["releases"] == g["releases"]


@pytest.mark.parametrize("file,name", batches())
def test_golden_payload_decodes_field_by_field(file: str, name: str) -> None:
    b = batch(file, name)
    decoded = BatchDecoder().decode(bytes.fromhex(b["payload"]))
    assert not decoded.skipped
    assert decoded.ts == b["ts"]
    assert decoded.dp_rank == b["dp_rank"]
    assert len(decoded.events) == len(b["events"])
    for got, want in zip(decoded.events, b["events"], strict=True):
        kind = want["type"]
        assert isinstance(
            got, {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}.get(kind, AllBlocksCleared)
        )
        sent = set(want) - {"type"}
        assert sent - set(DECODED[kind]) <= IGNORED, f"vLLM field the decoder does not know: {sent}"
        for field in DECODED[kind]:
            have = getattr(got, field)
            if field == "token_ids":
                have = msgspec.msgpack.decode(have)
            if field == "extra_keys" and have is not None:
                have = [None if k is None else list(k) for k in have]
            # a field the release does not have decodes to its default (None; block hashes always exist)
            assert have == value(want.get(field)), f"{kind}.{field}"


@pytest.mark.parametrize("file", group_files())
def test_hashes_normalise_to_one_id_whatever_their_form(file: str) -> None:
    """Negative int64 (0.9, 0.10.0), uint64 and 32-byte digests (0.10.2+ with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) all become one unsigned 64-bit engine id."""
    b = batch(file, "hash_forms")
    stored1, stored2, removed = b["events"]
    hashes = [value(h) for h in stored1["block_hashes"] + stored2["block_hashes"]]
    for h in hashes:
        u = engine_hash_u64(h)
        assert 0 <= u < 2**64
        assert u == (int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h % 2**64)
    assert value(removed["block_hashes"]) == hashes[:1]
    assert value(stored2["parent_block_hash"]) == hashes[1]


@pytest.mark.parametrize("file", group_files())
def test_the_indexer_applies_each_release_stream(file: str) -> None:
    """The recorded batches in order, through the real index: chains, LoRA + salt, removals, offload links,
    clears, and hashes in every form resolving parents and removals."""
    ix = Indexer(16)
    rec = golden(file)

    def apply(name: str) -> int:
        return ix.apply_payload("vllm", bytes.fromhex(batch(file, name)["payload"]))

    toks = list(range(1, 49))
    rank1 = 1 if batch(file, "lora_salt")["dp_rank"] == 1 else 0
    assert apply("stored_chain") == 2 and apply("lora_salt") == 1

    def matched(tokens: list[int], **kw: str) -> dict[SourceKey, int]:
        return {
            SourceKey(m.instance, m.dp_rank): m.matched_blocks
            for m in ix.lookup(tokens, **kw).instances
            if m.matched_blocks
        }

    assert matched(toks) == {SourceKey("vllm", 0): 3}
    lora = list(range(101, 133))
    has_lora_name = "lora_name" in batch(file, "lora_salt")["events"][0]
    has_salt = batch(file, "lora_salt")["events"][0].get("extra_keys") is not None
    if has_lora_name and has_salt:
        assert matched(lora, lora_name="sql-lora", cache_salt="salt-A") == {SourceKey("vllm", rank1): 2}
        assert matched(lora) == {}  # salted, adapter blocks never match a plain prompt
    if "offload" in {b["name"] for b in rec["batches"]}:
        assert apply("offload") == 3  # CPU and STORAGE placeholders link to the GPU blocks by engine hash
        (m,) = [m for m in ix.lookup(toks).instances if m.dp_rank == 0]
        assert m.matched_blocks == 3
    assert apply("removed") == 2
    assert matched(toks) == {SourceKey("vllm", 0): 1}  # blocks 2 and 3 gone on the GPU
    assert ix.apply_payload("vllm", bytes.fromhex(batch(file, "cleared")["payload"])) == 1
    assert matched(toks) == {}
    assert apply("hash_forms") == 3
    assert matched(toks) == {}  # the first of the three blocks was removed again: a hole at the start
    assert not ix.counters.event_errors and not ix.counters.decode_errors


@pytest.mark.parametrize("file", group_files())
def test_the_eviction_run_is_one_event_per_block(file: str) -> None:
    b = batch(file, "eviction_run")
    payload = bytes.fromhex(b["payload"])
    events = BatchDecoder().decode(payload).events
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved)] == [
        [0x100000000 + i] for i in range(17)
    ]
    assert not any(isinstance(e, BlockStored) for e in events)
