"""``ReplicaFlows`` (one queue, flow accounts and rate limits over the replicas) against a reference model
of several replicas' charges, rate use and waiters, through the in-process store on a fixed clock.

The model keeps, per replica, what it charged and let through, and what the store last received from it
(a round trip whose reply is lost still reached the store).  After a replica's successful round trip its
view must be: each flow's external service = the other replicas' service as the store holds it; each
tenant's bucket = its allowance minus its own use minus the peers' use since its first round trip; the
peers' waiters = what each live peer last published.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvrouter.flows import Flow, FlowsConfig, ProcessBoard, RateLimiter, TenantFlow
from kvrouter.replicas import MemoryReplicaHub, SyncRequest
from kvrouter.replicas.flows import FULL_EVERY, ReplicaFlows, service_key

REPLICAS = 3
FLOWS = [Flow("a", 0), Flow("b", 0), Flow("a", 1)]
RPM, TPM = 1000.0, 100_000.0
CONFIG = FlowsConfig(tenants={"a": TenantFlow(requests_per_minute=RPM, tokens_per_minute=TPM)})
NOW = 100.0
"""Time does not pass: no bucket refills, so every level is exact."""


@dataclass
class Replica:
    bound: int = 100
    """The flows its accounts keep (``flows.max_flows``): beyond it the least recently charged is
    forgotten, its running total published as 0."""
    board: ProcessBoard = field(init=False)
    rate: RateLimiter = field(init=False)
    flows: ReplicaFlows = field(init=False)
    charged: dict[Flow, float] = field(default_factory=dict)
    """Its service per flow since it last forgot the flow, least recently charged first."""
    taken: list[float] = field(default_factory=lambda: [0.0, 0.0])
    stored: dict[Flow, float] = field(default_factory=dict)
    """Its service as the store last received it."""
    stored_use: list[float] = field(default_factory=lambda: [0.0, 0.0])
    first_seen: dict[int, list[float]] = field(default_factory=dict)
    """Each peer's use of tenant a when this replica first heard of it, and the latest it heard."""
    last_seen: dict[int, list[float]] = field(default_factory=dict)
    waiting: int = 0

    def __post_init__(self) -> None:
        self.board = ProcessBoard(self.bound)
        self.rate = RateLimiter(CONFIG.tenant, self.board.flows)
        self.flows = ReplicaFlows(self.board, self.rate)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("charge"),
            st.integers(0, REPLICAS - 1),
            st.sampled_from(FLOWS),
            st.floats(-50, 500, allow_nan=False),
        ),
        st.tuples(st.just("take"), st.integers(0, REPLICAS - 1), st.integers(0, 5000)),
        st.tuples(st.just("wait"), st.integers(0, REPLICAS - 1), st.integers(0, 4)),
        st.tuples(st.just("sync"), st.integers(0, REPLICAS - 1), st.booleans()),
        st.tuples(st.just("restart"), st.just(0)),
        st.tuples(st.just("stall"), st.integers(0, REPLICAS - 1), st.booleans()),
    ),
    max_size=60,
)


