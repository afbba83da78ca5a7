"""The queue's expected wait (``WaitEstimate``) against a plain recomputation, and the gate refusing at once
what would only time out."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.flows import Flow
from kvrouter.pipeline import CapacityGate, QueueFull
from kvrouter.pipeline.queue_wait import WaitEstimate


def reference(
    observations: list[tuple[float, int]], alpha: float, min_samples: int, places: int
) -> float | None:
    """The estimate recomputed from scratch: a mean over the first 1/alpha waits, then an exponential
    average, of seconds per place; nothing before ``min_samples`` waits."""
    xs = [w / p for w, p in observations if p >= 1 and w >= 0.0]
    if len(xs) < min_samples:
        return None
    est = 0.0
    for i, x in enumerate(xs, start=1):
        est = x if i == 1 else est + max(alpha, 1.0 / i) * (x - est)
    return est * places


@given(
    st.lists(st.tuples(st.floats(-1.0, 60.0), st.integers(-1, 500)), max_size=60),
    st.sampled_from([0.05, 0.1, 0.5, 1.0]),
    st.integers(1, 10),
    st.integers(1, 1000),
)
def test_the_estimate_is_the_average_seconds_per_place_times_the_places(
    observations: list[tuple[float, int]], alpha: float, min_samples: int, places: int
) -> None:
    est = WaitEstimate(alpha, min_samples)
    for waited, at in observations:
        est.observe(waited, at)
    want = reference(observations, alpha, min_samples, places)
    got = est.expected(places)
    if want is None:
        assert got is None
    else:
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert got >= 0.0


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        WaitEstimate(0.0)
    with pytest.raises(ValueError):
        WaitEstimate(0.1, 0)


class Fleet:
    """One slot freed every ``every_s``: a fleet that serves a steady rate, whatever comes."""

    def __init__(self, gate: CapacityGate, every_s: float) -> None:
        self.gate = gate
        self.every_s = every_s
        self.free = 0

    def attempt(self) -> int | None:
        if self.free <= 0:
            return None
        self.free -= 1
        return 1

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.free = min(self.free + 1, 1)  # a slot unused is not banked
            self.gate.release()


async def _overload(early: bool) -> tuple[list[float], list[float], int]:
    """Arrivals at twice the fleet's rate for 2 s, a queue timeout of 0.2 s.  Returns how long each early
    refusal and each late refusal (``queue_timeout``) took, and the number admitted."""
    gate = CapacityGate(1000, 0.2, early_refusal=early)
    fleet = Fleet(gate, 0.01)
    loop = asyncio.get_running_loop()
    early_s: list[float] = []
    late_s: list[float] = []
    admitted = 0

    async def one() -> None:
        nonlocal admitted
        t0 = loop.time()
        try:
            await gate.acquire(fleet.attempt, Flow("t", 0))
            admitted += 1
        except QueueFull as e:
            (early_s if e.reason == "expected_timeout" else late_s).append(loop.time() - t0)
            assert e.reason in ("expected_timeout", "queue_timeout"), e.reason

    server = asyncio.create_task(fleet.run())
    tasks = []
    for _ in range(400):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    server.cancel()
    return early_s, late_s, admitted


async def test_what_would_only_time_out_is_refused_at_once() -> None:
    early_s, late_s, admitted = await _overload(early=True)
    assert admitted > 0
    # Refused before it ever waited: no await comes between the estimate and the refusal, so however
    # busy the machine, the refusal takes no time of the queue's.
    assert early_s and max(early_s) < 0.05, early_s[:5]
    # Once the estimate has learnt the fleet's rate, the queue settles where waits meet the timeout:
    # most refusals come at once, not one timeout later.
    assert len(late_s) < len(early_s), (len(late_s), len(early_s))
    # Without it, the same overload is refused only by timeouts, each after the whole timeout.
    early_off, late_off, _ = await _overload(early=False)
    assert not early_off and late_off and min(late_off) >= 0.2 - 1e-3
