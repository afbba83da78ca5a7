"""Flows: who a request is for, its rate limits, and the gate that serves waiters by priority and share."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.flows import Flow, FlowsConfig, RateLimiter, TenantFlow, identify
from kvrouter.pipeline import CapacityGate, QueueFull

CFG = FlowsConfig(
    tenant_header="x-tenant",
    tenants={
        "gold": TenantFlow(priority=2),
        "free": TenantFlow(priority=0, allow_priority_header=True, max_priority=1),
        "keyed": TenantFlow(priority=3),
    },
)
KEYED = {"keyed"}


def test_a_key_wins_over_the_header_and_a_keyed_tenant_is_never_borrowed() -> None:
    assert identify(CFG, "gold", {"x-tenant": "free"}, KEYED) == (Flow("gold", 2), [])
    assert identify(CFG, None, {"x-tenant": "gold"}, KEYED) == (Flow("gold", 2), [])
    assert identify(CFG, None, {"x-tenant": "keyed"}, KEYED) == (Flow("default", 0), ["tenant:needs_key"])
    assert identify(CFG, None, {"x-tenant": "x" * 65}, KEYED) == (Flow("default", 0), ["tenant:malformed"])
    assert identify(CFG, None, {"x-tenant": "  "}, KEYED) == (Flow("default", 0), ["tenant:malformed"])
    assert identify(CFG, None, {}, KEYED) == (Flow("default", 0), [])
    assert identify(CFG, None, {"x-tenant": "newco"}, KEYED) == (Flow("newco", 0), [])


def test_a_client_raises_its_priority_only_where_allowed() -> None:
    assert identify(CFG, "gold", {"x-priority": "5"}, KEYED) == (Flow("gold", 2), ["priority:not_allowed"])
    assert identify(CFG, "gold", {"x-priority": "-1"}, KEYED) == (Flow("gold", -1), [])
    assert identify(CFG, "free", {"x-priority": "9"}, KEYED) == (Flow("free", 1), [])
    assert identify(CFG, "free", {"x-priority": "high"}, KEYED) == (Flow("free", 0), ["priority:malformed"])


def test_a_priority_between_the_configured_levels_is_taken_as_the_level_below() -> None:
    assert CFG.levels() == (-1, 0, 1, 2, 3)
    cfg = FlowsConfig(
        objectives={"premium": 10},
        tenants={"gold": TenantFlow(priority=5), "any": TenantFlow(allow_priority_header=True)},
    )
    assert cfg.levels() == (-1, 0, 5, 10)
    assert identify(cfg, "gold", {"x-priority": "3"}, KEYED) == (Flow("gold", 0), ["priority:snapped"])
    assert identify(cfg, "gold", {"x-priority": "0"}, KEYED) == (Flow("gold", 0), [])
    assert identify(cfg, "gold", {"x-priority": "-1"}, KEYED) == (Flow("gold", -1), [])
    low = identify(cfg, "gold", {"x-priority": "-12345"}, KEYED)
    assert low == (Flow("gold", -1), ["priority:snapped"])  # below every level: the lowest
    assert identify(cfg, "any", {"x-priority": "7"}, KEYED) == (Flow("any", 5), ["priority:snapped"])
    huge = identify(cfg, "any", {"x-priority": "9" * 400}, KEYED)
    assert huge == (Flow("any", 10), ["priority:snapped"])  # any, but only a level
    assert identify(cfg, "any", {"x-priority": "9" * 5000}, KEYED) == (Flow("any", 0), ["priority:malformed"])


LEVELS_CFG = FlowsConfig(
    tenant_header="x-tenant",
    objectives={"premium": 7, "batch": -3},
    tenants={
        "gold": TenantFlow(priority=4),
        "capped": TenantFlow(priority=1, allow_priority_header=True, max_priority=6),
        "any": TenantFlow(allow_priority_header=True),
    },
)


@given(
    tenant=st.sampled_from(["gold", "capped", "any", "newco", None]),
    asked=st.one_of(st.none(), st.integers(-(10**30), 10**30)),
    objective=st.sampled_from([None, "premium", "batch", "nope"]),
)
def test_every_priority_is_a_configured_level_and_never_above_what_the_tenant_may_ask(
    tenant: str | None, asked: int | None, objective: str | None
) -> None:
    """The priority is a configured level, never above what the tenant may reach; a header lowering it
    gets the highest level at or below the integer asked (the lowest level when none is); a header
    raising it where the tenant may not changes nothing."""
    headers = {"x-gateway-inference-objective": objective} if objective is not None else {}
    before, _ = identify(LEVELS_CFG, tenant, headers, ())
    if asked is not None:
        headers["x-priority"] = str(asked)
    flow, notes = identify(LEVELS_CFG, tenant, headers, ())
    levels = LEVELS_CFG.levels()
    assert flow.tenant == before.tenant and flow.priority in levels and before.priority in levels
    t = LEVELS_CFG.tenant(flow.tenant)
    if t.allow_priority_header:
        assert flow.priority <= (
            max(levels) if t.max_priority is None else max(t.max_priority, before.priority)
        )
    else:
        assert flow.priority <= before.priority
    if asked is None:
        assert flow == before
    elif asked <= before.priority:
        below = [lv for lv in levels if lv <= asked]
        assert flow.priority == (below[-1] if below else levels[0])
        assert ("priority:snapped" in notes) == (asked not in levels)
    elif not t.allow_priority_header:
        assert flow == before and notes[-1:] == ["priority:not_allowed"]


def test_an_inference_objective_sets_the_priority_a_configured_tenant_cannot_be_raised_by() -> None:
    cfg = FlowsConfig(
        tenant_header="x-tenant",
        objectives={"premium": 5, "sheddable": -1},
        tenants={
            "gold": TenantFlow(priority=2),
            "free": TenantFlow(allow_priority_header=True, max_priority=3),
        },
    )
    obj = "x-gateway-inference-objective"
    assert identify(cfg, None, {obj: "premium"}, KEYED) == (Flow("default", 5), [])
    assert identify(cfg, None, {obj: "premium", "x-priority": "2"}, KEYED) == (Flow("default", 2), [])
    assert identify(cfg, "gold", {obj: "premium"}, KEYED) == (Flow("gold", 2), ["objective:not_allowed"])
    assert identify(cfg, "gold", {obj: "sheddable"}, KEYED) == (Flow("gold", -1), [])
    assert identify(cfg, "free", {obj: "premium"}, KEYED) == (Flow("free", 3), [])
    assert identify(cfg, None, {obj: "nope"}, KEYED) == (Flow("default", 0), ["objective:unknown"])


def test_rate_limits_refuse_with_the_time_to_wait_and_refill() -> None:
    lim = RateLimiter(
        {"t": TenantFlow(requests_per_minute=2, tokens_per_minute=600)}.get  # type: ignore[arg-type]
    )
    assert lim.take("t", 100, 0.0) == 0.0
    assert lim.take("t", 100, 0.0) == 0.0
    assert lim.take("t", 100, 0.0) == pytest.approx(30.0)  # one request refills in 30 s
    assert lim.take("t", 100, 30.0) == 0.0
    assert lim.take("t", 600, 60.0) == 0.0  # both buckets full again (a minute's allowance at most)
    assert lim.take("t", 100, 60.0) == pytest.approx(30.0)  # the request bucket is the longer wait
    tokens = RateLimiter({"t": TenantFlow(tokens_per_minute=600)}.get)  # type: ignore[arg-type]
    assert tokens.take("t", 900, 0.0) == 0.0  # larger than a minute's: passes on a full bucket, in debt
    assert tokens.take("t", 100, 0.0) == pytest.approx(40.0)  # 300 owed + 100, at 10 tokens/s
    unlimited = RateLimiter(lambda name: TenantFlow())
    assert all(unlimited.take("x", 10**9, 0.0) == 0.0 for _ in range(100))


class Slots:
    """Capacity as a counter of free slots: what ``attempt`` claims in the pipeline."""

    def __init__(self, n: int) -> None:
        self.free = n

    def attempt(self) -> int | None:
        if self.free <= 0:
            return None
        self.free -= 1
        return 1

    def give_back(self, gate: CapacityGate) -> None:
        self.free += 1
        gate.release()


async def test_the_gate_serves_higher_priority_first_then_the_least_served_flow() -> None:
    gate = CapacityGate(16, 5.0, fairness="work")
    slots = Slots(1)
    assert await gate.acquire(slots.attempt, Flow("noisy", 0), cost=lambda _: 100.0) == 1
    order: list[str] = []

    async def one(flow: Flow, name: str) -> None:
        await gate.acquire(slots.attempt, flow, cost=lambda _: 100.0)
        order.append(name)

    tasks = [asyncio.create_task(one(Flow("noisy", 0), f"n{i}")) for i in range(3)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one(Flow("calm", 0), "c0")))
    tasks.append(asyncio.create_task(one(Flow("batch", -1), "b0")))  # sheddable: refused at once
    tasks.append(asyncio.create_task(one(Flow("vip", 1), "v0")))
    await asyncio.sleep(0)
    assert len(gate.queue) == 5
    for _ in range(5):
        slots.give_back(gate)
        await asyncio.sleep(0)
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[4], QueueFull) and done[4].reason == "sheddable"
    # vip first; calm's counter is lifted to noisy's (no banked credit), so the tie goes to the earlier
    # ticket; then calm, whose counter is now the least, before the noisy flow's second request
    assert order == ["v0", "n0", "c0", "n1", "n2"], order


async def test_a_full_queue_displaces_the_lowest_priority_newest_waiter() -> None:
    gate = CapacityGate(2, 5.0, fairness="work")
    slots = Slots(0)
    low = [asyncio.create_task(gate.acquire(slots.attempt, Flow("low", 0))) for _ in range(2)]
    await asyncio.sleep(0)
    high = asyncio.create_task(gate.acquire(slots.attempt, Flow("high", 1)))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as e:
        await low[1]
    assert e.value.reason == "displaced" and not low[0].done()
    with pytest.raises(QueueFull) as e2:  # a newcomer that outranks nobody is refused
        await gate.acquire(slots.attempt, Flow("low", 0))
    assert e2.value.reason == "queue_full"
    slots.give_back(gate)
    assert await high == 1
    slots.give_back(gate)
    assert await low[0] == 1


async def test_capacity_handed_to_a_waiter_that_left_is_given_back() -> None:
    gate = CapacityGate(4, 5.0)
    slots = Slots(0)
    undone: list[int] = []
    t = asyncio.create_task(gate.acquire(slots.attempt, undo=undone.append))
    await asyncio.sleep(0)
    slots.free = 1
    t.cancel()  # the waiter leaves, but before it runs again ...
    gate.release()  # ... capacity is handed to it
    with pytest.raises(asyncio.CancelledError):
        await t
    assert undone == [1] and len(gate.queue) == 0 and slots.free == 0


async def test_a_newcomer_does_not_overtake_a_waiter_of_its_group() -> None:
    gate = CapacityGate(4, 5.0)
    slots = Slots(0)
    first = asyncio.create_task(gate.acquire(slots.attempt, Flow("a", 0), group="m"))
    await asyncio.sleep(0)
    slots.free = 1  # freed without a release: the next newcomer of the group must not take it ...
    late = asyncio.create_task(gate.acquire(slots.attempt, Flow("b", 0), group="m"))
    await asyncio.sleep(0)
    assert await first == 1  # ... it waits, and its arrival hands the slot to the one that waited
    assert not late.done()
    other = await gate.acquire(lambda: 7, Flow("c", 0), group="other")  # another model is not held up
    assert other == 7
    late.cancel()


async def test_a_head_kept_out_of_the_reserve_does_not_hold_up_one_that_may_fill_it() -> None:
    # One slot is left, and it is the reserve: the noisy flow, with others of its own waiting, may not
    # fill it; the calm flow, with nothing else waiting, may.  The noisy head ranks first (earlier ticket,
    # equal counters), fails, and the calm head behind it gets the slot.
    gate = CapacityGate(16, 5.0, fairness="work")
    reserve = {"free": 0}

    def attempt(flow: Flow) -> int | None:
        if reserve["free"] and gate.queue.depth(flow) <= 1:
            reserve["free"] -= 1
            return 1
        return None

    noisy = [
        asyncio.create_task(gate.acquire(lambda: attempt(Flow("noisy", 1)), Flow("noisy", 1)))
        for _ in range(3)
    ]
    await asyncio.sleep(0)
    calm = asyncio.create_task(gate.acquire(lambda: attempt(Flow("calm", 1)), Flow("calm", 1)))
    await asyncio.sleep(0)
    assert len(gate.queue) == 4
    reserve["free"] = 1
    gate.release()
    assert await asyncio.wait_for(calm, 1.0) == 1
    assert not any(t.done() for t in noisy)
    for t in noisy:
        t.cancel()
    await asyncio.gather(*noisy, return_exceptions=True)


def test_objectives_are_read_from_headers_and_predicted_at_the_best_target() -> None:
    from kvrouter.flows import Objective, SloConfig, TargetView, miss, predict, read_objective

    cfg = SloConfig(prefill_tokens_per_s=1000.0, decode_step_s=0.02, decode_step_per_request_s=0.001)
    assert read_objective(cfg, {"x-slo-ttft-ms": "250", "x-slo-tpot-ms": " 40 "}) == (
        Objective(0.25, 0.04),
        [],
    )
    assert read_objective(cfg, {}) == (None, [])
    for bad in ("soon", "-5", "0", "nan", "inf", "1e12"):
        assert read_objective(cfg, {"x-slo-ttft-ms": bad}) == (None, ["ttft_slo:malformed"])
    # the least predicted TTFT decides: 500 queued + 100 uncached at 1,000 tokens/s, 10 decoding
    ttft, tpot = predict(cfg, [TargetView(4000, 1000, 0), TargetView(500, 100, 10)])
    assert ttft == pytest.approx(0.6) and tpot == pytest.approx(0.03)
    assert miss(Objective(0.5, None), ttft, tpot) == "ttft"
    assert miss(Objective(0.7, 0.025), ttft, tpot) == "tpot"
    assert miss(Objective(0.7, 0.05), ttft, tpot) is None
    assert predict(SloConfig(), [TargetView(10**6, 10**6, 100)]) == (None, None)  # no rates: no prediction
    assert miss(Objective(0.001, 0.001), None, None) is None


async def test_another_replicas_waiters_defer_only_lower_priorities_of_their_group() -> None:
    """Through a replicas' board: a peer's best waiter of another model never holds a request up; one of
    the same model defers a lower priority (not an equal one) until the peers' part changes."""
    from kvrouter.flows import ProcessBoard

    board = ProcessBoard()
    gate = CapacityGate(16, 5.0, fairness="work", shared=board)
    slots = Slots(3)
    m, other = ("m", None), ("other", None)
    board.set_peers(5, [(str(other), 2)])
    assert await asyncio.wait_for(gate.acquire(slots.attempt, Flow("a", 0), group=m), 1) == 1
    board.set_peers(5, [(str(m), 0)])  # the same model, the same priority: no deferring
    assert await asyncio.wait_for(gate.acquire(slots.attempt, Flow("a", 0), group=m), 1) == 1
    board.set_peers(5, [(str(m), 1)])  # a higher priority of the same model waits in a peer
    low = asyncio.create_task(gate.acquire(slots.attempt, Flow("a", 0), group=m))
    await asyncio.sleep(0.12)  # past two of its looks (poll_s)
    assert not low.done() and slots.free == 1 and len(gate.queue) == 1
    board.set_peers(0, [])  # the peer's waiter was served: the next round trip says so and wakes the gate
    gate.wake()
    assert await asyncio.wait_for(low, 1) == 1
    gate.close()
    with pytest.raises(QueueFull) as e:  # closed: nothing waits any more
        await gate.acquire(Slots(0).attempt, Flow("a", 0), group=m)
    assert e.value.reason == "shutting_down"


