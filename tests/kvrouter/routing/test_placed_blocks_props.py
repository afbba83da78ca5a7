"""``PlacedBlocks`` against a list of every placement: the sum per target over the window, whatever the
order of adds and reads.  The reader's time never goes back, as ``time.monotonic`` does not; a placement
may come in a little older than the last one (another worker's, through the host's rings).  A target's
cache emptied (its clear count moved) takes back what was placed there before, and placements dated
before it never count."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.routing.placed_blocks import PlacedBlocks
from kvrouter.types import TargetKey

TARGETS = [TargetKey(f"t{i}") for i in range(3)]

steps_st = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "read", "clear", "same"]),  # "same": the clear count unchanged
        st.sampled_from(TARGETS),
        st.integers(-2, 200),  # blocks (0 and below: nothing placed)
        st.floats(0.0, 20.0),  # time step
        st.sampled_from([0.0, 0.0, 0.001, 0.3, 4.0]),  # how much older than now the placement is
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(steps_st, st.sampled_from([0.5, 5.0, 30.0]))
def test_blocks_are_the_sum_placed_within_the_window(
    steps: list[tuple[str, str, int, float, float]], w: float
) -> None:
    pb = PlacedBlocks(w)
    model: list[tuple[float, str, int]] = []
    clears = {k: 0 for k in TARGETS}
    cleared_at = {k: -math.inf for k in TARGETS}
    now = 0.0

    def want(target: str) -> int:
        return sum(b for t, k, b in model if k == target and t > now - w)

    for op, target, blocks, dt, age in steps:
        now += dt
        key = TargetKey(target)
        if op == "add":
            pb.add(key, blocks, now - age)
            if blocks > 0 and now - age >= cleared_at[key]:
                model.append((now - age, target, blocks))
        elif op == "read":
            assert pb.blocks(key, now) == want(target)
        else:
            if op == "clear":
                clears[key] += 1
                cleared_at[key] = now
                model = [m for m in model if m[1] != target or m[0] >= now]
            pb.cleared(key, clears[key], now)
    for target in TARGETS:
        assert pb.blocks(target, now) == want(target)


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PlacedBlocks(0)
