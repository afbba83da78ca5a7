"""The reuse ceiling against a brute-force reference (token tuples in a set), and literal cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.lab.workloads import (
    OpenLoop,
    Request,
    Segment,
    TokenSpace,
    Workload,
    reuse_ceiling,
    reuse_ceiling_by,
    reuse_hits,
)
from kvrouter.lab.workloads.mooncake import MooncakeOptions, MooncakeRow, rows_to_workload
from kvrouter.lab.workloads.tokens import segments_tokens

SPACE = TokenSpace()


def workload(requests: list[Request]) -> Workload:
    return Workload(name="t", requests=requests, mode=OpenLoop(), token_space=SPACE, metadata={})


def make(i: int, segs: list[Segment], salt: str | None = None, out: list[Segment] | None = None) -> Request:
    return Request(
        id=f"r{i}",
        arrival_s=float(i),
        max_output_tokens=max(1, sum(s.length for s in out or [])),
        num_prompt_tokens=sum(s.length for s in segs),
        segments=tuple(segs),
        output_segments=tuple(out or ()),
        cache_salt=salt,
    )


def brute_force_hits(w: Workload, block_size: int, count_outputs: bool = True) -> list[int]:
    """An infinite cache of (salt, all tokens up to the end of a full block); vLLM's counting."""
    seen: set[tuple[str | None, tuple[int, ...]]] = set()
    hits = []
    for r in w.requests:
        tokens = segments_tokens(SPACE, r.segments).tolist()
        n = len(tokens)
        cached = 0
        while cached < n // block_size and (r.cache_salt, tuple(tokens[: (cached + 1) * block_size])) in seen:
            cached += 1
        hits.append(min(cached, max(n - 1, 0) // block_size) * block_size)
        grown = tokens
        if count_outputs and r.output_segments:
            grown = tokens + segments_tokens(SPACE, r.output_segments).tolist()[:-1]
        for j in range(len(grown) // block_size):
            seen.add((r.cache_salt, tuple(grown[: (j + 1) * block_size])))
    return hits


seg = st.builds(Segment, st.sampled_from([101, 202, 303, 404]), st.integers(0, 40))
request_st = st.tuples(
    st.lists(seg, min_size=0, max_size=4),
    st.sampled_from([None, None, "a", "b"]),
    st.lists(seg, min_size=0, max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(request_st, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 4, 8, 16]),
    count_outputs=st.booleans(),
)
def test_ceiling_matches_brute_force(
    specs: list[tuple[list[Segment], str | None, list[Segment]]], block_size: int, count_outputs: bool
) -> None:
    w = workload([make(i, segs, salt, out) for i, (segs, salt, out) in enumerate(specs)])
    got = reuse_hits(w, block_size, count_outputs=count_outputs).tolist()
    assert got == brute_force_hits(w, block_size, count_outputs)


def _tree_rows(draw: st.DrawFn) -> list[MooncakeRow]:
    """Mooncake-like rows: each extends a prefix of an earlier row's ids with fresh ids."""
    rows: list[MooncakeRow] = []
    next_id = 0
    for t in range(draw(st.integers(1, 7))):
        base: list[int] = []
        if rows and draw(st.booleans()):
            parent = draw(st.sampled_from(rows))
            # Only full blocks of the parent can be shared (a partial id is never reused in full).
            full = len(parent.hash_ids) - (1 if parent.input_length % 512 else 0)
            base = parent.hash_ids[: draw(st.integers(0, full))]
        fresh = draw(st.integers(0 if base else 1, 3))
        ids = base + list(range(next_id, next_id + fresh))
        next_id += fresh
        # Without fresh ids the row repeats a full-block prefix exactly; otherwise its last id may be partial.
        tail = draw(st.integers(1, 512)) if fresh else 512
        length = 512 * (len(ids) - 1) + tail
        rows.append(MooncakeRow(timestamp=t, input_length=length, output_length=1, hash_ids=ids))
    return rows


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([16, 64, 512]))
def test_mooncake_ceiling_matches_brute_force(data: st.DataObject, block_size: int) -> None:
    rows = _tree_rows(data.draw)
    w = rows_to_workload(list(enumerate(rows)), "tree", MooncakeOptions())
    assert reuse_hits(w, block_size).tolist() == brute_force_hits(w, block_size)


def test_vllm_counting_literal() -> None:
    a = make(0, [Segment(1, 64)])
    again = make(1, [Segment(1, 64)])  # fully cached: the last block is recomputed
    longer = make(2, [Segment(1, 64), Segment(2, 10)])  # hits all 4 blocks of a
    odd = make(3, [Segment(1, 65)])  # 65 tokens: 4 cached blocks, all allowed (64 <= 65 - 1)
    w = workload([a, again, longer, odd])
    assert reuse_hits(w, 16).tolist() == [0, 48, 64, 64]
    assert reuse_ceiling(w, 16) == pytest.approx((48 + 64 + 64) / (64 + 64 + 74 + 65))
    assert reuse_ceiling(workload([]), 16) == 0.0


def test_salts_isolate_and_outputs_count() -> None:
    plain = [make(0, [Segment(1, 64)], "x"), make(1, [Segment(1, 64)], "y"), make(2, [Segment(1, 64)], "x")]
    assert reuse_hits(workload(plain), 16).tolist() == [0, 0, 48]
    by = reuse_ceiling_by(workload(plain), lambda r: r.cache_salt, 16)
    assert by == {"x": pytest.approx(48 / 128), "y": 0.0}
    # Turn 2 contains turn 1's prompt and answer: decode blocks count only if the answer is known.
    turn1 = make(0, [Segment(1, 20)], out=[Segment(9, 20)])
    turn2 = make(1, [Segment(1, 20), Segment(9, 20), Segment(3, 30)])
    w = workload([turn1, turn2])
    assert reuse_hits(w, 8).tolist() == [0, 32]  # 39 tokens of KV after turn 1: 4 full blocks
    assert reuse_hits(w, 8, count_outputs=False).tolist() == [0, 16]
