"""Saturation: a target is full by the fleet's own signals, and the last share of every limit is kept for
high-priority flows with nothing else waiting."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer import Indexer
from indexer.errors import ConfigError
from kvrouter.gateway.upstream import parse_engine_load
from kvrouter.host import HostLayout, HostLoads, HostMemory
from kvrouter.routing import LoadTracker, RouteInput, Router, RouterConfig
from kvrouter.routing.policies import Candidate
from kvrouter.routing.router import Target
from kvrouter.routing.saturation import Saturation
from kvrouter.types import InstanceId, RequestId, TargetKey


def cand(in_flight: int = 0, pending: int = 0, kv: float = 0.0) -> Candidate:
    return Candidate(
        InstanceId("v0"), 0, TargetKey("v0"), in_flight=in_flight, pending_prefill_tokens=pending, kv_usage=kv
    )


def test_each_limit_and_the_reserve() -> None:
    sat = Saturation(max_prefill_tokens=1000, max_kv_usage=0.9, reserve=0.5, reserved_priority=1)
    assert sat.full(cand(in_flight=7), 8, True) is None
    assert sat.full(cand(in_flight=8), 8, True) == "in_flight"
    assert sat.full(cand(in_flight=4), 8, False) == "in_flight"  # half the cap is kept
    assert sat.full(cand(pending=999), 0, True) is None
    assert sat.full(cand(pending=1000), 0, True) == "prefill_tokens"
    assert sat.full(cand(pending=500), 0, False) == "prefill_tokens"
    assert sat.full(cand(kv=0.89), 0, True) is None
    assert sat.full(cand(kv=0.9), 0, True) == "kv_usage"
    assert sat.full(cand(kv=0.45), 0, False) == "kv_usage"
    # nothing left to prefill: a target takes a request however long its prompt (none is unservable)
    assert Saturation(max_prefill_tokens=1).full(cand(pending=0), 0, False) is None
    assert sat.cap(1, False) == 1 and sat.cap(0, False) == 0  # a cap never closes a target entirely


def test_who_may_fill_the_reserve() -> None:
    sat = Saturation(reserve=0.25, reserved_priority=1)
    assert sat.reserved(1, 0) and sat.reserved(2, 1)  # high priority, nothing else of its flow waits
    assert not sat.reserved(1, 2)  # its flow has others waiting: it asks more than it gets
    assert not sat.reserved(0, 0)  # below the reserved priority
    for bad in (Saturation(reserve=1.0), Saturation(max_prefill_tokens=-1), Saturation(max_kv_usage=1.5)):
        with pytest.raises(ConfigError):
            bad.validate()


@given(
    st.integers(0, 64),
    st.integers(0, 20_000),
    st.floats(0.0, 1.0),
    st.integers(0, 64),
    st.integers(0, 16_000),
    st.sampled_from([0.0, 0.5, 0.8, 0.95]),
    st.sampled_from([0.0, 0.25, 0.5, 0.9]),
)
def test_full_against_a_plain_reading_of_the_limits(
    n: int, pending: int, kv: float, cap: int, max_pre: int, max_kv: float, reserve: float
) -> None:
    sat = Saturation(max_prefill_tokens=max_pre, max_kv_usage=max_kv, reserve=reserve)
    c = cand(n, pending, kv)
    for reserved in (True, False):
        share = 1.0 if reserved else 1.0 - reserve
        open_ = (
            (not cap or n < max(1, int(cap * share + 1e-9)))
            and (not max_pre or pending == 0 or pending < max_pre * share)
            and (not max_kv or kv < max_kv * share)
        )
        assert (sat.full(c, cap, reserved) is None) == open_
    # whoever may fill the reserve finds a target open wherever one that may not does
    if sat.full(c, cap, False) is None:
        assert sat.full(c, cap, True) is None


def test_the_router_keeps_the_reserve_and_claims_within_it() -> None:
    sat = Saturation(max_prefill_tokens=4000, reserve=0.5)
    r = Router(Indexer(16), RouterConfig(max_in_flight=4, saturation=sat, speculative=False, shadow=False))
    targets = [Target(InstanceId("v0"))]
    r.load.dispatch(RequestId("a"), TargetKey("v0"), 2500)  # past half the prefill limit
    low = RouteInput(RequestId("low"), 100, reserved=False)
    high = RouteInput(RequestId("high"), 100)
    assert r.route(low, targets).reason == "at_capacity"
    d = r.route(high, targets)
    assert d.chosen is not None
    r.first_token(RequestId("a"))  # its prompt computed: the prefill backlog is gone
    d = r.route(low, targets)
    assert d.chosen is not None
    assert r.claim(RequestId("low"), d.chosen, reserved=False)  # 2 in flight: the unreserved half of 4
    assert not r.claim(RequestId("low2"), d.chosen, reserved=False)
    assert r.claim(RequestId("high"), d.chosen, reserved=True)


def test_vllm_kv_cache_usage_is_read_and_shared_by_the_hosts_workers() -> None:
    # The exposition vLLM's /metrics gives (gauges labelled by model and engine, a 0-1 fraction); an
    # engine that also exports the name before 0.13 is not counted twice.
    text = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.9\n'
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.42\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    )
    running, waiting, kv = parse_engine_load(text)
    assert running == {"0": 3.0} and waiting == {} and kv == {"0": 0.42, "1": 0.9}
    layout = HostLayout(workers=2, targets=4, instances=2, ring_words=16)
    mem = HostMemory(layout, bytearray(layout.size()), threading.Lock())
    a, b = LoadTracker(HostLoads(mem, 0)), LoadTracker(HostLoads(mem, 1))
    a.observe_engine(TargetKey("v0"), 3, 0, 1.0, kv["0"])
    b.refresh()
    assert b.get(TargetKey("v0")).engine_kv_usage == pytest.approx(0.42)
    r = Router(
        Indexer(16),
        RouterConfig(saturation=Saturation(max_kv_usage=0.4), shadow=False),
        load=b,
    )
    assert r.route(RouteInput(RequestId("x"), 10), [Target(InstanceId("v0"))]).reason == "at_capacity"


def test_a_flows_waiters_in_another_worker_keep_it_out_of_the_reserve() -> None:
    from kvrouter.flows import Flow, FlowQueue
    from kvrouter.host import HostFlows

    layout = HostLayout(workers=2, targets=1, instances=1, ring_words=8, metric_bytes=64, flows=32)
    mem = HostMemory(layout, bytearray(layout.size()), threading.Lock())
    mine: FlowQueue[str] = FlowQueue(8, "work", accounts=HostFlows(mem, 0))
    other = HostFlows(mem, 1)
    noisy, calm = Flow("noisy", 1), Flow("calm", 1)
    sat = Saturation(reserve=0.5)
    assert mine.waiting(noisy) == 0 and sat.reserved(1, mine.waiting(noisy))
    other.set_waiting(noisy, 3)  # the other worker's backlog of the same flow
    assert mine.waiting(noisy) == 3 and not sat.reserved(1, mine.waiting(noisy))
    assert sat.reserved(1, mine.waiting(calm))
