"""An instance's publishers from vLLM's ``GET /kv_event_sources`` answer."""

from __future__ import annotations

import json

import pytest

from indexer.config import InstanceConfig
from kvrouter.membership.errors import EventSourcesError
from kvrouter.membership.event_sources import with_event_sources


def rank(port: int, replay: int | None, **kw: object) -> dict[str, object]:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": None if replay is None else f"tcp://*:{replay}",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "",
        **kw,
    }


INST = InstanceConfig(name="v0", url="http://10.1.2.3:8000")


def test_any_host_becomes_the_instances_host_and_ranks_become_dp_size() -> None:
    got = with_event_sources(INST, json.dumps({"0": rank(5557, 6557), "1": rank(5558, 6558)}).encode())
    assert (got.events, got.replay, got.dp_size, got.topic) == (
        "tcp://10.1.2.3:5557",
        "tcp://10.1.2.3:6557",
        2,
        "",
    )
    assert got.events_endpoint(1) == "tcp://10.1.2.3:5558" and got.replay_endpoint(1) == "tcp://10.1.2.3:6558"


def test_a_named_host_and_a_topic_are_kept() -> None:
    ans = {"0": rank(5557, None, endpoint="tcp://pub.example:5557", topic="kv@v0@m")}
    got = with_event_sources(INST, json.dumps(ans).encode())
    assert (got.events, got.replay, got.topic) == ("tcp://pub.example:5557", None, "kv@v0@m")


def test_an_ipv6_host_is_bracketed() -> None:
    got = with_event_sources(
        InstanceConfig(name="v", url="http://[fd00::1]:8000"), json.dumps({"0": rank(5557, None)}).encode()
    )
    assert got.events == "tcp://[fd00::1]:5557"


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ({}, "disabled"),  # a render-only server
        ({"0": rank(5557, None, enable_kv_cache_events=False)}, "disabled"),
        ({"1": rank(5558, None)}, "ranks"),
        ({"0": rank(5557, None), "1": rank(7000, None)}, "ranks"),  # not the rank offset
        ({"zero": rank(5557, None)}, "invalid"),
        ([1, 2], "invalid"),
    ],
)
def test_unusable_answers_say_why(answer: object, reason: str) -> None:
    with pytest.raises(EventSourcesError) as e:
        with_event_sources(INST, json.dumps(answer).encode())
    assert e.value.reason == reason


def test_an_endpoint_naming_a_host_means_vllm_connects_out_so_the_router_binds() -> None:
    """vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``, 0.32 and 0.33): ``*``, ``::``, ipc and inproc
    bind; anything else connects.  The announced address is where the router must bind, as announced."""
    ans = {"0": {**rank(5557, 6557), "endpoint": "tcp://127.0.0.1:5557"}}
    got = with_event_sources(INST, json.dumps(ans).encode())
    assert (got.events, got.events_mode, got.replay) == (
        "tcp://127.0.0.1:5557",
        "bind",
        "tcp://10.1.2.3:6557",
    )
    wild = with_event_sources(INST, json.dumps({"0": rank(5557, None)}).encode())
    assert (wild.events, wild.events_mode) == ("tcp://10.1.2.3:5557", "connect")
    ipv6 = with_event_sources(
        INST, json.dumps({"0": {**rank(5557, None), "endpoint": "tcp://[::]:5557"}}).encode()
    )
    assert ipv6.events_mode == "connect"


def test_ranks_that_disagree_on_binding_are_refused() -> None:
    ans = {"0": rank(5557, None), "1": {**rank(5558, None), "endpoint": "tcp://10.1.2.3:5558"}}
    with pytest.raises(EventSourcesError) as e:
        with_event_sources(INST, json.dumps(ans).encode())
    assert e.value.reason == "ranks"


def test_the_fix_for_an_address_the_router_cannot_bind_is_spelled_out() -> None:
    from kvrouter.membership.event_sources import connect_fix

    text = connect_fix("v0", "tcp://10.9.9.9:5557")
    assert "connects its KV-event PUB out to tcp://10.9.9.9:5557" in text
    assert '"endpoint": "tcp://*:5557"' in text
