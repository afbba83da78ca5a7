"""The membership model (diff, merge, sections) and the reconciler's ordering, against a recording fake of
the ``Membership`` seam."""

from __future__ import annotations

import asyncio

import pytest

from indexer.config import InstanceConfig
from kvrouter.config import RouterFleetConfig, RoutingConfig
from kvrouter.membership import Reconciler, diff, routing_only
from kvrouter.membership.model import by_name, merge_sources, sections_changed
from tests.support.membership import FakeMembership
from tests.support.wait import until


def inst(name: str, port: int = 8000, **kw: object) -> InstanceConfig:
    return InstanceConfig(name, url=f"http://{name}:{port}", events=f"tcp://{name}:5557", **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- pure
def test_diff_names_added_removed_and_changed() -> None:
    old = by_name([inst("a"), inst("b"), inst("c")])
    new = by_name([inst("b"), inst("c", port=9000), inst("d")])
    d = diff(old, new)
    assert [i.name for i in d.added] == ["d"]
    assert [i.name for i in d.removed] == ["a"]
    assert d.changed == [(inst("c"), inst("c", port=9000))]
    assert d.summary() == {"added": ["d"], "removed": ["a"], "changed": ["c"]}
    assert not diff(old, dict(old))


def test_routing_only_fields() -> None:
    assert routing_only(inst("a"), inst("a", weight=2.0))
    assert routing_only(inst("a"), inst("a", models=["m"]))
    assert not routing_only(inst("a"), inst("a", port=1))
    assert not routing_only(inst("a"), inst("a", dp_size=2))
    assert not routing_only(inst("a"), inst("a", topic="x"))


def test_merge_sources_first_source_wins() -> None:
    merged, conflicts = merge_sources(
        {"fleet": by_name([inst("a"), inst("b")]), "k8s": by_name([inst("b", port=1), inst("c")])}
    )
    assert sorted(merged) == ["a", "b", "c"] and merged["b"] == inst("b")
    assert conflicts == ["b"]


def test_sections_changed_ignores_instances() -> None:
    a = RouterFleetConfig(instances=[inst("a")])
    b = RouterFleetConfig(instances=[inst("b")], routing=RoutingConfig(policy="round-robin"))
    assert sections_changed(a, b) == ["routing"]
    assert sections_changed(a, RouterFleetConfig(instances=[])) == []


# ---------------------------------------------------------------------- reconciler
def rec(m: FakeMembership, initial: list[InstanceConfig], drain_timeout_s: float = 30.0) -> Reconciler:
    return Reconciler(m, initial=initial, poll_s=0.005, retry_s=0.01, drain_timeout_s=drain_timeout_s)


async def test_add_remove_and_changed_is_remove_then_add() -> None:
    m = FakeMembership()
    r = rec(m, [inst("a"), inst("b")])
    d = r.set_desired("fleet", [inst("b", port=9), inst("c")])
    assert d.summary() == {"added": ["c"], "removed": ["a"], "changed": ["b"]}
    await r.settle()
    assert r.applied == by_name([inst("b", port=9), inst("c")])
    for name in ("a", "b"):
        assert m.calls.index(("drain", name)) < m.calls.index(("remove", name))
    assert m.calls.index(("remove", "b")) < m.calls.index(("add", "b"))
    assert ("add", "c") in m.calls and ("add", "a") not in m.calls
    assert r.counters["added"] == 2 and r.counters["removed"] == 2


async def test_weight_change_is_applied_in_place() -> None:
    m = FakeMembership()
    r = rec(m, [inst("a")])
    r.set_desired("fleet", [inst("a", weight=3.0)])
    await r.settle()
    assert m.calls == [("update", "a")] and r.applied["a"].weight == 3.0


async def test_removal_waits_for_in_flight_then_times_out() -> None:
    m = FakeMembership()
    m.flights["a"] = 2
    r = rec(m, [inst("a"), inst("b")], drain_timeout_s=5.0)
    r.set_desired("fleet", [inst("b")])
    await until(lambda: m.calls == [("drain", "a")])
    assert "a" in r.draining and r.busy()
    m.flights["a"] = 0  # the last request finished
    await r.settle()
    assert m.calls == [("drain", "a"), ("remove", "a")] and r.counters["drain_timeouts"] == 0

    m2 = FakeMembership()
    m2.flights["a"] = 1  # never finishes
    r2 = rec(m2, [inst("a")], drain_timeout_s=0.05)
    r2.set_desired("fleet", [])
    await asyncio.wait_for(r2.settle(), 15.0)
    assert m2.calls == [("drain", "a"), ("remove", "a")] and r2.counters["drain_timeouts"] == 1


async def test_back_while_draining_is_undrained_not_removed() -> None:
    m = FakeMembership()
    m.flights["a"] = 1
    r = rec(m, [inst("a")], drain_timeout_s=5.0)
    r.set_desired("fleet", [])
    await asyncio.sleep(0.03)
    r.set_desired("fleet", [inst("a")])
    await asyncio.wait_for(r.settle(), 15.0)
    assert m.calls == [("drain", "a"), ("undrain", "a")] and r.applied == by_name([inst("a")])


async def test_changes_during_a_drain_converge_to_the_last_desired() -> None:
    m = FakeMembership()
    m.flights["a"] = 1
    r = rec(m, [inst("a")], drain_timeout_s=5.0)
    r.set_desired("fleet", [inst("a", port=1)])
    await asyncio.sleep(0.02)
    r.set_desired("fleet", [inst("a", port=2)])
    r.set_desired("fleet", [inst("a", port=3)])
    m.flights["a"] = 0
    await asyncio.wait_for(r.settle(), 15.0)
    assert m.calls == [("drain", "a"), ("remove", "a"), ("add", "a")]
    assert r.applied == by_name([inst("a", port=3)])


async def test_a_failing_step_is_counted_and_retried() -> None:
    m = FakeMembership()
    m.fail_add = 2
    r = rec(m, [])
    r.set_desired("fleet", [inst("a")])
    await asyncio.wait_for(r.settle(), 15.0)
    assert m.calls == [("add", "a")] and r.counters["errors_add_OSError"] == 2


async def test_two_sources_are_merged() -> None:
    m = FakeMembership()
    r = rec(m, [inst("a")])
    r.set_desired("k8s", [inst("p1"), inst("a", port=5)])  # "a" stays the fleet file's
    await r.settle()
    assert sorted(r.applied) == ["a", "p1"] and r.applied["a"] == inst("a")
    assert r.counters["source_conflicts"] == 1
    r.set_desired("fleet", [])
    await r.settle()
    assert r.applied["a"] == inst("a", port=5)  # now only k8s claims it: changed, remove + add
    assert m.calls[-2:] == [("remove", "a"), ("add", "a")]


async def test_stop_cancels_workers() -> None:
    m = FakeMembership()
    m.flights["a"] = 1
    r = rec(m, [inst("a")], drain_timeout_s=60.0)
    r.set_desired("fleet", [])
    await asyncio.sleep(0.01)
    await r.stop()
    assert not r.busy() and "a" in r.applied


@pytest.mark.parametrize("n", [1, 5])
async def test_many_names_in_parallel(n: int) -> None:
    m = FakeMembership()
    r = rec(m, [])
    r.set_desired("fleet", [inst(f"i{k}") for k in range(n)])
    await r.settle()
    assert sorted(r.applied) == sorted(f"i{k}" for k in range(n))
