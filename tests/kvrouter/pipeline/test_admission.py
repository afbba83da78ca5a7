"""Admission before the body: the count of held requests (this worker's or the host's) and the event
loop's standing delay, each refusal counted by its reason; one long stall refuses nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvrouter.api.errors import Overloaded
from kvrouter.config import LimitsConfig
from kvrouter.loop_lag import LoopLag
from kvrouter.pipeline import PipelineMetrics
from kvrouter.pipeline.admission import Admission, busy_share

BOUND = 0.025


def rejections(m: PipelineMetrics, reason: str) -> float:
    return m.registry.get_sample_value("kvrouter_rejections_total", {"reason": reason}) or 0.0


class Draws:
    """The admission's random draws, chosen by the test."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self) -> float:
        return self.value


@pytest.fixture
async def lag() -> AsyncIterator[LoopLag]:
    lag = LoopLag(tick_s=3600.0, window_s=0.1)  # running, but its timer never fires: the test feeds it
    lag.start()
    yield lag
    lag.stop()


def admission(lag: LoopLag | None, draw: float = 0.5, **limits: object) -> Admission:
    cfg = msgspec.structs.replace(LimitsConfig(max_loop_lag_s=BOUND), **limits)
    return Admission(cfg, PipelineMetrics(CollectorRegistry()), lag=lag, rng=Draws(draw))


def busy(lag: LoopLag, delay: float, ticks: int = 12, runnable: float = 1.0) -> None:
    """The loop late by ``delay`` on every turn for ``ticks`` ticks 10 ms apart, its thread runnable for
    ``runnable`` of the time."""
    now, ran = (lag._ticks[-1][0], lag._ticks[-1][2]) if lag._ticks else (0.0, 0.0)
    for _ in range(ticks):
        now += 0.01 + delay
        ran += (0.01 + delay) * runnable
        lag.observe(delay, now, ran)


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_the_refused_share_rises_from_the_bound_to_twice_it(a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert busy_share(lo, BOUND) <= busy_share(hi, BOUND)  # never less refused when further behind
    assert busy_share(min(lo, BOUND), BOUND) == 0.0
    assert busy_share(max(hi, 2 * BOUND), BOUND) == 1.0
    assert busy_share(hi, 0.0) == 0.0  # off


async def test_past_max_requests_the_next_is_refused_until_one_ends() -> None:
    adm = admission(None, max_requests=2)
    with adm.held(), adm.held():
        assert adm.active == 2
        with pytest.raises(Overloaded) as e, adm.held():
            pass
        assert e.value.reason == "gateway_full" and e.value.status == 429
    assert adm.active == 0
    with adm.held():  # room again
        pass
    assert rejections(adm.metrics, "gateway_full") == 1


async def test_the_hosts_count_bounds_every_worker() -> None:
    class Host:
        def __init__(self) -> None:
            self.n = 5  # other workers hold five

        def held_total(self) -> int:
            return self.n

        def add_held(self, d: int) -> None:
            self.n += d

    adm = admission(None, max_requests=6)
    adm.held_host = host = Host()
    with adm.held():
        assert host.n == 6
        assert adm.refusal() is not None
    assert host.n == 5


async def test_a_standing_delay_refuses_a_share_and_twice_the_bound_refuses_all(lag: LoopLag) -> None:
    busy(lag, 0.01)
    assert admission(lag, draw=0.0).refusal() is None  # under the bound: nothing refused
    busy(lag, BOUND * 1.5)  # half-way: half of the draws refuse
    assert lag.standing_s == pytest.approx(BOUND * 1.5)
    assert admission(lag, draw=0.49).refusal() is not None
    assert admission(lag, draw=0.51).refusal() is None
    busy(lag, BOUND * 2)
    adm = admission(lag, draw=0.999)
    err = adm.refusal()
    assert err is not None and err.reason == "gateway_busy"
    assert rejections(adm.metrics, "gateway_busy") == 1


async def test_one_long_stall_refuses_nothing(lag: LoopLag) -> None:
    busy(lag, 0.0)
    now, ran = lag._ticks[-1][0] + 0.5, lag._ticks[-1][2] + 0.5
    lag.observe(0.5, now, ran)  # a collection: half a second, once
    assert admission(lag, draw=0.0).refusal() is None


async def test_a_loop_late_with_time_to_spare_refuses_nothing(lag: LoopLag) -> None:
    """Late on every turn, but runnable a third of the time: other processes hold the CPUs."""
    busy(lag, BOUND * 3, runnable=0.3)
    assert lag.standing_s > 2 * BOUND and lag.demand < 0.5
    assert admission(lag, draw=0.0).refusal() is None
    busy(lag, BOUND * 3, runnable=0.95)  # the same delay, never idle: its own work
    assert admission(lag, draw=0.999).refusal() is not None


async def test_off_or_not_running_admits_on_the_count_alone(lag: LoopLag) -> None:
    busy(lag, 1.0)
    assert admission(lag, draw=0.0, max_loop_lag_s=0.0).refusal() is None
    lag.stop()
    assert admission(lag, draw=0.0).refusal() is None
    assert admission(None, draw=0.0).refusal() is None


async def test_a_refusal_is_a_new_error_each_time(lag: LoopLag) -> None:
    """An exception raised again keeps every earlier raise's frames: a shared one would grow."""
    adm = admission(None, max_requests=1)
    with adm.held():
        errors = []
        for _ in range(3):
            try:
                with adm.held():
                    pass
            except Overloaded as e:
                errors.append(e)
        assert len({id(e) for e in errors}) == 3
    await asyncio.sleep(0)
