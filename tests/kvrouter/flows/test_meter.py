"""The work meter: each flow's recent work against a plain sum of decayed charges, and who is heavy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.flows import Flow, WorkMeter
from kvrouter.flows.meter import ACTIVE
from kvrouter.routing.isolation import Isolation

TENANTS = ["a", "b", "c", "d"]
charges = st.lists(
    st.tuples(st.sampled_from(TENANTS), st.floats(0.0, 5.0), st.integers(0, 20_000)), max_size=40
)


def reference(events: list[tuple[str, float, float]], now: float, half_life: float) -> dict[str, float]:
    """Every charge decayed from its own time to ``now``, summed per tenant, as shares."""
    work: dict[str, float] = {}
    for t, at, w in events:
        work[t] = work.get(t, 0.0) + w * 0.5 ** ((now - at) / half_life)
    total = sum(work.values())
    return {t: w / total for t, w in work.items() if w > 0} if total > 0 else {}


@settings(max_examples=200)
@given(charges, st.sampled_from([0.5, 2.0, 10.0]), st.floats(0.0, 3.0))
def test_shares_are_the_decayed_sums_of_the_charges(
    steps: list[tuple[str, float, int]], half_life: float, after: float
) -> None:
    m = WorkMeter(half_life)
    now, events = 0.0, []
    for tenant, dt, work in steps:
        now += dt
        m.add(tenant, work, now)
        events.append((tenant, now, float(work)))
    got, want = m.shares(now + after), reference(events, now + after, half_life)
    # a tenant below a millionth of the total may be forgotten; every other share is exact
    assert set(got) <= set(want)
    for t, s in want.items():
        assert got.get(t, 0.0) == pytest.approx(s, abs=2e-6)


@settings(max_examples=200)
@given(
    charges,
    st.sampled_from(TENANTS),
    st.integers(-1, 2),
    st.sampled_from([1.0, 1.5, 3.0]),
    st.integers(0, 3),
    st.integers(0, 2),
)
def test_heavy_is_over_its_weighted_fair_share_backlogged_or_below_the_quiet_priority(
    steps: list[tuple[str, float, int]], tenant: str, priority: int, over: float, waiting: int, backlog: int
) -> None:
    m, now, events = WorkMeter(5.0), 0.0, []
    for t, dt, work in steps:
        now += dt
        m.add(t, work, now)
        events.append((t, now, float(work)))
    weight = {"a": 2.0, "b": 1.0, "c": 1.0, "d": 0.5}.__getitem__
    flow = Flow(tenant, priority)
    got = m.heavy(
        flow, now, over_share=over, quiet_priority=1, weight=weight, waiting=waiting, backlog=backlog
    )
    shares = reference(events, now, 5.0)
    mine = shares.get(tenant, 0.0)
    active = sum(weight(t) for t, s in shares.items() if s >= ACTIVE - 1e-9 or t == tenant)
    if priority < 1 or (backlog and waiting >= backlog):
        assert got
    elif not mine:
        assert not got
    elif abs(mine - over * weight(tenant) / active) > 1e-6:  # (away from the boundary)
        assert got == (mine > over * weight(tenant) / active)


MANY = [f"t{i}" for i in range(40)]


@settings(max_examples=150)
@given(
    st.lists(
        st.tuples(st.sampled_from(MANY), st.floats(0.0, 30.0), st.sampled_from([1, 30, 1000, 50_000])),
        min_size=1,
        max_size=120,
    ),
    st.sampled_from(MANY),
)
def test_many_tenants_shares_and_heavy_against_the_reference(
    steps: list[tuple[str, float, int]], tenant: str
) -> None:
    """Forty tenants of very unequal work, with silences past the rescaling (64 half-lives): who counts
    as active comes and goes, and every answer is the plain decayed sums'."""
    m, now, events = WorkMeter(0.4), 0.0, []
    weight = lambda t: 1.0 + int(t[1:]) % 3  # noqa: E731
    for t, dt, work in steps:
        now += dt
        m.add(t, work, now)
        events.append((t, now, float(work)))
        shares = reference(events, now, 0.4)
        assert m.share(t, now) == pytest.approx(shares.get(t, 0.0), abs=2e-6)
        mine = shares.get(tenant, 0.0)
        active = sum(weight(x) for x, s in shares.items() if s >= ACTIVE - 1e-9 or x == tenant)
        if (
            mine
            and abs(mine - 1.5 * weight(tenant) / active) > 1e-6
            and all(abs(s - ACTIVE) > 1e-9 for s in shares.values())
        ):
            got = m.heavy(Flow(tenant, 1), now, over_share=1.5, quiet_priority=0, weight=weight)
            assert got == (mine > 1.5 * weight(tenant) / active)