async def test_another_workers_waiters_hold_up_only_newcomers_of_their_groups() -> None:
    """Two workers of a host: one's waiters (of the heavy lane's group) make a newcomer of that group in
    the other wait behind them, as one process would; a newcomer of another group goes at once."""
    import threading

    from kvrouter.host import HostLayout, HostMemory
    from kvrouter.host.queue import GROUPS, QueueBoard

    layout = HostLayout(workers=2, targets=1, instances=1, ring_words=8, metric_bytes=64, flows=32)
    mem = HostMemory(layout, bytearray(layout.size()), threading.Lock())
    a_board, b_board = QueueBoard(mem, 0), QueueBoard(mem, 1)
    a = CapacityGate(16, 5.0, fairness="work", shared=a_board)
    b = CapacityGate(16, 5.0, fairness="work", shared=b_board)
    heavy, light = ("m", None, True), ("m", None, False)
    waiter = asyncio.create_task(a.acquire(Slots(0).attempt, Flow("noisy", 0), group=heavy))
    await asyncio.sleep(0)
    assert a_board.waiting_total() == 1 and b_board.other_groups() == {str(heavy)}
    assert await asyncio.wait_for(b.acquire(lambda: 1, Flow("calm", 0), group=light), 1) == 1
    held = asyncio.create_task(b.acquire(lambda: 2, Flow("noisy", 0), group=heavy))
    await asyncio.sleep(0.02)  # past several of its looks (poll_s): it waits behind a's waiter
    assert not held.done()
    # more groups waiting than a row shows: unknown, and every newcomer waits
    a_board.set_groups([f"g{i}" for i in range(GROUPS + 1)])
    assert b_board.other_groups() is None
    late = asyncio.create_task(b.acquire(lambda: 3, Flow("calm", 0), group=light))
    await asyncio.sleep(0.02)
    assert not late.done()
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    assert await asyncio.wait_for(held, 1) == 2 and await asyncio.wait_for(late, 1) == 3
