"""This process's flow accounts keep at most ``flows.max_flows`` flows: a tenant header naming a new user
per request leaves the memory bounded, a waiting flow is never forgotten, and a forgotten flow comes back
as a new one (``kvrouter.flows.LocalAccounts``)."""

from __future__ import annotations

import pytest

from indexer.errors import ConfigError
from kvrouter.flows import Flow, FlowQueue, FlowsConfig, LocalAccounts, Waiter
from tests.kvrouter.pipeline.test_predicted_latency import FLEET, build


def test_a_hundred_thousand_one_off_tenants_stay_within_the_bound() -> None:
    q: FlowQueue[int] = FlowQueue(8, "work", max_flows=1000)
    a = q.accounts
    assert isinstance(a, LocalAccounts)
    q.push(Waiter(0, Flow("patient", 0), 0))  # waits throughout: never forgotten
    for i in range(100_000):
        q.charge(Flow(f"user-{i}", 0), 10.0)
        if i % 1000 == 0:
            a.served_changed()  # as a replica's round trips read them
    assert len(a.counters) == len(a._recent) == 1000 and len(a.own) == 999  # "patient" was never charged
    assert a.forgotten == 100_000 + 1 - 1000
    assert Flow("patient", 0) in a.counters and Flow("user-99999", 0) in a.counters
    assert Flow("user-0", 0) not in a.counters
    # the forgotten since the last read are published as 0: their share leaves the replicas' sums
    changed = a.served_changed()
    assert changed is not None and changed[Flow("user-98500", 0)] == 0.0
    assert changed[Flow("user-99999", 0)] == 10.0


def test_a_flow_forgotten_below_its_priorities_base_comes_back_as_it_would_have() -> None:
    """Exact where the forgotten counter is at most the base a returning flow is lifted to: a light tenant
    served less than a heavy one waits behind nobody it would not have."""
    runs = []
    for bound in (3, 100):
        q: FlowQueue[str] = FlowQueue(8, "work", max_flows=bound)
        q.charge(Flow("light", 0), 10.0)
        q.charge(Flow("x", 0), 50.0)
        q.charge(Flow("y", 0), 50.0)
        q.charge(Flow("heavy", 0), 500.0)  # with bound 3: "light" is forgotten
        q.charge(Flow("heavy", 0), 500.0)  # the priority's virtual time: 500
        assert (Flow("light", 0) in q.accounts.counters) == (bound == 100)  # type: ignore[attr-defined]
        q.push(Waiter("l", Flow("light", 0), 1))
        q.push(Waiter("h", Flow("heavy", 0), 2))
        runs.append((q.counter(Flow("light", 0)), q.counter(Flow("heavy", 0)), q.best()))
    (light3, heavy3, best3), (light100, heavy100, best100) = runs
    assert light3 == light100 == 500.0  # lifted to the virtual time either way
    assert heavy3 == heavy100 == 1000.0
    assert best3 is not None and best100 is not None and best3.item == best100.item == "l"


def test_max_flows_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_flows"):
        FlowsConfig(max_flows=0).validate()
    with pytest.raises(ValueError, match="max_flows"):
        LocalAccounts(0)


def test_the_fleet_files_max_flows_bounds_the_gates_accounts() -> None:
    pipeline, _ = build(FLEET + "flows: {max_flows: 7}\n")
    accounts = pipeline.gate.queue.accounts
    assert isinstance(accounts, LocalAccounts) and accounts.max_flows == 7
    for i in range(20):
        pipeline.gate.queue.charge(Flow(f"u{i}", 0), 1.0)
    assert len(accounts.counters) == 7


def test_a_router_without_replicas_keeps_no_record_of_what_changed() -> None:
    """Only replicas read what changed; until one asks, nothing is kept for it (every flow is returned
    at the first ask)."""
    a = LocalAccounts(10)
    for i in range(50):
        a.charge(Flow(f"u{i}", 0), 1.0)
    assert a._changed is None
    assert a.served_changed() == {Flow(f"u{i}", 0): 1.0 for i in range(40, 50)}
    a.charge(Flow("u0", 0), 2.0)  # forgets u40
    assert a.served_changed() == {Flow("u0", 0): 2.0, Flow("u40", 0): 0.0}
