"""``ExpiringMap`` against a reference model (a plain dict scanned in full), by Hypothesis state machine:
the same answers to every get, the same size, the bound kept, the earliest expiry evicted first."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvrouter.routing.expiring import ExpiringMap

KEYS = st.integers(0, 12)
VALUES = st.sampled_from(["a", "b", "c"])
TTLS = st.sampled_from([0.5, 1.0, 2.0, 5.0])


class Reference:
    """The specification, written the slow obvious way."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[int, tuple[str, float, int]] = {}
        self.seq = 0

    def put(self, k: int, v: str, now: float, ttl: float) -> None:
        self.seq += 1
        self.items[k] = (v, now + ttl, self.seq)
        self.items = {key: it for key, it in self.items.items() if it[1] > now}
        while len(self.items) > self.capacity:
            first = min(self.items, key=lambda key: (self.items[key][1], self.items[key][2]))
            del self.items[first]

    def get(self, k: int, now: float) -> str | None:
        it = self.items.get(k)
        if it is None or now >= it[1]:
            self.items.pop(k, None)
            return None
        return it[0]

    def touch(self, k: int, now: float, ttl: float) -> bool:
        it = self.items.get(k)
        if it is None or now >= it[1]:
            return False
        if now + ttl > it[1]:
            self.put(k, it[0], now, ttl)
        return True


class Machine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.real: ExpiringMap[int, str] = ExpiringMap(4)
        self.ref = Reference(4)

    @rule(dt=st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(k=KEYS, v=VALUES, ttl=TTLS)
    def put(self, k: int, v: str, ttl: float) -> None:
        self.real.put(k, v, self.now, ttl)
        self.ref.put(k, v, self.now, ttl)

    @rule(k=KEYS)
    def get(self, k: int) -> None:
        assert self.real.get(k, self.now) == self.ref.get(k, self.now)

    @rule(k=KEYS, ttl=TTLS)
    def touch(self, k: int, ttl: float) -> None:
        assert self.real.touch(k, self.now, ttl) == self.ref.touch(k, self.now, ttl)

    @rule(k=KEYS)
    def drop(self, k: int) -> None:
        self.real.drop(k)
        self.ref.items.pop(k, None)

    @rule(v=VALUES)
    def drop_where(self, v: str) -> None:
        self.real.drop_where(lambda _k, val: val == v)
        self.ref.items = {k: it for k, it in self.ref.items.items() if it[0] != v}

    @invariant()
    def same_live_entries(self) -> None:
        live = {k: v for k, v, _ in self.real.items(self.now)}
        assert live == {k: it[0] for k, it in self.ref.items.items() if self.now < it[1]}
        assert len(self.real) <= 4


Machine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_expiring_map_matches_reference = Machine.TestCase


def test_literal_behaviour() -> None:
    m: ExpiringMap[str, int] = ExpiringMap(2)
    m.put("a", 1, now=0.0, ttl=10)
    m.put("b", 2, now=1.0, ttl=1)
    assert m.get("b", 1.5) == 2 and m.get("b", 2.0) is None  # expired at exactly its expiry
    m.put("b", 2, now=2.0, ttl=1)
    m.put("c", 3, now=2.5, ttl=5)  # full: "b" expires first and goes, not the older "a"
    assert m.get("a", 3.0) == 1 and m.get("b", 2.6) is None and m.get("c", 3.0) == 3 and m.evicted == 1
    assert m.touch("c", 4.0, 10) and m.expiry("c") == 14.0
    assert not m.touch("zz", 4.0, 10)
    with pytest.raises(ValueError):
        ExpiringMap(0)


def test_heap_stays_bounded_under_rewrites() -> None:
    m: ExpiringMap[int, int] = ExpiringMap(8)
    for i in range(10_000):
        m.put(i % 3, i, now=float(i), ttl=1e9)
    assert len(m) == 3 and len(m._heap) <= 2 * 3 + 65