def round_trip(hub: MemoryReplicaHub, name: str, r: Replica, lost: bool) -> None:
    queue, counts = r.flows.request()
    since = r.flows.since  # only the totals changed since its last reply come back
    reply = hub.sync_now(SyncRequest(name, 10_000, b"", b"", "", 1000, 10, queue, counts, since))
    r.stored = dict(r.charged)
    r.stored_use = list(r.taken)
    if lost:  # the store has it; this replica never hears back (SharedState then resyncs)
        r.flows.resync()
        return
    r.flows.published()
    r.flows.apply(
        reply.peer_queues,
        reply.totals,
        reply.peer_use,
        NOW,
        totals_at=reply.totals_at,
        totals_full=reply.totals_full,
    )


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([100, 2, 1]))
@example(  # its first request (every total) stalls undelivered: the next carries them again
    [("charge", 1, FLOWS[0], 10.0), ("stall", 1, False), ("charge", 1, FLOWS[1], 5.0), ("sync", 1, False),
     ("sync", 0, False)],
    100,
)  # fmt: skip
@example(  # a round trip that changed nothing: the reply carries no totals, and the peers' service stays
    [("charge", 1, FLOWS[0], 10.0), ("sync", 1, False), ("sync", 0, False), ("sync", 0, False)],
    100,
)  # fmt: skip
@example(  # service and use published before the store restarted, nothing new since: published again
    [("charge", 1, FLOWS[0], 10.0), ("take", 1, 7), ("sync", 1, False), ("sync", 0, False),
     ("restart", 0), ("sync", 1, False), ("take", 1, 3), ("sync", 1, False), ("sync", 0, False)],
    100,
)  # fmt: skip
@example(  # a flow forgotten after its total was sent: 0 is published, and the peers drop its service
    [("charge", 1, FLOWS[0], 10.0), ("sync", 1, False), ("charge", 1, FLOWS[1], 5.0),
     ("charge", 1, FLOWS[2], 5.0), ("sync", 1, False), ("sync", 0, False)],
    2,
)  # fmt: skip
@example(  # forgotten while the round trip that sent it was lost: the resync publishes the 0
    [("charge", 1, FLOWS[0], 10.0), ("sync", 1, True), ("charge", 1, FLOWS[1], 5.0), ("sync", 1, False),
     ("sync", 0, False)],
    1,
)  # fmt: skip
def test_each_replica_counts_what_the_others_gave_and_took(steps: list[tuple], bound: int) -> None:
    """Also through a store that restarts empty (every replica's round trips failed meanwhile: each
    publishes everything again), and with accounts that keep fewer flows than are charged."""
    hub = MemoryReplicaHub(lambda: NOW)
    reps = [Replica(bound) for _ in range(REPLICAS)]
    published_waiting = [0] * REPLICAS
    for op, i, *args in steps:
        r = reps[i]
        if op == "restart":
            hub = MemoryReplicaHub(lambda: NOW)
            published_waiting = [0] * REPLICAS
            for p in reps:
                p.flows.resync()
                p.stored, p.stored_use = {}, [0.0, 0.0]
        elif op == "stall":  # its request sent (reaching the store or not), no answer, no resync
            (delivered,) = args
            queue, counts = r.flows.request()
            if delivered:
                hub.sync_now(SyncRequest(f"r{i}", 10_000, b"", b"", "", 1000, 10, queue, counts))
                r.stored, r.stored_use = dict(r.charged), list(r.taken)
                published_waiting[i] = r.waiting
        elif op == "charge":
            flow, amount = args
            r.board.flows.charge(flow, amount)
            r.charged[flow] = r.charged.pop(flow, 0.0) + amount
            if len(r.charged) > r.bound:
                del r.charged[next(iter(r.charged))]
        elif op == "take":
            (tokens,) = args
            if r.rate.take("a", tokens, NOW) == 0.0:
                r.taken[0] += 1
                r.taken[1] += tokens
        elif op == "wait":
            (n,) = args
            r.waiting = n
            r.board.set_waiting(n, (FLOWS[n % len(FLOWS)], 500_000_000, f"m{n % 2}") if n else None)
        else:
            (lost,) = args
            round_trip(hub, f"r{i}", r, lost)
            published_waiting[i] = r.waiting
            if lost:
                continue
            others = [p for j, p in enumerate(reps) if j != i]
            for f in FLOWS:
                want = sum(p.stored.get(f, 0.0) for p in others)
                assert r.board.flows.external.get(f, 0.0) == close_to(max(0.0, want))
                own = r.board.flows.counters.get(f, 0.0)
                assert r.board.flows.counter(f) == close_to(own + max(0.0, want))
            for j, p in enumerate(reps):
                if j != i and f"r{j}" in hub.members:  # a live peer (since the store last restarted)
                    r.first_seen.setdefault(j, list(p.stored_use))
                    last = r.last_seen.get(j, [0.0, 0.0])
                    r.last_seen[j] = [max(x, y) for x, y in zip(last, p.stored_use, strict=True)]
            debited = [sum(r.last_seen[j][k] - r.first_seen[j][k] for j in r.first_seen) for k in (0, 1)]
            levels = r.board.flows._b.get("a")
            if levels is not None:
                assert levels[0] == close_to(RPM - r.taken[0] - debited[0])
                assert levels[2] == close_to(TPM - r.taken[1] - debited[1])
            assert r.board.peers_waiting() == sum(w for j, w in enumerate(published_waiting) if j != i)
            want_tops = {
                (f"m{w % 2}", FLOWS[w % len(FLOWS)].priority)
                for j, w in enumerate(published_waiting)
                if j != i and w
            }
            assert set(r.board.peer_tops()) == want_tops


def close_to(x: float) -> object:
    """Sums of the same floats in another order: equal to rounding."""
    return pytest.approx(x, rel=1e-9, abs=1e-6)


def test_a_peers_best_waiter_defers_only_lower_priorities_of_its_group() -> None:
    """What replica b's gate is told of a's best waiter: its group and priority, and a's count."""
    hub = MemoryReplicaHub(lambda: NOW)
    a, b = Replica(), Replica()
    a.board.set_waiting(3, (Flow("a", 1), 123, "('m', None)"))
    round_trip(hub, "a", a, False)
    round_trip(hub, "b", b, False)
    assert b.board.peer_tops() == [("('m', None)", 1)] and b.board.peers_waiting() == 3
    assert msgspec.msgpack.decode(a.flows.request()[0]) == [3, [["('m', None)", 1]]]
    a.board.set_waiting(0, None)
    round_trip(hub, "a", a, False)
    round_trip(hub, "b", b, False)
    assert b.board.peer_tops() == [] and b.board.peers_waiting() == 0


def test_every_full_every_replies_a_replica_asks_for_every_total_again() -> None:
    """A total changed without a version (an older replica during a rolling upgrade: its script does not
    keep them) reaches a replica reading changes only at its next full read, FULL_EVERY replies on."""
    hub = MemoryReplicaHub(lambda: NOW)
    r, old = Replica(), Replica()
    old.board.flows.charge(FLOWS[0], 5.0)
    round_trip(hub, "old", old, False)
    sinces = []
    for k in range(FULL_EVERY + 1):
        if k == 3:  # as an older release publishes: the sum moves, no version does
            hub.totals[service_key(FLOWS[0])] += 7.0
        sinces.append(r.flows.since)
        round_trip(hub, "new", r, False)
        want = 5.0 if k < FULL_EVERY else 12.0
        assert r.board.flows.external.get(FLOWS[0]) == want, k
    assert sinces[0] == "" and all(sinces[1:FULL_EVERY]) and sinces[FULL_EVERY] == ""
