"""The datrie prefix index on its own: literal cases, forced digest collisions, LRU bound, invariant (I)."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer_cache.prefix_index import (
    Entry,
    Ids,
    PrefixIndex,
    SplicedIds,
    common_prefix_len,
    head_list,
    spliced,
)


def _add(ix: PrefixIndex, text: str, *, supersedes: Entry | None = None) -> Entry | None:
    digests = ix.chunk_digests(text)
    match = ix.lookup(text, digests)
    known = match.shared_chunks if match is not None else 0
    ids = tuple(range(len(text)))  # one "token" per character is enough for the index
    seams = array("i", range(1, len(text))), array("i", range(1, len(text)))
    return ix.insert(
        text, ids, seams, ix.entry_digests(text, digests), known_keys=known, supersedes=supersedes
    )


class CollidingIndex(PrefixIndex):
    """Every chunk gets the same digest: lookups must still find only true common prefixes."""

    def chunk_digests(self, text: str) -> str:
        return "\x01\x01\x01\x01" * (len(text) // self.chunk_chars)


def test_common_prefix_len() -> None:
    assert common_prefix_len("abcdef", "abcxyz") == 3
    assert common_prefix_len("abc", "abcdef") == 3
    assert common_prefix_len("", "abc") == 0
    long_a = "x" * 1000 + "a" + "y" * 50
    long_b = "x" * 1000 + "b"
    assert common_prefix_len(long_a, long_b) == 1000
    assert common_prefix_len(long_a, long_b, 400) == 1000


def test_lookup_finds_longest_whole_chunk_match_and_exact_common_prefix() -> None:
    ix = PrefixIndex(chunk_chars=16, max_bytes=1 << 30)
    a = "A" * 16 + "B" * 16 + "C" * 16 + "tail"
    b = "A" * 16 + "B" * 16 + "D" * 20
    _add(ix, a)
    _add(ix, b)
    m = ix.lookup(a[:40] + "zzzz" * 10, ix.chunk_digests(a[:40] + "zzzz" * 10))
    assert m is not None and m.entry.text == a and m.common == 40 and m.shared_chunks == 2
    m = ix.lookup(b + "!", ix.chunk_digests(b + "!"))
    assert m is not None and m.entry.text == b and m.common == len(b)
    assert ix.lookup("Q" * 40, ix.chunk_digests("Q" * 40)) is None
    assert ix.lookup("short", ix.chunk_digests("short")) is None  # less than one chunk: no key
    ix.check_invariants()


def test_collisions_cost_reuse_never_correctness() -> None:
    ix = CollidingIndex(chunk_chars=16, max_bytes=1 << 30)
    _add(ix, "a" * 64)
    q = "b" * 64
    m = ix.lookup(q, ix.chunk_digests(q))
    assert m is not None and m.common == 0  # the trie matched, the text comparison did not
    q = "a" * 20 + "c" * 44
    m = ix.lookup(q, ix.chunk_digests(q))
    assert m is not None and m.common == 20


def test_supersede_takes_over_slot_and_keys_stay_valid() -> None:
    ix = PrefixIndex(chunk_chars=16, max_bytes=1 << 30)
    turn1 = "system prompt.. " * 3 + "user: hi"
    e1 = _add(ix, turn1)
    turn2 = turn1 + " assistant: hello, how can I help? user: more"
    e2 = _add(ix, turn2, supersedes=e1)
    assert e1 is not None and e2 is not None and e2.slot == e1.slot and len(ix) == 1
    ix.check_invariants()
    m = ix.lookup(turn1 + "!", ix.chunk_digests(turn1 + "!"))
    assert m is not None and m.entry is e2 and m.common == len(turn1)


def test_lru_eviction_keeps_bound_and_invariant() -> None:
    texts = [f"{i:03d}" * 67 for i in range(10)]
    # An entry's size depends on its digests (a str of bytes from the per-process randomised hash: 16
    # or 24 bytes less when every one of them is ASCII), so the budget is taken from these texts' own
    # sizes: any three fit, no four do.
    one = PrefixIndex(chunk_chars=16, max_bytes=1 << 30)
    sizes = [e.nbytes for t in texts if (e := _add(one, t[:200])) is not None]
    assert len(sizes) == 10 and 4 * min(sizes) > 3 * max(sizes) + 10
    ix = PrefixIndex(chunk_chars=16, max_bytes=3 * max(sizes) + 10)
    for t in texts:
        _add(ix, t[:200])
        assert ix.bytes_held <= ix.max_bytes
        ix.check_invariants()
    assert len(ix) == 3 and ix.evictions == 7
    assert [e.text for e in ix.entries()] == [t[:200] for t in texts[-3:]]
    big = PrefixIndex(chunk_chars=16, max_bytes=100)
    assert _add(big, "y" * 500) is None and len(big) == 0


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 6), st.integers(0, 40), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    cap=st.integers(2_000, 40_000),
)
def test_random_inserts_and_evictions_keep_invariant(ops: list[tuple[str, int, int, bool]], cap: int) -> None:
    """Texts built from few chunk shapes share prefixes heavily; growth sometimes supersedes."""
    ix = PrefixIndex(chunk_chars=16, max_bytes=cap)
    live: list[str] = []
    for letter, chunks, tail, grow in ops:
        text = "".join(f"{letter}{k % 3}" * 8 for k in range(chunks)) + "t" * tail
        old = None
        if grow and live:
            base = live[-1]
            text = base + text
            m = ix.lookup(base, ix.chunk_digests(base))
            old = m.entry if m is not None and m.entry.text == base else None
        if _add(ix, text, supersedes=old) is not None:
            live.append(text)
        assert ix.bytes_held <= cap
        ix.check_invariants()
        # every live entry is still found through the trie, with its whole text in common
        for e in ix.entries():
            if len(e.text) >= 16:
                m = ix.lookup(e.text, ix.chunk_digests(e.text))
                assert m is not None and m.common >= len(e.text) // 16 * 16


def test_heir_ranges_that_straddle_another_entrys_keys() -> None:
    """E first; G shares E's first 2 chunks; H shares G's first 4.  Evicting E makes H (the most
    recently used holder) the heir of E's first 2 keys, while keys 3-4 stay G's."""
    c = 16
    e_text = "".join(f"E{k}" * 8 for k in range(6))
    g_text = e_text[: 2 * c] + "".join(f"G{k}" * 8 for k in range(4))
    h_text = g_text[: 4 * c] + "".join(f"H{k}" * 8 for k in range(3))
    ix = PrefixIndex(chunk_chars=c, max_bytes=1 << 30)
    for t in (e_text, g_text, h_text):
        _add(ix, t)
    ix.check_invariants()
    ix.max_bytes = sum(e.nbytes for e in ix.entries()) - 1  # the next insert evicts E
    _add(ix, "Z" * 64)
    assert [e.text for e in ix.entries()] == [g_text, h_text, "Z" * 64]
    ix.check_invariants()
    scratch = _add(PrefixIndex(chunk_chars=c, max_bytes=1 << 30), "Y" * 64)
    assert scratch is not None
    ix.max_bytes = ix.bytes_held + scratch.nbytes - 1  # the next insert evicts G: keys 3-4 move to H
    _add(ix, "Y" * 64)
    assert [e.text for e in ix.entries()] == [h_text, "Z" * 64, "Y" * 64]
    ix.check_invariants()
    m = ix.lookup(h_text, ix.chunk_digests(h_text))
    assert m is not None and m.entry.text == h_text and m.common == len(h_text)


@settings(max_examples=200, deadline=None)
@given(
    base=st.lists(st.integers(0, 9), max_size=30),
    ops=st.lists(
        st.tuples(st.integers(0, 40), st.lists(st.integers(10, 19), max_size=8)), min_size=1, max_size=6
    ),
    data=st.data(),
)
def test_spliced_ids_equal_the_lists_they_stand_for(
    base: list[int], ops: list[tuple[int, list[int]]], data: st.DataObject
) -> None:
    """``SplicedIds`` against plain lists: each splice ``ids[:n] + tail`` shares the root tuple and reads
    (length, items, slices, head_list) like the list it stands for."""
    ids: Ids = tuple(base)
    root = ids
    ref = list(base)
    for n, tail in ops:
        n = min(n, len(ref))
        assert head_list(ids, n) == ref[:n]
        ids, ref = spliced(ids, n, tail), ref[:n] + tail
        # shares the root when it uses most of it (never a chain), else holds its own tuple (a new root)
        if isinstance(ids, SplicedIds):
            assert ids.base is root and 2 * ids.cut >= len(root)
        else:
            assert isinstance(ids, tuple)
            root = ids
        assert len(ids) == len(ref) and list(ids) == ref
        if ref:
            i = data.draw(st.integers(-len(ref), len(ref) - 1))
            assert ids[i] == ref[i]
        a = data.draw(st.integers(-3, len(ref) + 3))
        b = data.draw(st.integers(-3, len(ref) + 3))
        assert list(ids[a:b]) == ref[a:b]
        assert list(ids[::2]) == ref[::2]