def test_the_meter_forgets_tenants_that_came_once() -> None:
    """A hundred thousand tenants, each charged once, 100 a second: the meter holds those of the last few
    dozen half-lives, not every tenant it has seen."""
    m = WorkMeter(1.0)
    for i in range(100_000):
        m.add(f"once-{i}", 100, i * 0.01)
    assert 1000 < len(m) < 4000
    assert m.share("once-99999", 1000.0) > m.share("once-99000", 1000.0) > 0
    assert m.share("once-0", 1000.0) == 0


def test_a_flood_is_heavy_the_others_are_not_and_it_is_forgotten() -> None:
    m = WorkMeter(10.0)
    for i in range(50):
        m.add("noisy", 1200, i * 0.1)
        if i % 5 == 0:
            for t in ("calm-0", "calm-1", "calm-2"):
                m.add(t, 200, i * 0.1)
    rule = {"over_share": 1.5, "quiet_priority": 1}
    assert m.heavy(Flow("noisy", 1), 5.0, **rule)
    assert not any(m.heavy(Flow(f"calm-{i}", 1), 5.0, **rule) for i in range(3))
    assert m.heavy(Flow("calm-0", 0), 5.0, **rule)  # below the quiet priority, whatever its share
    # a lone flow is never heavy by share: its fair share is all of it
    lone = WorkMeter(10.0)
    lone.add("only", 1e6, 0.0)
    assert not lone.heavy(Flow("only", 1), 0.0, **rule)
    # the flood stops; the calm tenants go on, and after a few half-lives it is no longer heavy
    for k in range(1, 80):
        for t in ("calm-0", "calm-1", "calm-2"):
            m.add(t, 200, 5.0 + k)
    assert not m.heavy(Flow("noisy", 1), 85.0, **rule)
    with pytest.raises(ValueError):
        WorkMeter(0)


def test_a_flow_found_heavy_stays_heavy_for_hold_s() -> None:
    m = WorkMeter(10.0)
    rule = {"over_share": 1.5, "quiet_priority": 0, "backlog": 2, "hold_s": 1.0}
    m.add("calm", 100, 0.0)
    m.add("flood", 100, 0.0)  # equal shares: heavy only by its backlog
    assert m.heavy(Flow("flood", 0), 0.0, waiting=2, **rule)
    assert m.heavy(Flow("flood", 0), 0.9, waiting=0, **rule)  # its backlog drained for a moment
    assert not m.heavy(Flow("flood", 0), 1.1, waiting=0, **rule)  # held no longer
    assert not m.heavy(Flow("flood", 0), 1.2, waiting=0, **{**rule, "hold_s": 0.0})


def test_an_explain_reads_the_verdict_without_starting_or_ending_a_hold() -> None:
    """``lanes(dry_run=True)`` (``/v1/route/explain``): a flow heavy by its backlog is reported heavy, but
    no hold starts, and an explain after a hold has run out does not clear it for the next request."""
    iso = Isolation(quiet_share=0.5, over_share=1.5, backlog=2, hold_s=1.0)
    m = WorkMeter(10.0)
    m.add("calm", 100, 0.0)
    m.add("flood", 100, 0.0)
    flood = Flow("flood", 1)
    assert m.lanes(iso, flood, 0.0, waiting=2, dry_run=True)[0]
    assert not m.lanes(iso, flood, 0.5, waiting=0)[0]  # the explain started no hold
    assert m.lanes(iso, flood, 0.6, waiting=2)[0]  # a request's verdict does: held until 1.6
    assert m.lanes(iso, flood, 1.0, waiting=0, dry_run=True)[0]
    assert not m.lanes(iso, flood, 1.7, waiting=0, dry_run=True)[0]
    assert m._until  # the ended hold is left for a request's verdict to clear
    assert not m.lanes(iso, flood, 1.8, waiting=0)[0] and not m._until


def test_the_quiet_targets_open_once_no_light_flow_has_been_admitted_for_idle_s() -> None:
    m = WorkMeter(10.0)
    assert not m.light_idle(100.0, 2.0)  # nothing admitted yet: nothing is heavy either
    m.add("batch", 4096, 0.0)  # a heavy flow alone from the start: the clock starts at its first
    assert not m.light_idle(1.5, 2.0) and m.light_idle(2.5, 2.0)
    m.add("calm", 100, 3.0, light=True)
    m.add("batch", 4096, 4.0)  # heavy admissions do not keep the quiet targets closed
    assert not m.light_idle(4.9, 2.0) and m.light_idle(5.1, 2.0)
    assert not m.light_idle(50.0, 0.0)  # 0: never
