"""An InferencePool's pods → instances (pure), and the list-watch cache against a reference model."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.membership import DiscoveryConfig
from kvrouter.membership.inferencepool import InferencePool, PoolRefused, PoolTarget, pool_target
from kvrouter.membership.kubetypes import ObjectCache
from kvrouter.membership.pods import Pod, pool_instances, ready
from tests.support.fake_apiserver import make_pod, make_pool

CFG = DiscoveryConfig(pool="vllm")
SEL = {"app": "vllm"}


def pod(name: str, ip: str | None = "10.0.0.1", **kw: Any) -> Pod:
    return msgspec.convert(make_pod(name, ip, labels=kw.pop("labels", SEL), **kw), Pod)


def pool(sel: dict[str, str], ports: list[int]) -> InferencePool:
    return msgspec.convert(make_pool("vllm", sel, ports), InferencePool)


def test_a_pool_reads_as_its_selector_and_ports() -> None:
    t = pool_target(pool({"b": "2", "a": "1"}, [8000]))
    assert t == PoolTarget({"b": "2", "a": "1"}, [8000]) and t.label_selector() == "a=1,b=2"
    assert t.matches({"a": "1", "b": "2", "c": "3"}) and not t.matches({"a": "1"}) and not t.matches(None)
    for sel, ports, reason in (({}, [8000], "selector"), (SEL, [], "ports"), (SEL, [8000, 8000], "ports"),
                               (SEL, [0], "ports"), (SEL, [70000], "ports")):  # fmt: skip
        with pytest.raises(PoolRefused) as e:
            pool_target(pool(sel, ports))
        assert e.value.reason == reason


def test_ready_pods_with_their_named_ports() -> None:
    t = pool_target(pool(SEL, [8000]))
    pods = [
        pod("p1", "10.0.0.1"),
        pod("p0", "10.0.0.2"),
        pod("p2", "10.0.0.3", ready=False),
        pod("p3", "10.0.0.4", deleting=True),  # ready but terminating: out
        pod("p4", None),  # ready without an address: counted
        pod("p5", "10.0.0.6", labels={"app": "other"}),  # not the pool's (a stale cache entry)
    ]
    got, skipped = pool_instances(pods, t, CFG)
    assert [(i.name, i.url, i.events, i.replay, i.dp_size) for i in got] == [
        ("p0", "http://10.0.0.2:8000", "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558", 1),
        ("p1", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", 1),
    ]
    assert skipped == {"no_address": 1}
    assert not ready(pods[2]) and not ready(pods[3]) and ready(pods[0])


def test_events_by_number_by_name_or_asked_of_the_instance() -> None:
    t = pool_target(pool(SEL, [8000]))
    p = [pod("p0", ports={"http": 8000})]  # no kv-events port declared
    got, skipped = pool_instances(p, t, CFG)
    assert got[0].events is None and got[0].replay is None and skipped == {"no_events_port": 1}
    cfg = DiscoveryConfig(pool="vllm", events_port=6000, replay_port=None, dp_size=2, topic="kv", weight=3)
    got, skipped = pool_instances(p, t, cfg)
    assert (got[0].events, got[0].replay, got[0].dp_size, got[0].topic, got[0].weight) == (
        "tcp://10.0.0.1:6000", None, 2, "kv", 3.0)  # fmt: skip
    none = DiscoveryConfig(pool="vllm", events_port=None, replay_port=None)
    got, skipped = pool_instances(p, t, none)  # its /kv_event_sources will be asked
    assert got[0].events is None and not skipped


def test_dp_size_from_the_pod_label() -> None:
    t = pool_target(pool(SEL, [8000]))
    got, _ = pool_instances([pod("p0", labels={**SEL, "kvrouter.io/dp-size": "4"})], t, CFG)
    assert got[0].dp_size == 4
    got, skipped = pool_instances([pod("p0", labels={**SEL, "kvrouter.io/dp-size": "x"})], t, CFG)
    assert got[0].dp_size == 1 and skipped == {"bad_dp_size": 1}


def test_several_target_ports_are_several_endpoints_and_active_ports_narrow_them() -> None:
    t = pool_target(pool(SEL, [8000, 8001, 8002]))
    got, _ = pool_instances([pod("p0", "fd00::5")], t, CFG)
    assert [(i.name, i.url, i.events) for i in got] == [
        ("p0-rank-0", "http://[fd00::5]:8000", "tcp://[fd00::5]:5557"),
        ("p0-rank-1", "http://[fd00::5]:8001", "tcp://[fd00::5]:5558"),  # vLLM's rank offset
        ("p0-rank-2", "http://[fd00::5]:8002", "tcp://[fd00::5]:5559"),
    ]
    narrowed = pod("p0", annotations={"inference.networking.k8s.io/active-ports": "8002, 9999,x,8000"})
    got, _ = pool_instances([narrowed], t, CFG)
    assert [i.name for i in got] == ["p0-rank-0", "p0-rank-2"]
    none = pod("p0", annotations={"inference.networking.k8s.io/active-ports": ""})
    assert pool_instances([none], t, CFG) == ([], {"no_active_port": 1})


def test_a_bookmarks_zero_valued_pod_decodes() -> None:
    bm = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "9", "creationTimestamp": None},
          "spec": {"containers": None}, "status": {}}  # fmt: skip
    p = msgspec.convert(bm, Pod)
    assert p.metadata.resource_version == "9" and p.metadata.resourceVersion == "9" and not ready(p)


# ------------------------------------------------------------------------------------ the cache
_names = st.sampled_from(["a", "b", "c", "d"])
_events = st.lists(
    st.tuples(st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]), _names, st.integers(0, 3)),
    max_size=40,
)


@given(initial=st.dictionaries(_names, st.integers(0, 3)), events=_events)
def test_the_cache_is_the_servers_state_after_any_events(initial: dict[str, int], events: list[Any]) -> None:
    """Against a dict: a list replaces it, ADDED/MODIFIED set, DELETED removes, BOOKMARK changes nothing;
    the version is always the last one the server sent; ``apply`` says whether the objects changed."""

    def obj(name: str, gen: int, rv: int) -> Pod:
        return msgspec.convert({"metadata": {"name": name, "resourceVersion": str(rv),
                                             "labels": {"gen": str(gen)}}}, Pod)  # fmt: skip

    cache: ObjectCache[Pod] = ObjectCache()
    cache.replace([obj(n, g, 1) for n, g in initial.items()], "1")
    model = dict(initial)
    for rv, (kind, name, gen) in enumerate(events, start=2):
        o = obj("" if kind == "BOOKMARK" else name, gen, rv)
        before = dict(model)
        if kind in ("ADDED", "MODIFIED"):
            model[name] = gen
        elif kind == "DELETED":
            model.pop(name, None)
        changed = cache.apply(kind, o)
        assert changed == (kind in ("ADDED", "MODIFIED") or (kind == "DELETED" and name in before))
        assert cache.resource_version == str(rv)
        assert {n: int((p.metadata.labels or {})["gen"]) for n, p in cache.objects.items()} == model
