"""The least-recently-used set of block hashes under a block capacity that every offload tier of the
simulated engine is built on (the per-instance CPU tier, the shared store).  Pure: no I/O, no events."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvrouter.lab.sim.engine.types import BlockHash


class BlockLru:
    """Block hashes in least-recently-used order, at most ``num_blocks`` of them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def lookup(self, hashes: Sequence[BlockHash], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]`` are held, contiguously from ``start``; touches the hits."""
        lru = self._lru
        n = 0
        for h in hashes[start:stop]:
            if h not in lru:
                break
            n += 1
        # vLLM touches in reverse so the first block ends most recently used.
        for h in reversed(hashes[start : start + n]):
            lru.move_to_end(h)
        return n

    def admit(self, batch: Sequence[BlockHash]) -> tuple[list[BlockHash], list[BlockHash]]:
        """Add the blocks of ``batch`` not held yet, evicting the least recently used to make room:
        (added, evicted).  A batch with more new blocks than the whole capacity adds nothing (nothing
        could stay: vLLM's offloading manager skips such a store)."""
        lru = self._lru
        todo = list(dict.fromkeys(h for h in batch if h not in lru))
        if not todo or len(todo) > self.num_blocks:
            return [], []
        evicted = [lru.popitem(last=False)[0] for _ in range(max(0, len(lru) + len(todo) - self.num_blocks))]
        for h in todo:
            lru[h] = None
        return todo, evicted

    def clear(self) -> None:
        self._lru.clear()
