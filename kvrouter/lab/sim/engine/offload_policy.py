"""The CPU tier's chunks and which one goes first: vLLM 0.33's ``LRUCachePolicy`` with the chunk accounting
of its ``CPUOffloadingManager`` (vllm/v1/kv_offload/cpu/policies/lru.py, cpu/manager.py).  Pure.

::

    rank of a chunk  = (request rank, -end position)   set when a request stores or first reuses it
                     = (fresh rank, 0)                 re-set, tail first, when that request finishes
    evict            = the lowest rank among chunks that are ready, not being loaded, and not offered
                       by the request that needs the room

Recency follows requests, not touches: a request takes one rank the first time it stores or reuses a
chunk, and every chunk it holds ranks by it, its tail below its head (the tail goes first).  Ranks only
rise while the request runs; a lookup does not count as a use, a load does.  A chunk in flight (stored
this step, or read by a load this step) cannot be evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from kvrouter.lab.sim.engine.types import BlockHash

Rank = tuple[int, int]


class ChunkLru:
    """Chunks keyed by the hash of their last block, at most ``num_chunks`` of them."""

    def __init__(self, num_chunks: int) -> None:
        if num_chunks <= 0:
            raise ValueError("num_chunks must be positive")
        self.num_chunks = num_chunks
        self._ready: dict[BlockHash, bool] = {}  # held chunks; False while their store is in flight
        self._rank: dict[BlockHash, Rank] = {}
        self._pins: dict[BlockHash, int] = {}  # loads reading the chunk this step
        self._evictable: set[BlockHash] = set()
        self._heap: list[tuple[Rank, BlockHash]] = []  # lazily invalidated: stale entries are skipped
        self._next_rank = 0

    def __len__(self) -> int:
        return len(self._ready)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._ready

    def is_ready(self, key: BlockHash) -> bool:
        return self._ready.get(key, False)

    def ready_keys(self) -> set[BlockHash]:
        return {k for k, ready in self._ready.items() if ready}

    @property
    def num_free(self) -> int:
        return self.num_chunks - len(self._ready)

    def new_rank(self) -> int:
        self._next_rank += 1
        return self._next_rank

    def raise_rank(self, key: BlockHash, rank: Rank) -> None:
        """A request reuses a held chunk: it ranks at least as the request's (``on_request_access``)."""
        if key in self._rank and self._rank[key] < rank:
            self._rank[key] = rank
            self._push(key)

    def rerank(self, keys: Iterable[BlockHash]) -> None:
        """A fresh rank per held chunk, in the given order (the first goes first)."""
        for key in keys:
            if key in self._ready:
                self._rank[key] = (self.new_rank(), 0)
                self._push(key)

    def insert(self, key: BlockHash, rank: Rank) -> None:
        """A chunk whose store starts now (not evictable until ``complete``)."""
        self._ready[key] = False
        self._rank[key] = rank

    def complete(self, key: BlockHash) -> None:
        """Its store finished: readable, and evictable unless a load reads it."""
        self._ready[key] = True
        if not self._pins.get(key):
            self._evictable.add(key)
            self._push(key)

    def pin(self, key: BlockHash) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1
        self._evictable.discard(key)

    def unpin(self, key: BlockHash) -> None:
        left = self._pins.pop(key, 1) - 1
        if left > 0:
            self._pins[key] = left
        elif self._ready.get(key):
            self._evictable.add(key)
            self._push(key)

    def evict(self, n: int, protected: set[BlockHash]) -> list[BlockHash] | None:
        """Remove the ``n`` lowest-ranked evictable chunks not in ``protected``, lowest first; None (and
        nothing removed) when fewer than ``n`` can go."""
        chosen: list[tuple[Rank, BlockHash]] = []
        kept: list[tuple[Rank, BlockHash]] = []
        seen: set[BlockHash] = set()
        while self._heap and len(chosen) < n:
            entry = heapq.heappop(self._heap)
            rank, key = entry
            if key not in self._evictable or self._rank.get(key) != rank or key in seen:
                continue  # stale, or a duplicate of an entry already taken
            seen.add(key)
            (kept if key in protected else chosen).append(entry)
        for entry in kept:
            heapq.heappush(self._heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                heapq.heappush(self._heap, entry)
            return None
        out = []
        for _, key in chosen:
            self._evictable.discard(key)
            del self._ready[key], self._rank[key]
            out.append(key)
        return out

    def clear(self) -> None:
        self._ready.clear()
        self._rank.clear()
        self._pins.clear()
        self._evictable.clear()
        self._heap.clear()
        self._next_rank = 0

    def _push(self, key: BlockHash) -> None:
        if key in self._evictable:
            heapq.heappush(self._heap, (self._rank[key], key))
            if len(self._heap) > 2 * len(self._evictable) + 64:
                self._heap = [(self._rank[k], k) for k in self._evictable]
                heapq.heapify(self._heap)
