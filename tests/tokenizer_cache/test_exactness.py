"""Cached tokenization == full tokenization, on four real tokenizers (100 % equal or the test fails).

The reference is transformers itself (``tok(text)["input_ids"]``, what vLLM calls).  The caches use
tiny chunks, margins and seam strides so that short texts exercise many seams; each Hypothesis example
starts from an empty cache so a failure replays deterministically.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.tokenizer_kit import ALL_PIECES, SPECIAL_STRINGS, build_all, corpus_text
from tokenizer_cache import CacheConfig, CachedTokenizer

NAMES = ("deepseek", "bytelevel", "metaspace", "wordpiece")
TIGHT = CacheConfig(
    chunk_chars=32,
    margin_chars=8,
    overlap_chars=4,
    seam_stride_tokens=3,
    seam_tail_tokens=12,
    seam_tail_stride_tokens=1,
)
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_all(Path(tmp_path_factory.mktemp("tokenizers")))


@pytest.fixture(scope="module")
def cached(tokenizer_dirs: dict[str, str]) -> Iterator[dict[str, CachedTokenizer]]:
    toks = {
        name: CachedTokenizer.from_pretrained(path, config=TIGHT) for name, path in tokenizer_dirs.items()
    }
    yield toks
    for t in toks.values():
        t.close()


def _pieces(name: str) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(ALL_PIECES + list(SPECIAL_STRINGS[name])),
        st.text(max_size=6),
        st.sampled_from([" ", "\n", "  ", "\t", "\n\n", "   "]),
    )


def _text(name: str, min_pieces: int, max_pieces: int) -> st.SearchStrategy[str]:
    return st.lists(_pieces(name), min_size=min_pieces, max_size=max_pieces).map("".join)


def _check(ct: CachedTokenizer, text: str) -> None:
    res = ct.encode_prompt(text)
    want = ct.encode_uncached(text)
    assert res.tokens == want, f"cached != full for {text!r}"
    # The array the router hashes (when the cache had one at hand) holds the very same ids.
    assert res.token_array().tolist() == want
    assert res.array is None or res.array.dtype.name == "uint32"


@pytest.mark.parametrize("name", NAMES)
def test_seeded_differential(cached: dict[str, CachedTokenizer], name: str) -> None:
    """Many cut-and-continue variants of one long text; the seed is in the assertion message."""
    ct = cached[name]
    ct.clear()
    seed = 1000 + NAMES.index(name)
    rng = random.Random(seed)
    extra = SPECIAL_STRINGS[name]
    base = corpus_text(rng, 300, extra)
    before = ct.stats()
    for i in range(150):
        cut = rng.randrange(len(base) + 1)
        text = base[:cut] + corpus_text(rng, rng.randrange(0, 8), extra)
        assert ct.encode_prompt(text).tokens == ct.encode_uncached(text), f"seed={seed} case={i}"
    after = ct.stats()
    assert after.hits - before.hits > 100, "the cache was not exercised"
    ct.check_invariants()


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_appends_after_cached_prefix(
    cached: dict[str, CachedTokenizer], name: str, data: st.DataObject
) -> None:
    ct = cached[name]
    ct.clear()
    base = data.draw(_text(name, 20, 80), label="base")
    _check(ct, base)
    for _ in range(3):
        _check(ct, base + data.draw(_text(name, 0, 12), label="append"))


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_edits_after_cached_prefix(
    cached: dict[str, CachedTokenizer], name: str, data: st.DataObject
) -> None:
    ct = cached[name]
    ct.clear()
    base = data.draw(_text(name, 20, 80), label="base")
    _check(ct, base)
    for _ in range(3):
        cut = data.draw(st.integers(0, len(base)), label="cut")
        drop = data.draw(st.integers(0, 8), label="drop")
        edited = base[:cut] + data.draw(_text(name, 0, 4), label="insert") + base[cut + drop :]
        _check(ct, edited)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_growing_text_and_prefix_queries(
    cached: dict[str, CachedTokenizer], name: str, data: st.DataObject
) -> None:
    """A text that grows turn by turn (superseding entries), with queries on its prefixes in between."""
    ct = cached[name]
    ct.clear()
    text = data.draw(_text(name, 5, 30), label="start")
    for _ in range(5):
        text += data.draw(_text(name, 1, 20), label="turn")
        _check(ct, text)
        _check(ct, text[: data.draw(st.integers(0, len(text)), label="prefix")])
    ct.check_invariants()


def test_special_tokens_wrapping_matches_transformers(cached: dict[str, CachedTokenizer]) -> None:
    """BOS (bytelevel), BOS+EOS (metaspace), CLS/SEP (wordpiece), nothing (deepseek); with and without."""
    rng = random.Random(5)
    for name, ct in cached.items():
        text = corpus_text(rng, 120, SPECIAL_STRINGS[name])
        for add in (True, False):
            ct.clear()
            ct.encode_prompt(text[:-20], add_special_tokens=add)
            got = ct.encode_prompt(text, add_special_tokens=add)
            want = ct.encode_uncached(text, add_special_tokens=add)
            assert got.tokens == want, (name, add)
            assert got.array is not None and got.array.tolist() == want, (name, add)
            assert got.reused_tokens > 0, (name, add)
            assert got.tokens[: got.reused_tokens] == want[: got.reused_tokens]


def test_tail_seams_are_denser_and_leave_the_rest_alone(cached: dict[str, CachedTokenizer]) -> None:
    """``seam_tail_*``: more reuse boundaries near the end of a cached text, the same ones before it."""
    from array import array

    from tokenizer_cache.seams import sample_seams

    ct = cached["deepseek"]
    text = corpus_text(random.Random(7), 4000)
    enc = ct._encode(text)
    n = len(enc.ids)
    assert n > 1200

    def seams(tail_tokens: int, tail_stride: int) -> list[int]:
        pos: array[int] = array("i")
        idx: array[int] = array("i")
        sample_seams(
            enc, n, stride=16, first_token=0, min_rel_pos=0, pos_offset=0, idx_offset=0,
            out_pos=pos, out_idx=idx, tail_tokens=tail_tokens, tail_stride=tail_stride,
        )  # fmt: skip
        assert list(pos) == sorted(set(pos))
        return list(idx)

    uniform, dense = seams(0, 0), seams(512, 4)
    cut = n - 512 - 16
    assert [i for i in dense if i <= cut] == [i for i in uniform if i <= cut]
    in_tail = [i for i in dense if i > cut]
    assert len(in_tail) >= 2.5 * len([i for i in uniform if i > cut])
    assert in_tail and max(in_tail) > n - 8
