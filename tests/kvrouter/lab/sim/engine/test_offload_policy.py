"""The CPU tier's eviction order (``ChunkLru``) against a plain reference model, and its literal rules."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.lab.sim.engine.offload_policy import ChunkLru
from kvrouter.lab.sim.engine.types import BlockHash


class RefLru:
    """Every chunk with its rank, readiness and pins; eviction sorts them all."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rank: dict[int, tuple[int, int]] = {}
        self.ready: dict[int, bool] = {}
        self.pins: dict[int, int] = {}
        self.next = 0

    def new_rank(self) -> int:
        self.next += 1
        return self.next

    def evictable(self) -> list[int]:
        return sorted((k for k in self.rank if self.ready[k] and not self.pins.get(k)), key=self.rank.get)

    def evict(self, n: int, protected: set[int]) -> list[int] | None:
        can = [k for k in self.evictable() if k not in protected]
        if len(can) < n:
            return None
        for k in can[:n]:
            del self.rank[k], self.ready[k]
        return can[:n]


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "complete", "pin", "unpin", "raise", "rerank", "evict"]),
        st.integers(0, 11),
        st.integers(1, 4),
        st.sets(st.integers(0, 11), max_size=4),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), ops)
def test_chunk_lru_evicts_as_the_reference(capacity: int, plan: list[tuple[str, int, int, Any]]) -> None:
    lru, ref = ChunkLru(capacity), RefLru(capacity)
    for op, key, n, keys in plan:
        k = BlockHash(key)
        if op == "insert" and key not in ref.rank and len(ref.rank) < capacity:
            rank = (ref.new_rank(), -n)
            assert lru.new_rank() == rank[0]
            lru.insert(k, rank)
            ref.rank[key], ref.ready[key] = rank, False
        elif op == "complete" and key in ref.rank and not ref.ready[key]:
            lru.complete(k)
            ref.ready[key] = True
        elif op == "pin" and ref.ready.get(key):
            lru.pin(k)
            ref.pins[key] = ref.pins.get(key, 0) + 1
        elif op == "unpin" and ref.pins.get(key):
            lru.unpin(k)
            ref.pins[key] -= 1
        elif op == "raise":
            rank = (ref.new_rank(), -n)
            lru.new_rank()
            lru.raise_rank(k, rank)
            if key in ref.rank:
                ref.rank[key] = max(ref.rank[key], rank)
        elif op == "rerank":
            order = sorted(keys)
            lru.rerank(BlockHash(x) for x in order)
            for x in order:
                if x in ref.rank:
                    ref.rank[x] = (ref.new_rank(), 0)
        elif op == "evict":
            assert lru.evict(n, {BlockHash(x) for x in keys}) == ref.evict(n, keys)
        assert len(lru) == len(ref.rank) and lru.num_free == capacity - len(ref.rank)
        assert lru.ready_keys() == {x for x, r in ref.ready.items() if r}


def test_a_store_in_flight_and_a_load_keep_their_chunks() -> None:
    lru = ChunkLru(3)
    a, b, c = (BlockHash(x) for x in (1, 2, 3))
    for key in (a, b, c):
        lru.insert(key, (lru.new_rank(), 0))
    assert lru.evict(1, set()) is None  # every store still in flight
    lru.complete(a)
    lru.complete(b)
    lru.pin(a)
    assert lru.evict(1, set()) == [b]  # a is being loaded
    lru.unpin(a)
    assert lru.evict(1, {a}) is None and lru.evict(1, set()) == [a]


def test_heads_outlive_tails_and_requests_outlive_older_ones() -> None:
    lru = ChunkLru(4)
    first = lru.new_rank()
    for pos, key in enumerate((10, 11)):
        lru.insert(BlockHash(key), (first, -pos))  # one request's head (10) and tail (11)
    second = lru.new_rank()
    lru.insert(BlockHash(20), (second, 0))
    for key in (10, 11, 20):
        lru.complete(BlockHash(key))
    assert lru.evict(3, set()) == [11, 10, 20]
