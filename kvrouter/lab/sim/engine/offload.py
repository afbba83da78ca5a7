"""An optional CPU tier below the GPU pool, modelled on vLLM's native ``OffloadingConnector`` with its
``LRUOffloadingManager`` (vllm/v1/kv_offload/lru_manager.py).

What is modelled (what a router can observe):

* every GPU block a running request computes (or hits) is offered to the CPU tier, keyed by the same block
  hash; blocks already on CPU are skipped;
* the CPU tier has a fixed capacity in blocks and evicts least-recently-used blocks to make room; a store
  batch larger than the whole tier is dropped (``prepare_store`` returns None in vLLM);
* one store batch per request per step; its evictions are one ``BlockRemoved(medium="CPU")`` listing every
  evicted hash, then one ``BlockStored(medium="CPU", token_ids=[], parent=None)`` placeholder listing the
  stored hashes (the connector's ``take_events`` shape);
* a new request whose GPU prefix hit ends early continues its match on CPU (contiguous hits only, capped
  like the GPU hit so the last prompt token is computed); those tokens are loaded into fresh GPU blocks,
  which are then cached and announced on GPU like any computed block; a lookup hit refreshes the LRU;
* ``reset_prefix_cache`` and a restart empty the tier (one ``AllBlocksCleared`` covers both media).

What is not modelled: asynchronous transfers (a store completes in the step that queued it, a load makes
its request runnable at once; the timing model charges the load), offloaded blocks larger than GPU blocks,
failed stores, LMCache/remote storage tiers, the connector's separate prefix-cache metrics labels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvrouter.lab.sim.engine.block_lru import BlockLru
from kvrouter.lab.sim.engine.events import BlockRemoved, BlockStored, KVEvent
from kvrouter.lab.sim.engine.types import BlockHash


class CpuOffloadTier(BlockLru):
    """LRU set of block hashes with a capacity.  Events go through ``emit`` (the GPU pool's: one order)."""

    def __init__(self, num_blocks: int, block_size: int, emit: Callable[[KVEvent], None]) -> None:
        super().__init__(num_blocks, block_size)
        self._pending: list[list[BlockHash]] = []
        self._emit = emit

    def queue_store(self, hashes: Sequence[BlockHash]) -> None:
        """One request's blocks to offload this step (done at ``flush``)."""
        if hashes:
            self._pending.append(list(hashes))

    def flush(self) -> None:
        """Store the queued batches, in order (end of step)."""
        batches, self._pending = self._pending, []
        for batch in batches:
            self._store(batch)

    def _store(self, batch: list[BlockHash]) -> None:
        stored, evicted = self.admit(batch)
        if not stored:
            return  # nothing new, or more than the tier holds: vLLM skips the store
        if evicted:
            self._emit(BlockRemoved(evicted, medium="CPU"))
        self._emit(BlockStored(stored, None, [], self.block_size, medium="CPU"))

    def reset(self) -> None:
        self.clear()
        self._pending.clear()
