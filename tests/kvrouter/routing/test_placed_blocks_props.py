"""``PlacedBlocks`` against a list of every placement: the sum per target over the window, whatever the
order of adds and reads.  The reader's time never goes back, as ``time.monotonic`` does not; a placement
may come in a little older than the last one (another worker's, through the host's rings)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.routing.placed_blocks import PlacedBlocks
from kvrouter.types import TargetKey

TARGETS = [TargetKey(f"t{i}") for i in range(3)]

steps_st = st.lists(
    st.tuples(
        st.booleans(),  # add (True) or read
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
    steps: list[tuple[bool, str, int, float, float]], w: float
) -> None:
    pb = PlacedBlocks(w)
    model: list[tuple[float, str, int]] = []
    now = 0.0
    for add, target, blocks, dt, age in steps:
        now += dt
        if add:
            pb.add(TargetKey(target), blocks, now - age)
            if blocks > 0:
                model.append((now - age, target, blocks))
        else:
            want = sum(b for t, k, b in model if k == target and t > now - w)
            assert pb.blocks(TargetKey(target), now) == want
    for target in TARGETS:
        assert pb.blocks(target, now) == sum(b for t, k, b in model if k == target and t > now - w)


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PlacedBlocks(0)
