"""A KV store several simulated engines attach: HyperPod's L2, an LMCache remote server, a shared file
system behind vLLM's OffloadingConnector.  Pure: no I/O, no clock.

::

    engine i ──StoreClient i──┐  queue_store (the blocks it caches or hits on GPU), flush at step end
    engine j ──StoreClient j──┼──▶ SharedStore: one LRU of block hashes, capacity in blocks
    engine k ──StoreClient k──┘  lookup: contiguous hits after an engine's GPU and CPU hits

What is modelled (what a router can observe, and what the store costs):

* write-through: every block an engine caches or hits on GPU is written to the store too (LMCache's
  local CPU + remote backend); a block the store already holds is not written again (the store's
  existence check), so nothing is announced for it;
* the writer announces what it wrote as vLLM 0.33's OffloadingConnector does for its non-GPU tiers: one
  ``BlockStored(medium="STORAGE", token_ids=[], parent=None)`` placeholder per store batch, on the
  writing engine's own event stream;
* the store evicts least-recently-used blocks at capacity and announces **no** removal (vLLM's fs/obj
  tiers, LMCache's pool): the router must bound what it believes itself (``indexer.tiers.AgeBook``);
* a lookup continues an engine's GPU (then CPU) hit with the store's contiguous run, touches the hits,
  and the engine loads them at the store's bandwidth (``timing``: ``shared_loaded_tokens``);
* one engine's restart or ``reset_prefix_cache`` leaves the store as it was (it is not the engine's).

Not modelled: the bandwidth shared between engines loading at once (each load gets the whole link),
write costs (asynchronous in every such connector), failures of the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvrouter.lab.sim.engine.block_lru import BlockLru
from kvrouter.lab.sim.engine.events import BlockStored, KVEvent
from kvrouter.lab.sim.engine.types import BlockHash


class SharedStore(BlockLru):
    """An LRU set of block hashes with a capacity, shared by every attached engine."""

    def __init__(self, num_blocks: int, block_size: int, load_bytes_per_s: float) -> None:
        super().__init__(num_blocks, block_size)
        if load_bytes_per_s <= 0:
            raise ValueError("load_bytes_per_s must be positive")
        self.load_bytes_per_s = load_bytes_per_s
        self.evicted = 0
        """Blocks dropped for capacity so far (silently: nobody is told)."""

    def put(self, batch: Sequence[BlockHash]) -> list[BlockHash]:
        """Write the blocks the store does not hold yet; returns them (the writer announces these).  A
        batch larger than the store is not written at all (nothing could stay)."""
        written, evicted = self.admit(batch)
        self.evicted += len(evicted)
        return written


class StoreClient:
    """One engine's attachment to a ``SharedStore``: its pending writes and its event stream."""

    def __init__(self, store: SharedStore, emit: Callable[[KVEvent], None]) -> None:
        self.store = store
        self._emit = emit
        self._pending: list[list[BlockHash]] = []

    def lookup(self, hashes: Sequence[BlockHash], start: int, stop: int) -> int:
        return self.store.lookup(hashes, start, stop)

    def queue_store(self, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            self._pending.append(list(hashes))

    def flush(self) -> None:
        """Write the queued batches, in order (end of step), announcing what was written."""
        batches, self._pending = self._pending, []
        for batch in batches:
            written = self.store.put(batch)
            if written:
                self._emit(BlockStored(written, None, [], self.store.block_size, medium="STORAGE"))

    def reset(self) -> None:
        """The engine restarted or reset its prefix cache: its unwritten batches are lost, the store stays."""
        self._pending.clear()
