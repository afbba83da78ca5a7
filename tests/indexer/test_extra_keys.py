"""Per-block extra keys (``indexer.extra_keys``): literal cases, a reference model, every release's shape.

The vLLM-recorded cases (keys vLLM's own code computed for real prompts) are in
tests/tokenizer_cache/test_mm_parity.py; these hold the module to a clean-room reference of
``_gen_mm_extra_hash_keys`` on random item layouts, and to the event shapes of 0.20-0.33.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import Indexer
from indexer.encode import RELEASES, PayloadEncoder, version_tuple
from indexer.extra_keys import MMItem, block_mm_keys, decode_block_keys, mm_request_chains
from indexer.hashing import request_chains


def test_literal_blocks() -> None:
    items = [MMItem("a", 3, 10), MMItem("b", 13, 2), MMItem("c", 40, 4)]
    assert block_mm_keys(items, 4, 8) == [
        (("a", 3),),
        (("a", -5), ("b", 5)),
        (),
        (),
    ]
    assert block_mm_keys(items, 6, 8)[5] == (("c", 0),)
    assert block_mm_keys([MMItem("x", 0, 32)], 3, 16) == [(("x", 0),), (("x", -16),), ()]


def _reference(items: list[MMItem], n: int, bs: int) -> list[tuple[tuple[str, int], ...]]:
    """Every item whose range overlaps the block, in order, with its offset from the block's start."""
    return [
        tuple(
            (it.identifier, it.offset - b * bs)
            for it in items
            if it.offset < (b + 1) * bs and it.offset + it.length > b * bs
        )
        for b in range(n)
    ]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[MMItem], int, int]:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    pos = 0
    items = []
    for i in range(draw(st.integers(0, 6))):
        pos += draw(st.integers(0, 40))
        length = draw(st.integers(1, 50))
        items.append(MMItem(f"id{i % 3}", pos, length))
        pos += length
    total = pos + draw(st.integers(0, 40))
    return items, total // bs, bs


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_blocks_match_reference(layout: tuple[list[MMItem], int, int]) -> None:
    items, n, bs = layout
    assert block_mm_keys(items, n, bs) == _reference(items, n, bs)


def test_decode_every_shape() -> None:
    # lora, items, salt (block 0); a later block's bare string is not a salt
    k = decode_block_keys(["my-lora", ["img", 3], ["img2", -4], "tenant"], "my-lora", first=True)
    assert (k.salt, k.mm, k.other) == ("tenant", (("img", 3), ("img2", -4)), ())
    assert decode_block_keys(["tenant"], None, first=False).other == ("tenant",)
    assert decode_block_keys(None, None, first=True) == decode_block_keys([], None, first=True)
    assert decode_block_keys([b"\x01" * 32], None, first=False).other == (b"\x01" * 32,)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from([r for r in RELEASES if version_tuple(r) >= (0, 20, 0)]), st.booleans())
def test_event_and_request_meet_in_every_release(
    layout: tuple[list[MMItem], int, int], release: str, salted: bool
) -> None:
    """An event from any release that sends extra keys (0.20+) with vLLM's shape of them, and a request with
    the same items, chain alike; without the items, blocks holding an item never match."""
    items, n, bs = layout
    if n == 0:
        return
    salt = "tenant-1" if salted else None
    tokens = list(range(1, n * bs + 1))
    keys: list[object] = []
    for b, mm in enumerate(block_mm_keys(items, n, bs)):
        entry: list[object] = [[i, o] for i, o in mm]
        if b == 0 and salt:
            entry.append(salt)
        keys.append(entry or None)
    enc = PayloadEncoder(release)
    ix = Indexer(block_size=bs)
    ev = enc.stored(list(range(100, 100 + n)), None, tokens, bs, extra_keys=keys)
    assert ix.apply_payload("v", enc.batch([ev], ts=1.0)) == 1
    chains = mm_request_chains(tokens, bs, items, cache_salt=salt)
    assert [m.matched_blocks for m in ix.lookup_chains(chains, len(tokens)).instances] == [n]
    first_mm = next((b for b, mm in enumerate(block_mm_keys(items, n, bs)) if mm), n)
    plain = request_chains(tokens, bs, cache_salt=salt)
    assert [m.matched_blocks for m in ix.lookup_chains(plain, len(tokens)).instances] == [first_mm]
    assert np.array_equal(chains[:first_mm], plain[:first_mm])
