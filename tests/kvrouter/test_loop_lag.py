"""LoopLag: the standing delay against a reference model (the least lag of the window's ticks, two ticks at
least), the stall total against a sum, and the timer on a real loop that is blocked once."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.loop_lag import LoopLag
from tests.support.wait import until

WINDOW = 0.1


Tick = tuple[float, float, float]  # (when, lag, runnable seconds so far)


def reference(ticks: list[Tick], window: float) -> tuple[float, float]:
    """(standing delay, demand): over the ticks of the last ``window`` before the newest (the last two if
    fewer), the least lag, and the runnable seconds over the seconds between the first and the newest."""
    now = ticks[-1][0]
    kept = [t for t in ticks if t[0] >= now - window]
    if len(kept) < 2:
        kept = ticks[-2:]
    span = now - kept[0][0]
    demand = min(1.0, max(0.0, (kept[-1][2] - kept[0][2]) / span)) if span > 0 else 0.0
    return min(t[1] for t in kept), demand


@given(
    st.lists(
        # (time since the tick before, lag, share of it runnable)
        st.tuples(st.floats(0.0, 0.2), st.floats(-0.01, 0.5), st.floats(0.0, 1.0)),
        min_size=1,
        max_size=60,
    )
)
def test_standing_delay_and_demand_against_the_window(steps: list[tuple[float, float, float]]) -> None:
    lag = LoopLag(window_s=WINDOW)
    ticks: list[Tick] = []
    now, runnable = 100.0, 5.0
    for dt, late, share in steps:
        now += dt
        runnable += dt * share
        lag.observe(late, now, runnable)
        ticks.append((now, max(0.0, late), runnable))
        assert (lag.standing_s, lag.demand) == pytest.approx(reference(ticks, WINDOW))
    assert lag.blocked_s == pytest.approx(sum(t[1] for t in ticks))
    assert lag.max_s == max(t[1] for t in ticks)


def test_one_long_stall_is_not_a_standing_delay_but_a_busy_loop_is() -> None:
    lag = LoopLag(window_s=WINDOW)
    now = 0.0
    for _ in range(20):  # on time
        now += 0.01
        lag.observe(0.0, now)
    now += 0.5
    lag.observe(0.5, now)  # a collection: one tick half a second late
    assert lag.standing_s == 0.0  # the tick before it was on time
    now += 0.01
    lag.observe(0.0, now)
    assert lag.standing_s == 0.0
    for _ in range(10):  # busy every turn: every tick 30-40 ms late
        now += 0.04
        lag.observe(0.03 + 0.001 * (now % 7), now)
    assert 0.03 <= lag.standing_s <= 0.04


def test_stalled_compares_the_delay_since_a_mark_with_the_timeout() -> None:
    lag = LoopLag()
    mark = lag.mark()
    lag.observe(0.2, 1.0)
    assert lag.blocked_since(mark) == 0.2
    assert not lag.stalled(mark, 0.5)  # 0.2 of 0.5 s: the peer had most of the time
    lag.observe(0.1, 1.1)
    assert lag.stalled(mark, 0.5)  # 0.3 of 0.5 s: the timeout is this process's


async def test_the_timer_sees_a_blocked_loop_and_then_a_free_one() -> None:
    lag = LoopLag(tick_s=0.01, window_s=0.05)
    lag.start()
    try:
        await until(lambda: len(lag._ticks) >= 2, what="first ticks")
        mark = lag.mark()
        time.sleep(0.3)  # the loop stands still (asleep: not runnable)
        assert lag.blocked_since(mark) >= 0.25  # overdue already counts, before the tick has run
        await until(lambda: lag.max_s >= 0.25, what="the late tick reported")
        assert lag.stalled(mark, 0.5)
        await until(lambda: lag.standing_s < 0.05, what="ticks on time again")
        # busy on the CPU, every turn, until a window reads it runnable most of the time (a loaded machine
        # can hold the thread off its CPU for a whole window: waiting for a CPU counts, being throttled not)
        t_end = time.monotonic() + 3.0
        busy = 0.0
        while time.monotonic() < t_end and busy <= 0.5:
            x = sum(range(20_000))
            await asyncio.sleep(0)
            busy = lag.demand
        assert x and busy > 0.5
        await asyncio.sleep(0.2)  # idle: the loop waits for a timer
        assert lag.demand < 0.5
    finally:
        lag.stop()
    assert not lag.running
    await asyncio.sleep(0.05)  # stopped: no tick runs any more
    n = lag.blocked_s
    await asyncio.sleep(0.05)
    assert lag.blocked_s == n
