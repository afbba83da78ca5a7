"""Per-request KV bookkeeping on top of the pool: vLLM's ``KVCacheManager`` for one full-attention group.

::

    request blocks:  | hit | hit | ext | new | new | new |          (block table, append-only)
                     |<- touched ->|<-------- allocated ------->|
                     |<-- num_cached: stored ------>|             full blocks announced so far

* ``computed_blocks``: the longest run of cached leading blocks, capped at ``(num_tokens - 1) // bs``
  blocks: vLLM must compute the last prompt token to get logits, and computed tokens stay block-aligned, so
  a full hit recomputes the whole last block (kv_cache_manager.get_computed_blocks, ``max_cache_hit_length
  = request.num_tokens - 1``).
* ``allocate_slots``: fails (returns False) unless the free queue holds every new block *plus* every hit
  block that is currently evictable (touching removes it from the queue); on success, blocks that are full
  once this step's tokens are computed are cached and announced in one ``BlockStored`` per request per
  step, chained to the request's previous block (caching happens at scheduling time, as in vLLM).
* ``free``: reverse block order, so a finished request's tail blocks are evicted first.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrouter.lab.sim.engine.blockpool import BlockPool
from kvrouter.lab.sim.engine.events import BlockStored
from kvrouter.lab.sim.engine.offload import CpuOffloadTier
from kvrouter.lab.sim.engine.request import Request
from kvrouter.lab.sim.engine.shared_store import StoreClient
from kvrouter.lab.sim.engine.types import BlockHash, BlockId
from kvrouter.types import RequestId


class KVCacheManager:
    """Block tables of running requests, prefix-cache lookups and allocation.  Pure."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        offload: CpuOffloadTier | None = None,
        shared: StoreClient | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.offload = offload
        self.shared = shared
        """A shared store below the CPU tier (``shared_store``): written through, read after the CPU."""
        self._tables: dict[RequestId, list[BlockId]] = {}
        self._num_cached: dict[RequestId, int] = {}  # leading blocks of the table already cached

    @property
    def caching(self) -> bool:
        return self.pool.enable_caching

    def blocks_of(self, request_id: RequestId) -> list[BlockId]:
        return self._tables.get(request_id, [])

    def num_requests(self) -> int:
        return len(self._tables)

    # ------------------------------------------------------------------ lookups
    def computed_blocks(self, req: Request) -> list[BlockId]:
        """GPU prefix-cache hit of a request about to be scheduled (emits nothing, touches nothing)."""
        if not self.caching:
            return []
        return self.pool.longest_hit(req.block_hashes, (req.num_tokens - 1) // self.block_size)

    @property
    def has_external(self) -> bool:
        return self.offload is not None or self.shared is not None

    def external_split(self, req: Request, num_local_blocks: int) -> tuple[int, int] | None:
        """(tokens from the CPU tier, tokens from the shared store) continuing the GPU hit: the CPU tier's
        whole chunks first (``offload.lookup``), then the store's blocks from where they end (same
        last-token cap as the GPU hit).  None: the CPU tier asks to look again next step."""
        if not self.has_external or not self.caching:
            return 0, 0
        bs = self.block_size
        cpu = self.offload.lookup(req, num_local_blocks) if self.offload else 0
        if cpu is None:
            return None
        start, stop = num_local_blocks + cpu // bs, (req.num_tokens - 1) // bs
        shared = self.shared.lookup(req.block_hashes, start, stop) if self.shared else 0
        return cpu, shared * bs

    # ------------------------------------------------------------------ allocation
    def whole_sequence_fits(self, req: Request, hits: Sequence[BlockId], max_len: int) -> bool:
        """vLLM's admission gate (``--scheduler-reserve-full-isl``, on by default in 0.33): a waiting
        request is admitted only if the free blocks could hold its whole sequence, not just its first
        chunk, counting evictable hit blocks as taken (``allocate_slots(full_sequence_must_fit=True)``)."""
        bs = self.block_size
        need = -(-min(req.num_tokens, max_len) // bs) - len(hits)
        evictable = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        return max(need, 0) + evictable <= self.pool.num_free

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_hits: Sequence[BlockId] = (),
        num_external_tokens: int = 0,
        *,
        cache: bool = True,
    ) -> bool:
        """Blocks for ``num_new_tokens`` more tokens of ``req`` (plus, at admission, its hits and loads).
        ``cache=False``: the new blocks are not cached yet (a remote load in flight: ``cache_loaded``
        caches them when it lands, as vLLM's ``delay_cache_blocks``)."""
        bs = self.block_size
        pool = self.pool
        table = self._tables.get(req.request_id)
        end = req.num_computed_tokens + len(new_hits) * bs + num_external_tokens + num_new_tokens
        if table is not None and not new_hits and end <= len(table) * bs:
            # Fast path (most decode steps): the slots exist; maybe a block just became full.
            full = min(end, req.num_tokens) // bs
            if self.caching and full > self._num_cached.get(req.request_id, 0):
                self._cache(req, table, full)
            return True
        have = len(table) if table is not None else 0
        need = -(-end // bs) - have - len(new_hits)
        evictable_hits = sum(1 for b in new_hits if pool.ref_count(b) == 0) if new_hits else 0
        if max(need, 0) + evictable_hits > pool.num_free:
            return False
        if table is None:
            table = self._tables[req.request_id] = []
        if new_hits:
            pool.touch(new_hits)
            table.extend(new_hits)
            self._num_cached[req.request_id] = len(table)
            if self.shared is not None:
                self.shared.queue_store(req.block_hashes[: len(table)])
        if need > 0:
            table.extend(pool.get_new_blocks(need))
        if self.caching and cache:
            self._cache(req, table, min(end, req.num_tokens) // bs)
        return True

    def cache_loaded(self, req: Request, num_tokens: int) -> None:
        """A remote load landed: its full blocks up to ``num_tokens`` are cached and announced (one
        ``BlockStored``, chained to the local hit before them)."""
        table = self._tables.get(req.request_id)
        if table is not None and self.caching:
            self._cache(req, table, min(num_tokens, req.num_tokens) // self.block_size)

    def _cache(self, req: Request, table: list[BlockId], full: int) -> None:
        rid = req.request_id
        done = self._num_cached.get(rid, 0)
        if full <= done:
            return  # nothing newly full (most steps)
        req.ensure_hashes(full)
        hashes: list[BlockHash] = req.block_hashes[done:full]
        self.pool.cache_blocks(table[done:full], hashes)
        self._num_cached[rid] = full
        if self.pool.enable_events:
            bs = self.block_size
            self.pool.emit(
                BlockStored(
                    hashes,
                    req.block_hashes[done - 1] if done else None,
                    req.token_slice(done * bs, full * bs),
                    bs,
                    lora_id=req.lora_id,
                    lora_name=req.lora_name,
                    extra_keys=req.extra_keys(done, full),
                )
            )
        if self.shared is not None:
            self.shared.queue_store(hashes)

    def free(self, req: Request) -> None:
        """Release a finished, aborted or preempted request's blocks, tail first."""
        table = self._tables.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    def end_schedule(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        """Scheduling is over (``scheduled``: each request and its new tokens): the CPU tier takes the
        step's offers (the connector's ``build_connector_meta``)."""
        if self.offload is not None:
            self.offload.end_schedule(scheduled)

    def finished(self, req: Request, *, aborted: bool = False) -> None:
        """``req`` left the engine (its blocks are freed by ``free``)."""
        if self.offload is not None:
            self.offload.finished(req, aborted=aborted)

    def end_step(self) -> None:
        """Complete this step's offload stores (their events follow the step's GPU events)."""
        if self.offload is not None:
            self.offload.flush()
        if self.shared is not None:
            self.shared.flush()

    def reset(self) -> bool:
        """``reset_prefix_cache``: only with no request holding blocks."""
        if self._tables or not self.pool.reset():
            return False
        if self.offload is not None:
            self.offload.reset()
        if self.shared is not None:
            self.shared.reset()
        return True
