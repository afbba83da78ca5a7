"""The flow queue against a plain reference model, under random push / serve / leave / charge sequences,
in every fairness mode.

The accounts are this process's or the host's shared memory (one contract for both).  The model keeps one
list of waiters and the counters; every choice (who is served, who is displaced, what a backlogged flow's
counter is lifted to) is made by scanning that list from scratch, as ``kvrouter.flows.scheduler`` states.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvrouter.flows import FAIRNESS, Flow, FlowQueue, LocalAccounts, Refused, Waiter
from kvrouter.host import HostFlows, HostLayout, HostMemory

TENANTS = ["a", "b", "c"]
WEIGHTS = {"a": 1.0, "b": 2.0, "c": 0.5}
flows = st.builds(Flow, st.sampled_from(TENANTS), st.integers(-1, 2))
ALL_FLOWS = [Flow(t, p) for t in TENANTS for p in range(-1, 3)]


@dataclass
class M:
    """A waiter in the model."""

    flow: Flow
    ticket: int


class Model:
    """``bound``: the flows whose counters are kept; beyond it, the least recently charged or lifted flow
    without waiters (not the one just touched) is forgotten."""

    def __init__(self, size: int, fairness: str, bound: int | None = None) -> None:
        self.size, self.fairness, self.bound = size, fairness, bound
        self.waiting: list[M] = []
        self.counters: dict[Flow, float] = {}
        self.vtime: dict[int, float] = {}
        self.touched: list[Flow] = []
        """Flows with a counter, least recently charged or lifted first."""
        self.forgotten = 0

    def touch(self, f: Flow) -> None:
        self.touched = [x for x in self.touched if x != f] + [f]
        if self.bound is None or len(self.touched) <= self.bound:
            return
        old = [x for x in self.touched if x != f and not self.backlogged(x)]
        if old:
            self.touched.remove(old[0])
            del self.counters[old[0]]
            self.forgotten += 1

    def c(self, f: Flow) -> float:
        return self.counters.get(f, 0.0)

    def backlogged(self, f: Flow) -> bool:
        return any(m.flow == f for m in self.waiting)

    def floor(self, f: Flow) -> float:
        peers = {m.flow for m in self.waiting if m.flow.priority == f.priority}
        base = min(self.c(p) for p in peers) if peers else self.vtime.get(f.priority, 0.0)
        return max(self.c(f), base)

    def push(self, f: Flow, ticket: int) -> tuple[str, int | None]:
        """("refused", reason) or ("ok", ticket of the displaced waiter or None)."""
        if self.fairness != "fifo" and f.priority < 0:
            return ("sheddable", None)
        lifted = self.c(f) if self.backlogged(f) else self.floor(f)
        victim = None
        if len(self.waiting) >= self.size:
            cands = [
                m
                for m in self.waiting
                if self.fairness != "fifo"
                and m.flow != f
                and (
                    m.flow.priority < f.priority
                    or (m.flow.priority == f.priority and self.c(m.flow) > lifted)
                )
            ]
            if not cands:
                return ("queue_full", None)

            def key(m: M) -> tuple[int, float, int, str]:
                n = sum(1 for x in self.waiting if x.flow == m.flow)
                return (m.flow.priority, -self.c(m.flow), -n, m.flow.tenant)

            worst = min(key(m) for m in cands)
            victim = max((m for m in cands if key(m) == worst), key=lambda m: m.ticket)
            self.waiting.remove(victim)
        if not self.backlogged(f):
            self.counters[f] = lifted
            self.waiting.append(M(f, ticket))
            self.touch(f)
        else:
            self.waiting.append(M(f, ticket))
        return ("ok", None if victim is None else victim.ticket)

    def best(self) -> M | None:
        if not self.waiting:
            return None
        if self.fairness == "fifo":
            return min(self.waiting, key=lambda m: m.ticket)
        return min(self.waiting, key=lambda m: (-m.flow.priority, self.c(m.flow), m.ticket))

    def charge(self, f: Flow, cost: float) -> None:
        self.vtime[f.priority] = max(self.vtime.get(f.priority, 0.0), self.c(f))
        self.counters[f] = self.c(f) + cost / WEIGHTS[f.tenant]
        self.touch(f)


class FlowQueueMachine(RuleBasedStateMachine):
    @initialize(
        size=st.integers(0, 6),
        fairness=st.sampled_from(FAIRNESS),
        host=st.booleans(),
        bound=st.one_of(st.none(), st.integers(1, 5)),
    )
    def start(self, size: int, fairness: str, host: bool, bound: int | None) -> None:
        """``host``: the accounts in the host's shared memory (``HostFlows``), as worker 0 of 1; else this
        process's, keeping at most ``bound`` flows (None: more than the test's 12)."""
        accounts = None
        if host:
            bound = None
            layout = HostLayout(workers=1, targets=1, instances=1, ring_words=8, metric_bytes=64, flows=32)
            accounts = HostFlows(HostMemory(layout, bytearray(layout.size()), threading.Lock()), 0)
        self.q: FlowQueue[int] = FlowQueue(
            size,
            fairness,  # type: ignore[arg-type]
            WEIGHTS.__getitem__,
            accounts,
            max_flows=bound or 100,
        )
        self.model = Model(size, fairness, bound)
        self.by_ticket: dict[int, Waiter[int]] = {}
        self.ticket = 0

    @rule(f=flows)
    def push(self, f: Flow) -> None:
        self.ticket += 1
        w = Waiter(self.ticket, f, self.ticket)
        want = self.model.push(f, self.ticket)
        try:
            displaced = self.q.push(w)
        except Refused as e:
            assert want == (e.reason, None)
            return
        assert want == ("ok", None if displaced is None else displaced.ticket)
        if displaced is not None:
            del self.by_ticket[displaced.ticket]
        self.by_ticket[self.ticket] = w

    @precondition(lambda self: self.by_ticket)
    @rule(cost=st.integers(0, 3000))
    def serve_best(self, cost: int) -> None:
        """The gate's pump: the best waiter gets capacity and is charged."""
        w = self.q.best()
        m = self.model.best()
        assert w is not None and m is not None and w.ticket == m.ticket
        assert self.q.remove(w)
        self.model.waiting = [x for x in self.model.waiting if x.ticket != m.ticket]
        del self.by_ticket[w.ticket]
        self.q.charge(w.flow, cost)
        self.model.charge(m.flow, cost)

    @precondition(lambda self: self.by_ticket)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """A waiter times out or its client goes away."""
        t = data.draw(st.sampled_from(sorted(self.by_ticket)))
        assert self.q.remove(self.by_ticket.pop(t))
        assert not self.q.remove(Waiter(t, Flow("a", 0), t))  # a stranger is not removed
        self.model.waiting = [x for x in self.model.waiting if x.ticket != t]

    @invariant()
    def bounded(self) -> None:
        """This process's accounts keep the flows the model keeps, and forget the same ones."""
        if not hasattr(self, "q") or self.model.bound is None:
            return
        a = self.q.accounts
        assert isinstance(a, LocalAccounts)
        assert set(a.counters) == set(self.model.counters)
        assert a.forgotten == self.model.forgotten

    @rule(f=flows, cost=st.integers(-200, 3000))
    def charge(self, f: Flow, cost: int) -> None:
        """A request admitted without waiting, or a correction once vLLM reports its output."""
        self.q.charge(f, cost)
        self.model.charge(f, cost)

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "q"):
            return
        assert len(self.q) == len(self.model.waiting) <= max(self.model.size, 0)
        b, m = self.q.best(), self.model.best()
        assert (b is None and m is None) or (b is not None and m is not None and b.ticket == m.ticket)
        for f in {x.flow for x in self.model.waiting} | set(self.model.counters) | set(ALL_FLOWS):
            assert abs(self.q.counter(f) - self.model.c(f)) < 1e-6  # a forgotten flow's is 0 in both
            assert self.q.depth(f) == sum(1 for x in self.model.waiting if x.flow == f)
        heads = self.q.heads()
        assert [h.ticket for h in heads] == sorted(
            (
                min(x.ticket for x in self.model.waiting if x.flow == f)
                for f in {x.flow for x in self.model.waiting}
            ),
            key=lambda t: self.q.rank(self.by_ticket[t]),
        )


FlowQueueMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, suppress_health_check=[HealthCheck.too_slow]
)
test_flow_queue_agrees_with_the_model = FlowQueueMachine.TestCase
