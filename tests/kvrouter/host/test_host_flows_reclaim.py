"""The host's flow accounts (``serve --workers``) with more flows than the directory's slots: the least
recently charged flows without waiters are forgotten, every worker's view follows, and no charge is lost
or lands on another flow's row, within one process (against a reference of what each flow was charged
since it was last forgotten) and between processes racing on a small table."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import random
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.flows import Flow
from kvrouter.host import HostFlows, HostLayout, HostMemory
from kvrouter.host.flows import OVERFLOW


def local_memory(slots: int, workers: int = 2) -> HostMemory:
    layout = HostLayout(workers=workers, targets=1, instances=1, ring_words=8, metric_bytes=64, flows=slots)
    return HostMemory(layout, bytearray(layout.size()), threading.Lock())


def held(h: HostFlows) -> set[Flow]:
    """The flows with a slot of their own."""
    return {f for _, s in h.mem.flows.items() if (f := h.flow_at(s)) is not None}


def test_many_tenants_through_a_small_table_forget_the_oldest_and_keep_the_waiting() -> None:
    mem = local_memory(16)
    w0, w1 = HostFlows(mem, 0), HostFlows(mem, 1)
    patient = Flow("patient", 0)
    w1.charge(patient, 7.0)
    w1.set_waiting(patient, 1)  # waits in worker 1 throughout: never forgotten
    for i in range(200):
        w0.charge(Flow(f"user-{i}", 0), 10.0)
        w1.charge(Flow("steady", 0), 1.0)
    assert patient in held(w0) and w0.counter(patient) == w1.counter(patient) == 7.0
    assert w1.counter(Flow("steady", 0)) == w0.counter(Flow("steady", 0)) == 200.0
    assert w1.counter(Flow("user-199", 0)) == 10.0  # worker 1 sees worker 0's newest flow
    assert Flow("user-0", 0) not in held(w1) and w1.counter(Flow("user-0", 0)) == 0.0  # back as new
    assert w0.forgotten == w1.forgotten > 150
    assert float(mem.view("flow_accounts")[mem.flows.slot(OVERFLOW), 2]) == 0.0  # nobody overflowed
    assert w0.served()[Flow("user-199", 0)] == 10.0 and Flow("user-0", 0) not in w0.served()


def test_only_when_every_flow_waits_does_a_new_one_overflow() -> None:
    mem = local_memory(8)
    w = HostFlows(mem, 0)
    n = 0
    while True:  # fill every free slot with a waiting flow
        f = Flow(f"w{n}", 0)
        if w.flow_slot(f) == mem.flows.slot(OVERFLOW):
            break
        w.set_waiting(f, 1)
        n += 1
    assert n >= 3 and w.forgotten == 0
    w.set_waiting(Flow("w0", 0), 0)  # one stops waiting: a newcomer takes its slot
    assert w.flow_slot(Flow("late", 0)) != mem.flows.slot(OVERFLOW)
    assert w.forgotten == 1 and Flow("w0", 0) not in held(w)


ops = st.lists(
    st.tuples(
        st.sampled_from(["charge", "wait", "lift"]),
        st.integers(0, 1),
        st.integers(0, 11),
        st.integers(0, 2),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_what_each_flow_holds_is_what_it_was_charged_since_it_was_last_forgotten(steps: list[Any]) -> None:
    mem = local_memory(10)
    workers = [HostFlows(mem, 0), HostFlows(mem, 1)]
    charged: dict[Flow, float] = {}
    lifted: dict[Flow, float] = {}
    waiting: dict[tuple[int, Flow], int] = {}
    overflow = mem.flows.slot(OVERFLOW)
    for op, me, tenant, x in steps:
        w, f = workers[me], Flow(f"t{tenant}", 0)
        before = held(w)
        if op == "charge":
            w.charge(f, float(x + 1))
        elif op == "wait":
            w.set_waiting(f, x)
            waiting[(me, f)] = x
        else:
            w.set_counter(f, 1000.0 + x)
        for g in before - held(w):  # forgotten by this step: back as new
            assert not any(n for (_, h), n in waiting.items() if h == g)  # never a waiting flow
            charged.pop(g, None)
            lifted.pop(g, None)
        if w.flow_slot(f) == overflow:
            assert all(any(n for (_, h), n in waiting.items() if h == g) for g in held(w))
            continue
        if op == "charge":
            charged[f] = charged.get(f, 0.0) + x + 1
        elif op == "lift":
            lifted[f], charged[f] = 1000.0 + x, 0.0
        for g in held(w):
            want = lifted.get(g, 0.0) + charged.get(g, 0.0)
            assert workers[0].counter(g) == workers[1].counter(g) == want, g


def race(mem: HostMemory, me: int, rounds: int, start: Any, out: Any) -> None:
    """Worker ``me``: a new tenant each round (the table fills and frees), one of its recent tenants
    charged again (its slot may be freed meanwhile), each charge ``AMOUNT[me]``; and the shared flow
    "hot" charged 1 each round."""
    w = HostFlows(mem, me)
    rng = random.Random(me)
    start.wait()
    for i in range(rounds):
        w.charge(Flow(f"u{me}-{i}", 0), AMOUNT[me])
        w.charge(Flow(f"u{me}-{max(0, i - rng.randrange(40))}", 0), AMOUNT[me])
        w.charge(Flow("hot", 0), 1.0)
    out.put((me, w.forgotten))


AMOUNT = (1.0, 1000.0)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the race needs two cores")
def test_workers_racing_on_a_small_table_lose_no_charge_and_misplace_none() -> None:
    layout = HostLayout(workers=2, targets=1, instances=1, ring_words=8, metric_bytes=64, flows=24)
    buf = mmap.mmap(-1, layout.size(), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    ctx = multiprocessing.get_context("fork")
    mem = HostMemory(layout, memoryview(buf), ctx.Lock())
    rounds = 3000
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=race, args=(mem, k, rounds, start, out)) for k in range(2)]
    for p in procs:
        p.start()
    start.set()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(10)
    w = HostFlows(mem, 0)
    assert w.counter(Flow("hot", 0)) == 2 * rounds  # charged by both, never forgotten, never lost
    # Each worker reads the count when its own rounds end; the one that reads last sees every
    # reclaim (the other's rounds had ended), whichever of them reaches the queue first.
    assert w.forgotten > 1000 and max(n for _, n in got) == w.forgotten
    acc = mem.view("flow_accounts")
    assert float(acc[mem.flows.slot(OVERFLOW), 2]) == 0.0
    # A charge written to a row freed and given to another flow meanwhile would show as the other
    # worker's amount on a flow only one worker charges.
    for name, s in mem.flows.items():
        served = float(acc[s, 2])
        if name.startswith("f:0:u0-"):
            assert 1.0 <= served <= 41.0, (name, served)
        elif name.startswith("f:0:u1-"):
            assert served >= 1000.0 and served % 1000.0 == 0.0, (name, served)


def test_a_slot_freed_between_the_lookup_and_the_write_is_looked_up_again() -> None:
    """Worker 0 looks up "old"'s slot; before it writes, worker 1 fills the table, which frees that slot
    and gives it to another flow.  Worker 0's charge goes to "old" anew, not to the slot's new owner."""
    mem = local_memory(8)
    w0, w1 = HostFlows(mem, 0), HostFlows(mem, 1)
    old = Flow("old", 0)
    w0.charge(old, 1.0)
    lookup = w0.flow_slot
    raced = []

    def racing_lookup(flow: Flow) -> int:
        s = lookup(flow)
        if flow == old and not raced:
            for i in range(20):  # meanwhile, in worker 1
                w1.charge(Flow(f"new-{i}", 0), 1.0)
            raced.append(s)
        return s

    w0.flow_slot = racing_lookup  # type: ignore[method-assign]
    w0.charge(old, 500.0)
    freed = raced[0]
    assert w1.flow_at(freed) != old  # the slot it first found is another flow's now
    for f in held(w1) - {old}:
        assert w1.counter(f) == 1.0, f  # nobody got worker 0's 500
    assert w1.counter(old) == 500.0  # back as a new flow, with the charge


def test_serve_sizes_the_table_for_every_configured_tenants_buckets_beside_the_flows() -> None:
    """The names that keep their slots (a configured tenant's rate buckets and counts, a priority's
    virtual time) never run into the overflow row, however many one-off flows come and go."""
    from indexer.config import parse_fleet
    from kvrouter.config import RouterFleetConfig
    from kvrouter.flows import RateLimiter
    from kvrouter.host.supervisor import shared_host

    tenants = {f"t{i}": {"requests_per_minute": 60, "priority": i % 3} for i in range(1500)}
    inst = [
        {"name": f"w{i}", "url": f"http://127.0.0.1:{9 + i}", "events": "tcp://127.0.0.1:9"} for i in range(3)
    ]
    cfg = parse_fleet({"instances": inst, "flows": {"tenants": tenants}}, RouterFleetConfig)
    mem = shared_host(cfg, 2)
    flows = HostFlows(mem, 1)
    rate = RateLimiter(cfg.flows.tenant, flows)
    for i in range(1500):
        assert rate.take(f"t{i}", 10, 0.0) == 0.0
        flows.charge(Flow(f"one-off-{i}", 0), 1.0)
        flows.charge(Flow(f"t{i}", i % 3), 1.0)
    overflow = mem.flows.slot(OVERFLOW)
    names = dict(mem.flows.items())
    assert all(names[f"r:t{i}"] != overflow and names[f"q:t{i}"] != overflow for i in range(1500))
    assert flows.counted() == {f"t{i}": (1.0, 10.0) for i in range(1500)}
    assert float(mem.view("flow_accounts")[overflow, 2]) == 0.0  # no flow shared the overflow account
    for i in range(1500):  # each bucket took one request: a second minute's worth is still there
        assert rate.take(f"t{i}", 10, 0.0) == 0.0
    assert flows.forgotten > 0  # the flows' accounts were reclaimed meanwhile
