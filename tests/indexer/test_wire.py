"""Decoding every vLLM release's payload shape, and the golden bytes from the reference."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import Indexer, SourceKey
from indexer.encode import RELEASES, PayloadEncoder
from indexer.wire import BatchDecoder, BlockRemoved, BlockStored, engine_hash_u64

GOLDEN_033_STORED = bytes.fromhex(
    "93cb41d954fc4000000091de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cd1111cd2222"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00200102030405060708090a0b0c0d0e0f10111213"
    "1415161718191a1b1c1d1e1f20aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e"
    "616d65c0a967726f75705f6964780000"
)
GOLDEN_023_STORED = bytes.fromhex(
    "93cb41d954fc40000000919cab426c6f636b53746f72656492cd1111cd2222c0dc00200102030405060708090a0b0c0d0e0f1011"
    "12131415161718191a1b1c1d1e1f2010c0a3475055c0c000c0c000"
)
GOLDEN_033_REMOVED = bytes.fromhex(
    "93cb41d954fc404000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cd2222a66d656469756da347505500"
)
GOLDEN_033_CLEARED = bytes.fromhex("93cb41d954fc408000009181a474797065b0416c6c426c6f636b73436c656172656400")
TS = 1700000000.0


def test_encoder_reproduces_golden_bytes() -> None:
    e = PayloadEncoder("0.33.0")
    assert e.batch([e.stored([0x1111, 0x2222], None, range(1, 33), 16)], ts=TS) == GOLDEN_033_STORED
    assert e.batch([e.removed([0x2222])], ts=TS + 1) == GOLDEN_033_REMOVED
    assert e.batch([e.cleared()], ts=TS + 2) == GOLDEN_033_CLEARED
    e23 = PayloadEncoder("0.23.0")
    assert e23.batch([e23.stored([0x1111, 0x2222], None, range(1, 33), 16)], ts=TS) == GOLDEN_023_STORED


@pytest.mark.parametrize("payload", [GOLDEN_033_STORED, GOLDEN_023_STORED])
def test_golden_stored_decodes(payload: bytes) -> None:
    b = BatchDecoder().decode(payload)
    assert b.ts == TS and b.dp_rank == 0 and not b.skipped
    (ev,) = b.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [0x1111, 0x2222]
    assert ev.parent_block_hash is None
    assert msgspec.msgpack.decode(ev.token_ids) == list(range(1, 33))
    assert (ev.block_size, ev.medium, ev.group_idx, ev.lora_name) == (16, "GPU", 0, None)


def test_golden_removed_and_cleared_decode() -> None:
    d = BatchDecoder()
    (rm,) = d.decode(GOLDEN_033_REMOVED).events
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == [0x2222] and rm.medium == "GPU"
    (cl,) = d.decode(GOLDEN_033_CLEARED).events
    assert not isinstance(cl, BlockStored | BlockRemoved)


@pytest.mark.parametrize("release", RELEASES)
def test_every_release_round_trips_through_the_indexer(release: str) -> None:
    e = PayloadEncoder(release)
    toks = list(range(100, 164))
    ix = Indexer(16)
    p1 = e.batch([e.stored([1, 2], None, toks[:32], 16)], ts=TS, dp_rank=1)
    p2 = e.batch([e.stored([3, 4], 2, toks[32:], 16), e.removed([1])], ts=TS + 1, dp_rank=1)
    assert ix.apply_payload("v", p1) == 1
    assert ix.apply_payload("v", p2) == 2
    rank = 1 if e.has_rank else 0
    (m,) = ix.lookup(toks).instances
    assert (m.instance, m.dp_rank) == ("v", rank)
    assert m.matched_blocks == 0  # block 1 (the first) was removed: a hole at the start
    assert ix.index.blocks(SourceKey("v", rank))[0] == 3
    assert ix.apply_payload("v", e.batch([e.cleared()], ts=TS + 2, dp_rank=1)) == 1
    assert ix.index.blocks(SourceKey("v", rank))[0] == 0
    assert not ix.counters.event_errors and not ix.counters.decode_errors


@pytest.mark.parametrize(
    "h", [-1, -(2**63), 2**64 - 1, 0, b"\x00" * 24 + b"\x01\x02\x03\x04\x05\x06\x07\x08"]
)
def test_hash_forms_normalise_consistently(h: int | bytes) -> None:
    """Negative int64 (0.9/0.10.0), unsigned int and digest bytes all resolve parents and removals."""
    e = PayloadEncoder("0.10.0")
    ix = Indexer(4)
    ix.apply_payload("v", e.batch([e.stored([h], None, [1, 2, 3, 4], 4)], ts=TS))
    ix.apply_payload("v", e.batch([e.stored([7], h, [5, 6, 7, 8], 4)], ts=TS))
    assert ix.lookup([1, 2, 3, 4, 5, 6, 7, 8]).instances[0].matched_blocks == 2
    ix.apply_payload("v", e.batch([e.removed([h])], ts=TS))
    assert ix.lookup([1, 2, 3, 4, 5, 6, 7, 8]).instances[0].matched_blocks == 0
    assert not ix.counters.event_errors
    if isinstance(h, int):
        assert engine_hash_u64(h) == h % 2**64


def test_absent_and_extra_fields_and_unknown_tags() -> None:
    enc = msgspec.msgpack.Encoder()
    events = [
        # map event with unknown keys and only the first fields present
        {
            "type": "BlockStored",
            "block_hashes": [5],
            "token_ids": [1, 2, 3, 4],
            "block_size": 4,
            "future_field": 1,
        },
        # positional event with extra trailing elements (a newer release's fields)
        ["BlockRemoved", [99], "GPU", None, "LOCAL", "mine", "something-new"],
        {"type": "BlockTeleported", "block_hashes": [1]},
        ["SomethingElse", 1, 2],
        {"type": "BlockStored", "block_hashes": "not-a-list"},
    ]
    ix = Indexer(4)
    applied = ix.apply_payload("v", enc.encode([TS, events, 0]))
    assert applied == 2
    assert ix.counters.skipped_events == {"unknown_tag": 2, "bad_event": 1}
    assert ix.lookup([1, 2, 3, 4]).instances[0].matched_blocks == 1
    # a map batch is tolerated
    ix.apply_payload("w", enc.encode({"ts": TS, "events": [events[0]], "data_parallel_rank": 2}))
    assert SourceKey("w", 2) in ix.sources()


@pytest.mark.parametrize(
    "payload,reason",
    [
        (b"", "empty"),
        (b"\xc1", "batch_shape"),
        (b"\x93\xcb\x41", "msgpack"),
        (msgspec.msgpack.encode(["x", [], 0]), "batch_shape"),
        (msgspec.msgpack.encode([1.0, 5, 0]), "events_shape"),
        (msgspec.msgpack.encode([1.0, [], -3]), "batch_shape"),
    ],
)
def test_bad_payloads_are_counted_not_raised(payload: bytes, reason: str) -> None:
    ix = Indexer(16)
    assert ix.apply_payload("v", payload) == 0
    assert ix.counters.decode_errors == {reason: 1}


def test_bad_blocks_are_counted_by_reason() -> None:
    e = PayloadEncoder()
    ix = Indexer(4)
    bad = [
        e.stored([1, 2], None, [1, 2, 3, 4], 4),  # 4 tokens for 2 blocks
        e.stored([3], 12345, [1, 2, 3, 4], 4),  # unknown parent
        e.stored([4], None, [1, 2, 3, 4, 5, 6, 7, 8], 8),  # block size differs from the fleet's
        e.removed([777]),  # never stored
        e.stored([5], None, [1, 2, 3, 4], 4, medium="TAPE"),
    ]
    ix.apply_payload("v", e.batch(bad, ts=TS))
    assert ix.counters.event_errors == {
        "bad_block_shape": 1,
        "unknown_parent": 1,
        "block_size_mismatch": 1,
        "unknown_removed_block": 1,
        "bad_field": 1,
    }
    assert ix.block_size_mismatch == {SourceKey("v", 0): 8}
    assert ix.trust(SourceKey("v", 0)).value == "degraded"


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("h", [0, 5, 300, 2**40, 2**64 - 1])
def test_removed_raw_is_byte_identical(release: str, h: int) -> None:
    e = PayloadEncoder(release)
    for medium in ("GPU", "CPU", None):
        assert e.batch([e.removed_raw(h, medium)], ts=TS) == e.batch([e.removed([h], medium=medium)], ts=TS)


@pytest.mark.parametrize("release", ["0.9.0", "0.23.0", "0.33.0"])
def test_batches_of_encoded_runs_are_byte_identical(release: str) -> None:
    e = PayloadEncoder(release)
    big = [2**63 + 5, 2**40 + 1, 2**64 - 1]
    small = [5, 300, 2**40]
    for hashes in (big, small):
        evs = [e.removed([h]) for h in hashes] + [e.stored([1], None, range(16), 16)]
        want = e.batch(evs, ts=TS, dp_rank=1)
        parts = [e.removed_run(hashes), msgspec.msgpack.encode(evs[-1])]
        assert e.batch_of_encoded(parts, len(evs), ts=TS, dp_rank=1) == want
    many = [e.removed([2**50 + i]) for i in range(70_000)]
    assert e.batch_of_encoded([e.removed_run([2**50 + i for i in range(70_000)])], 70_000, ts=TS) == e.batch(
        many, ts=TS
    )


def test_chained_hashes_equal_chaining_content_hashes() -> None:
    from indexer.hashing import chain, chained_hashes, content_hashes

    toks = [(i * 7919) % 130_000 for i in range(1000)]
    for start, n, prev in ((0, 10**6, 0), (3, 20, 12345), (61, 5, -7), (70, 5, 1)):
        assert (
            chained_hashes(toks, 16, start, n, prev).tolist()
            == chain(content_hashes(toks, 16, start, n), prev).tolist()
        )


@settings(max_examples=200, deadline=None)
@given(
    toks=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1)), max_size=200),
    block_size=st.integers(1, 40),
    start=st.integers(0, 4),
    n=st.integers(-1, 8),
    dtype=st.sampled_from(["uint32", "int64", "uint64"]),
)
def test_content_hashes_of_arrays_equal_those_of_lists(
    toks: list[int], block_size: int, start: int, n: int, dtype: str
) -> None:
    """The simulator hands prompts over as numpy arrays: the array kernel must hash exactly as the msgpack
    parse of the same ints does (the reference: the list path the gateway uses)."""
    import numpy as np

    from indexer.hashing import content_hashes

    want = content_hashes(toks, block_size, start, n).tolist()
    assert content_hashes(np.array(toks, dtype=dtype), block_size, start, n).tolist() == want
    from indexer.hashing import chained_hashes

    for prev in (0, -7, 2**62 + 3):
        chained = chained_hashes(toks, block_size, start, max(n, 0) or 10**6, prev).tolist()
        got = chained_hashes(np.array(toks, dtype=dtype), block_size, start, max(n, 0) or 10**6, prev)
        assert got.tolist() == chained


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16])
def test_content_hashes_of_arrays_reject_ids_outside_uint32(bad: list[int]) -> None:
    import numpy as np

    from indexer.hashing import TokenEncodingError, content_hashes

    with pytest.raises(TokenEncodingError):
        content_hashes(np.array(bad, dtype=np.int64), 16)


def test_lookup_from_a_uint32_array_equals_lookup_from_a_list() -> None:
    """The gateway hands the index uint32 arrays; every match must be the one a list of ints gets."""
    import numpy as np

    ix = Indexer(16)
    e = PayloadEncoder("0.33.0")
    toks = [(i * 7919) % 150_000 for i in range(16 * 300)]
    for k, n in enumerate((300, 120, 7)):
        ix.apply_payload(f"v{k}", e.batch([e.stored(list(range(1, n + 1)), None, toks[: n * 16], 16)], ts=TS))
    for q in (toks, toks[:1000], toks[:2000] + [1] * 100, [5] * 64):
        want = ix.lookup(q, cache_salt="s" if len(q) == 64 else None)
        got = ix.lookup(np.array(q, dtype=np.uint32), cache_salt="s" if len(q) == 64 else None)
        assert got == want
        assert ix.lookup(np.array(q, dtype=np.uint32)).instances == ix.lookup(q).instances
