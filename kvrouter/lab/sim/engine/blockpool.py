"""The paged KV block pool, with vLLM v1's prefix-caching semantics (vllm/v1/core/block_pool.py).

Fixed capacity, one KV page per block; each block has a ref count (running requests holding it) and a
hash once it is full and cached.  The free queue (eviction order, head first) holds fresh blocks, then
cached ones in LRU order; the cached map maps each hash to its blocks (a hash may map to several).

Invariants (checked by ``check()`` in the tests): a block is in the free queue iff its ref count is 0; a
block has a hash iff it is in the cached map under that hash; blocks are never de-duplicated (vLLM keeps
block tables append-only; a lookup returns the first one cached); allocation pops the queue head and
evicts its hash (one ``BlockRemoved`` per block); a prefix-cache hit emits nothing.

Freed fresh blocks go to the *front* of the queue, cached ones to the back in the order given ("tail
block first"), as current upstream ``BlockPool.free_blocks`` does (vllm PR #33710).  The queue is an
OrderedDict (O(1) pop-front, remove-from-middle, append, move-to-front).  ``num_blocks`` counts usable
blocks only: vLLM's ``num_gpu_blocks - 1`` (it reserves a null block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import cast

from kvrouter.lab.sim.engine.events import AllBlocksCleared, BlockRemoved, KVEvent
from kvrouter.lab.sim.engine.types import BlockHash, BlockId


class BlockPool:
    """Physical blocks, the free queue, the hash map and the event outbox.  Pure: events are only queued."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_events: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._ref: list[int] = [0] * num_blocks
        self._free: OrderedDict[BlockId, None] = OrderedDict.fromkeys(
            cast("Iterable[BlockId]", range(num_blocks))
        )
        self._by_hash: dict[BlockHash, BlockId] = {}
        self._dups: dict[BlockHash, list[BlockId]] = {}  # further blocks with the same hash, oldest first
        self._events: list[KVEvent] = []

    # ------------------------------------------------------------------ reads
    @property
    def num_free(self) -> int:
        """Blocks with no running user (fresh, or cached and evictable)."""
        return len(self._free)

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the fraction of blocks held by running requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block: BlockId) -> int:
        return self._ref[block]

    def block_hash(self, block: BlockId) -> BlockHash | None:
        return self._hash[block]

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash

    def num_cached_blocks(self) -> int:
        """Blocks holding a hash (running or evictable), duplicates included."""
        return len(self._by_hash) + sum(len(v) for v in self._dups.values())

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._by_hash)

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[BlockId]:
        """The cached blocks of the longest run of leading ``hashes`` (at most ``max_blocks``)."""
        if not self.enable_caching:
            return []
        by_hash = self._by_hash
        out: list[BlockId] = []
        for h in hashes[:max_blocks]:
            b = by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def leading_cached(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` are cached (no last-token cap): what a router should see."""
        n = 0
        by_hash = self._by_hash
        for h in hashes:
            if h not in by_hash:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ writes
    def touch(self, blocks: Iterable[BlockId]) -> None:
        """Take a reference on cache-hit blocks; a free one leaves the queue (it is no longer evictable)."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[BlockId]:
        """Pop ``n`` blocks off the queue head, evicting their hashes.  The caller checked ``num_free``."""
        free = self._free
        assert n <= len(free), "allocation beyond free blocks"
        pop = free.popitem
        out: list[BlockId] = [pop(False)[0] for _ in range(n)]
        hashes, ref, by_hash, dups = self._hash, self._ref, self._by_hash, self._dups
        events = self._events if self.enable_events else None
        # The hot loop of a simulation (one iteration per allocated block): the common eviction, a hash
        # held by this block alone, is inlined; duplicates take ``_evict``.
        for b in out:
            ref[b] = 1
            h = hashes[b]
            if h is not None:
                if h in dups or by_hash[h] != b:
                    self._evict(b, h)
                    continue
                del by_hash[h]
                hashes[b] = None
                if events is not None:
                    events.append(BlockRemoved([h]))
        return out

    def _evict(self, block: BlockId, h: BlockHash) -> None:
        first = self._by_hash[h]
        more = self._dups.get(h)
        if first == block:
            if more:
                self._by_hash[h] = more.pop(0)
                if not more:
                    del self._dups[h]
            else:
                del self._by_hash[h]
        else:
            assert more is not None
            more.remove(block)
            if not more:
                del self._dups[h]
        self._hash[block] = None
        if self.enable_events:
            self._events.append(BlockRemoved([h]))

    def cache_blocks(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash]) -> None:
        """Give newly full blocks their hashes and make them hittable (no de-duplication, see module doc)."""
        if not self.enable_caching:
            return
        by_hash, block_hash = self._by_hash, self._hash
        for b, h in zip(blocks, hashes):
            assert block_hash[b] is None, "block cached twice"
            block_hash[b] = h
        new = dict(zip(hashes, blocks))
        if len(new) == len(hashes) and by_hash.keys().isdisjoint(new):
            by_hash.update(new)  # the common case: every hash new (C loops, no per-block Python)
            return
        for b, h in zip(blocks, hashes):
            if h in by_hash:
                self._dups.setdefault(h, []).append(b)
            else:
                by_hash[h] = b

    def free_blocks(self, ordered: Iterable[BlockId]) -> None:
        """Drop one reference per block, given in eviction order (first evicted first)."""
        ref, hashes, free = self._ref, self._hash, self._free
        fresh: list[BlockId] = []
        for b in ordered:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if hashes[b] is None:
                    fresh.append(b)
                else:
                    free[b] = None
        for b in reversed(fresh):
            free[b] = None
            free.move_to_end(b, last=False)

    def reset(self) -> bool:
        """Forget every hash (vLLM's ``reset_prefix_cache``): only when no block is in use.  One
        ``AllBlocksCleared``, no removals; the free queue keeps its order."""
        if len(self._free) != self.num_blocks:
            return False
        self._by_hash.clear()
        self._dups.clear()
        self._hash = [None] * self.num_blocks
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def emit(self, event: KVEvent) -> None:
        if self.enable_events:
            self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        """Drain the outbox (vLLM's ``BlockPool.take_events``)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ tests
    def free_order(self) -> list[BlockId]:
        """The free queue, head (next to be reused) first."""
        return list(self._free)

    def check(self) -> None:
        """Assert the invariants of the module docstring (O(capacity): tests only)."""
        for b in range(self.num_blocks):
            blk = BlockId(b)
            assert (self._ref[b] == 0) == (blk in self._free), f"block {b}: ref {self._ref[b]}"
            assert self._ref[b] >= 0
            h = self._hash[b]
            if h is not None:
                assert self._by_hash[h] == blk or blk in self._dups.get(h, []), f"block {b} not mapped"
        mapped = len(self._by_hash) + sum(len(v) for v in self._dups.values())
        assert mapped == sum(h is not None for h in self._hash)
