"""A bounded map whose entries expire: the shape of every affinity the router keeps (which instance holds
a stored response, which instance a session lives on).  Pure: the clock is passed in.

::

    put(key, value, now, ttl)   the entry lives until now + ttl (a put of a known key replaces it)
    get(key, now)               its value while now < its expiry, else None (and it is dropped)
    touch(key, now, ttl)        extends a live entry to now + ttl (sliding expiry)
    drop(key) / drop_where(pred) forget entries (an instance left the fleet)
    over capacity               the entry that expires first goes (ties: the one put first)

Invariants: ``len(self) <= capacity`` after every call; an expired entry is never returned; the heap
holds at most one live record per key (records of replaced entries are skipped lazily and compacted
when they outnumber the live ones).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ExpiringMap(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items: dict[K, tuple[V, float, int]] = {}
        """key -> (value, expiry, sequence of the put that wrote it)."""
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self.evicted = 0
        """Entries dropped for room before they expired."""

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def put(self, key: K, value: V, now: float, ttl: float) -> None:
        seq = next(self._seq)
        self._items[key] = (value, now + ttl, seq)
        heapq.heappush(self._heap, (now + ttl, seq, key))
        self.expire(now)
        while len(self._items) > self.capacity:
            self._pop_first()
            self.evicted += 1
        if len(self._heap) > 2 * len(self._items) + 64:
            self._compact()

    def get(self, key: K, now: float) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        if now >= item[1]:
            del self._items[key]
            return None
        return item[0]

    def expiry(self, key: K) -> float | None:
        item = self._items.get(key)
        return None if item is None else item[1]

    def touch(self, key: K, now: float, ttl: float) -> bool:
        """Extend a live entry to ``now + ttl`` (never shortens it); False if there is none."""
        item = self._items.get(key)
        if item is None or now >= item[1]:
            return False
        if now + ttl > item[1]:
            self.put(key, item[0], now, ttl)
        return True

    def drop(self, key: K) -> None:
        self._items.pop(key, None)

    def drop_where(self, pred: Callable[[K, V], bool]) -> int:
        gone = [k for k, (v, _, _) in self._items.items() if pred(k, v)]
        for k in gone:
            del self._items[k]
        return len(gone)

    def expire(self, now: float) -> None:
        """Drop every entry expired at ``now``."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, seq, key = heapq.heappop(heap)
            item = self._items.get(key)
            if item is not None and item[2] == seq:
                del self._items[key]

    def items(self, now: float) -> Iterator[tuple[K, V, float]]:
        """Live entries with their expiry."""
        return ((k, v, e) for k, (v, e, _) in list(self._items.items()) if now < e)

    def _pop_first(self) -> None:
        heap = self._heap
        while heap:
            _, seq, key = heapq.heappop(heap)
            item = self._items.get(key)
            if item is not None and item[2] == seq:
                del self._items[key]
                return

    def _compact(self) -> None:
        self._heap = [(e, s, k) for k, (_, e, s) in self._items.items()]
        heapq.heapify(self._heap)
