"""Token streams and block content hashes of workload prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.hashing import TokenEncodingError, content_hashes, request_chains
from kvrouter.lab.workloads import (
    BlockContentCache,
    NotMaterialized,
    Request,
    Segment,
    TokenSpace,
    hash_token_array,
    prompt_ids,
    prompt_tokens,
)
from kvrouter.lab.workloads.tokens import derive_key, segments_tokens, stream_tokens, streams_tokens

SPACE = TokenSpace()


def req(*segments: Segment, salt: str | None = None, rid: str = "r") -> Request:
    return Request(
        id=rid,
        arrival_s=0.0,
        max_output_tokens=1,
        num_prompt_tokens=sum(s.length for s in segments),
        segments=segments,
        cache_salt=salt,
    )


def test_stream_is_deterministic_and_prefix_consistent() -> None:
    a = stream_tokens(SPACE, 12345, 512)
    assert np.array_equal(a, stream_tokens(SPACE, 12345, 512))
    assert np.array_equal(stream_tokens(SPACE, 12345, 100), a[:100])
    assert np.array_equal(stream_tokens(SPACE, 12345, 100, start=412), a[412:])
    b = stream_tokens(SPACE, 12346, 512)
    assert (a != b).mean() > 0.99  # different keys differ almost everywhere


def test_streams_concatenate_like_single_streams() -> None:
    keys = np.array([1, 2**64 - 1, 7], dtype=np.uint64)
    lengths = np.array([3, 0, 40])
    starts = np.array([5, 0, 1])
    got = streams_tokens(SPACE, keys, lengths, starts)
    parts = [stream_tokens(SPACE, int(k), int(n), int(s)) for k, n, s in zip(keys, lengths, starts)]
    want = np.concatenate(parts)
    assert np.array_equal(got, want)


def test_token_space_bounds_and_exclusions() -> None:
    space = TokenSpace(vocab_size=1010, low=1000, excluded=(1003, 1007, 5))
    t = stream_tokens(space, 99, 20_000)
    assert t.min() >= 1000 and t.max() < 1010
    assert not np.isin(t, [1003, 1007]).any()
    assert set(np.unique(t).tolist()) == {1000, 1001, 1002, 1004, 1005, 1006, 1008, 1009}
    big = stream_tokens(SPACE, 1, 100_000)
    assert big.min() >= SPACE.low and big.max() < SPACE.vocab_size
    with pytest.raises(ValueError):
        stream_tokens(TokenSpace(vocab_size=10, low=10), 1, 1)


LABELS = [(0, "sglang-gsp", "system", 0), (7, "mooncake", 3), (2**40, "a", "b", "c"), (1, "ü", -5)]


def test_derived_keys_are_stable() -> None:
    # Stable across processes: Python's own hash() of a string changes with PYTHONHASHSEED, this must not.
    code = "from kvrouter.lab.workloads.tokens import derive_key; import sys, json; "
    code += f"print(json.dumps([derive_key(*k) for k in {LABELS!r}]))"
    got = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", code],
                env={**os.environ, "PYTHONHASHSEED": seed},
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for seed in ("1", "2")
    ]
    assert got[0] == got[1] == [derive_key(*k) for k in LABELS]
    # Pinned: a change here changes every workload's tokens, and so every figure computed on them.
    assert derive_key(0, "pin") == 14743009973280880236
    assert stream_tokens(SPACE, derive_key(0, "pin"), 4).tolist() == [102896, 31180, 114543, 38229]


labels_st = st.lists(st.one_of(st.text(max_size=4), st.integers(-3, 3)), max_size=4)


@settings(max_examples=300, deadline=None)
@given(a=st.tuples(st.integers(0, 2), labels_st), b=st.tuples(st.integers(0, 2), labels_st))
def test_distinct_label_tuples_get_distinct_keys(
    a: tuple[int, list[str | int]], b: tuple[int, list[str | int]]
) -> None:
    """Label boundaries and types are part of the key: ("a", 1) is not ("a1",) nor ("a", "1")."""
    same = a[0] == b[0] and [(type(x), x) for x in a[1]] == [(type(x), x) for x in b[1]]
    assert (derive_key(a[0], *a[1]) == derive_key(b[0], *b[1])) == same


def test_near_collisions_of_labels() -> None:
    keys = [
        derive_key(*k)
        for k in [(0, "a", 1), (0, "a", "1"), (0, "a1"), (0, "a", 1, ""), (0, "a"), (1, "a", 1), (0, 1, "a")]
    ]
    assert len(set(keys)) == len(keys)


def test_prompt_forms() -> None:
    r = req(Segment(1, 10), Segment(2, 5))
    ids = prompt_ids(r, SPACE)
    assert len(ids) == 15 and all(isinstance(i, int) for i in ids)
    assert ids[:10] == stream_tokens(SPACE, 1, 10).tolist()
    explicit = Request(id="x", arrival_s=None, max_output_tokens=1, num_prompt_tokens=3, token_ids=[5, 6, 7])
    assert prompt_ids(explicit, SPACE) == [5, 6, 7]
    text = Request(id="t", arrival_s=None, max_output_tokens=1, num_prompt_tokens=3, text="a b c")
    with pytest.raises(NotMaterialized):
        prompt_tokens(text, SPACE)
    with pytest.raises(NotMaterialized):
        BlockContentCache(SPACE, 16).content_hashes(text)


def test_hash_token_array_is_the_indexers_hash() -> None:
    tokens = stream_tokens(SPACE, 5, 1000)
    for bs in (1, 16, 33, 512):
        assert np.array_equal(hash_token_array(tokens, bs), content_hashes(tokens.tolist(), bs))
    small = np.array([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1], dtype=np.uint32)
    assert np.array_equal(hash_token_array(small, 3), content_hashes(small.tolist(), 3))
    assert len(hash_token_array(tokens[:15], 16)) == 0
    with pytest.raises(TokenEncodingError):
        hash_token_array(np.array([1, 2**32], dtype=np.int64), 1)


segments_st = st.lists(
    st.builds(Segment, st.sampled_from([11, 22, 33, 2**64 - 5]), st.integers(0, 70)), min_size=0, max_size=5
)


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(segments_st, min_size=1, max_size=6), block_size=st.sampled_from([1, 4, 16, 32]))
def test_block_cache_matches_direct_hashing(prompts: list[list[Segment]], block_size: int) -> None:
    """Cached per-segment hashes (lazy and warmed) equal hashing the materialized tokens."""
    lazy = BlockContentCache(SPACE, block_size)
    warmed = BlockContentCache(SPACE, block_size)
    requests = [req(*p) for p in prompts]
    warmed.warm(requests)
    for r in requests:
        want = content_hashes(segments_tokens(SPACE, r.segments).tolist(), block_size)
        assert np.array_equal(lazy.content_hashes(r), want)
        assert np.array_equal(warmed.content_hashes(r), want)
        salted = msgspec.structs.replace(r, cache_salt="s")
        want_chain = request_chains(prompt_ids(r, SPACE), block_size, cache_salt="s")
        assert np.array_equal(lazy.chain_hashes(salted), want_chain)


def test_block_cache_literal() -> None:
    cache = BlockContentCache(SPACE, 16)
    full = req(Segment(7, 512))
    part = req(Segment(7, 100))
    assert len(cache.content_hashes(part)) == 6  # 100 // 16; the 4 tail tokens make no block
    assert np.array_equal(cache.content_hashes(full)[:6], cache.content_hashes(part))
    assert len(cache) == 1 and cache.misses == 2  # the longer use replaced the shorter
    assert cache.nbytes == 32 * 8
    # A segment ending off a block boundary: the straddling block mixes both streams.
    mixed = req(Segment(7, 24), Segment(8, 24))
    want = content_hashes(prompt_ids(mixed, SPACE), 16)
    assert np.array_equal(cache.content_hashes(mixed), want) and len(want) == 3
    with pytest.raises(ValueError):
        BlockContentCache(SPACE, 0)
