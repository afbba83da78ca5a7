"""An optional CPU tier below the GPU pool: the scheduler side of vLLM 0.33's ``OffloadingConnector`` with
its ``CPUOffloadingManager`` and LRU policy (vllm/distributed/kv_transfer/kv_connector/v1/offloading/,
vllm/v1/kv_offload/cpu/), held to its recordings (tests/fixtures/vllm_offload).

::

    chunk c of a request = blocks [c*bpc, (c+1)*bpc), keyed by the hash of its last block
    step k:  admission ── lookup: whole chunks on CPU right after the GPU hit ──▶ load (async: the request
                          holds its blocks, is scheduled from step k+1, its loaded blocks cached then)
             end of scheduling ── offer each scheduled request's newly computed prompt chunks, then
                          those of requests that finished in step k-1 ──▶ evict (one removal) + store
             end of step ── loads and stores complete ──▶ CPU events after the step's GPU events:
                          every removal of the step, then every store

What is modelled (what a router can observe):

* only prompt chunks are offloaded (``offload_prompt_only``, vLLM's default), whole chunks only; a chunk
  the tier holds is not stored again; a request offers its chunks from its first, hits included, unless
  it loaded from CPU (then from the end of its load);
* which chunk is evicted: ``offload_policy`` (recency by request, heads outliving tails); a store that
  cannot make room is skipped and offered again next step;
* the lookup continues the GPU hit from the chunk that holds its end, up to the whole prompt: vLLM loads
  every cached token and then recomputes the last one (``cached_tokens`` can equal the prompt); a lookup
  that would read a chunk another request is loading this step is retried next step;
* events: without ``self_describing`` one placeholder per stored chunk (its key's hash, no tokens) and
  removals listing keys; with it, each stored chunk's hashes, tokens and parent, and removals listing every
  block of every evicted chunk; one removal event per store that evicted;
* ``reset_prefix_cache`` and a restart empty the tier (one ``AllBlocksCleared`` covers both media).

Not modelled: transfers taking longer than the step that queued them (the timing model charges a load
in that step), failed transfers, the connector's other tiers and policies, partial-block ("partial tail")
loads, sliding-window and hybrid groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvrouter.lab.sim.engine.events import BlockRemoved, BlockStored, KVEvent
from kvrouter.lab.sim.engine.offload_policy import ChunkLru
from kvrouter.lab.sim.engine.request import Request
from kvrouter.lab.sim.engine.types import BlockHash
from kvrouter.types import RequestId


class _Tracked:
    """One request as the connector follows it, from its admission to the step after it finishes."""

    __slots__ = ("next_chunk", "rank", "seen")

    def __init__(self) -> None:
        self.rank = 0
        """Its recency rank, taken when it first stores or reuses a chunk (0: not yet)."""
        self.seen: dict[BlockHash, int] = {}
        """Chunks it stored or reused, with their end position in tokens."""
        self.next_chunk = 0
        """First chunk it has not offered yet."""


class CpuOffloadTier:
    """The chunks on CPU and the connector's per-request state.  Events go through ``emit`` (the GPU
    pool's outbox, so one order)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        emit: Callable[[KVEvent], None],
        *,
        blocks_per_chunk: int = 1,
        self_describing: bool = False,
    ) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.tokens_per_chunk = block_size * blocks_per_chunk
        self.self_describing = self_describing
        self._lru = ChunkLru(num_blocks // blocks_per_chunk)
        self._emit = emit
        self._blocks: dict[BlockHash, tuple[BlockHash, ...]] = {}  # chunk key -> its blocks' hashes
        self._chunk_of: dict[BlockHash, BlockHash] = {}  # block hash -> key of the chunk holding it
        self._described: dict[BlockHash, BlockStored] = {}  # self-describing store of each chunk
        self._tracked: dict[RequestId, _Tracked] = {}
        self._finished: list[tuple[Request, int]] = []  # finished last step, with their offer horizon
        self._removed: list[list[BlockHash]] = []  # this step's removal events (their hashes)
        self._stores: list[list[BlockHash]] = []  # this step's stores, one list per request
        self._loads: list[list[BlockHash]] = []  # this step's loads
        self._loading: set[BlockHash] = set()

    # ------------------------------------------------------------------ what the engine reads
    def __len__(self) -> int:
        """Blocks held (whole chunks)."""
        return len(self._lru) * self.blocks_per_chunk

    def __contains__(self, block_hash: BlockHash) -> bool:
        """The block is part of a chunk the tier holds."""
        key = self._chunk_of.get(block_hash)
        return key is not None and key in self._lru

    def chunk_keys(self) -> set[BlockHash]:
        """Keys of the chunks held and readable (what vLLM's manager reports as ready)."""
        return self._lru.ready_keys()

    def lookup(self, req: Request, local_blocks: int) -> int | None:
        """Tokens loadable right after a GPU hit of ``local_blocks`` (whole chunks, up to every token of
        the request); None: a chunk it needs is being loaded this step (ask again next step)."""
        bs, tpc, bpc = self.block_size, self.tokens_per_chunk, self.blocks_per_chunk
        local = local_blocks * bs
        req.ensure_hashes(req.num_tokens // bs)
        keyed = len(req.block_hashes) // bpc
        end = min(req.num_tokens, keyed * tpc)
        if end - local < tpc:
            return 0
        first = local // tpc
        hits = 0
        for c in range(first, -(-end // tpc)):
            if not self._lru.is_ready(self._key(req, c)):
                break
            hits += 1
        got = min(end, tpc * (first + hits)) - local
        if got < tpc:
            return 0
        if self._loading and any(self._key(req, c) in self._loading for c in range(first, first + hits)):
            return None
        return got

    # ------------------------------------------------------------------ the scheduler's calls
    def admitted(self, req: Request, local_blocks: int, load_tokens: int) -> None:
        """``req`` was admitted after a GPU hit of ``local_blocks``, loading ``load_tokens`` from CPU."""
        t = self._track(req)
        t.next_chunk = 0  # offered again from its first chunk
        if not load_tokens:
            return
        tpc = self.tokens_per_chunk
        first, end = (
            local_blocks // self.blocks_per_chunk,
            -(-(local_blocks * self.block_size + load_tokens) // tpc),
        )
        chunks = [(self._key(req, c), (c + 1) * tpc) for c in range(first, end)]
        for key, _ in chunks:
            self._lru.pin(key)
            self._loading.add(key)
        self._loads.append([k for k, _ in chunks])
        self._use(t, chunks)
        t.next_chunk = end

    def end_schedule(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        """Offer what this step computes (``scheduled``: each request and its new tokens, in scheduling
        order), then what the requests that finished last step left, then rank those requests' chunks."""
        for req, n in scheduled:
            self._offer(req, self._track(req), req.num_computed_tokens + n)
        done, self._finished = self._finished, []
        for req, horizon in done:
            t = self._tracked.get(req.request_id)
            if t is not None:
                self._offer(req, t, horizon)
        for req, _ in done:
            t = self._tracked.pop(req.request_id, None)
            if t is not None:
                # Tail first: a finished request's head chunks outlive its tail.
                self._lru.rerank(reversed(sorted(t.seen, key=t.seen.__getitem__)))

    def finished(self, req: Request, *, aborted: bool = False) -> None:
        """``req`` finished (or was aborted) this step: its last offer comes with the next step's."""
        if req.request_id in self._tracked:
            horizon = req.num_computed_tokens if aborted else max(req.num_prompt_tokens, req.num_tokens - 1)
            self._finished.append((req, horizon))

    def flush(self) -> None:
        """The step's loads and stores complete; its CPU events go out (removals, then stores)."""
        for keys in self._loads:
            for key in keys:
                self._lru.unpin(key)
        self._loads.clear()
        self._loading.clear()
        removed, self._removed = self._removed, []
        stores, self._stores = self._stores, []
        for hashes in removed:
            self._emit(BlockRemoved(hashes, medium="CPU"))
        for keys in stores:
            for key in keys:
                self._lru.complete(key)
                self._emit(self._stored_event(key))

    def reset(self) -> None:
        self._lru.clear()
        for pending in (self._blocks, self._chunk_of, self._described, self._tracked):
            pending.clear()
        for steps in (self._finished, self._removed, self._stores, self._loads):
            steps.clear()
        self._loading.clear()

    # ------------------------------------------------------------------ inside
    def _key(self, req: Request, chunk: int) -> BlockHash:
        return req.block_hashes[chunk * self.blocks_per_chunk + self.blocks_per_chunk - 1]

    def _track(self, req: Request) -> _Tracked:
        t = self._tracked.get(req.request_id)
        if t is None:
            t = self._tracked[req.request_id] = _Tracked()
        return t

    def _rank_of(self, t: _Tracked) -> int:
        if not t.rank:
            t.rank = self._lru.new_rank()
        return t.rank

    def _use(self, t: _Tracked, chunks: Iterable[tuple[BlockHash, int]]) -> None:
        """The request stores or reuses these chunks: the held ones rank at least as it does."""
        new = [(k, pos) for k, pos in chunks if k not in t.seen]
        if not new:
            return
        t.seen.update(new)
        rank = self._rank_of(t)
        for key, pos in new:
            self._lru.raise_rank(key, (rank, -pos))

    def _offer(self, req: Request, t: _Tracked, horizon: int) -> None:
        """Store the request's whole prompt chunks computed up to ``horizon`` tokens and not offered yet."""
        tpc, bpc = self.tokens_per_chunk, self.blocks_per_chunk
        offloadable = min(horizon, req.num_tokens, req.num_prompt_tokens)
        n = min(offloadable // tpc, len(req.block_hashes) // bpc)
        if n <= t.next_chunk:
            return
        chunks = [(self._key(req, c), (c + 1) * tpc) for c in range(t.next_chunk, n)]
        lru = self._lru
        self._use(t, [(k, pos) for k, pos in chunks if k not in lru or lru.is_ready(k)])
        todo = [(c, k, pos) for c, (k, pos) in enumerate(chunks, t.next_chunk) if k not in lru]
        if todo:
            short = len(todo) - lru.num_free
            if short > 0:
                evicted = lru.evict(short, {k for k, _ in chunks})
                if evicted is None:
                    return  # no room: offered again next step, as vLLM's failed prepare_store
                self._removed.append(self._removal_hashes(evicted))
                for key in evicted:
                    self._forget(key)
            rank = self._rank_of(t)
            for c, key, pos in todo:
                lru.insert(key, (rank, -pos))
                self._remember(req, c, key)
            self._stores.append([k for _, k, _ in todo])
        t.next_chunk = n

    def _remember(self, req: Request, chunk: int, key: BlockHash) -> None:
        bpc, bs = self.blocks_per_chunk, self.block_size
        first = chunk * bpc
        hashes = tuple(req.block_hashes[first : first + bpc])
        self._blocks[key] = hashes
        for h in hashes:
            self._chunk_of[h] = key
        if self.self_describing:
            self._described[key] = BlockStored(
                list(hashes),
                req.block_hashes[first - 1] if first else None,
                req.token_slice(first * bs, (first + bpc) * bs),
                bs,
                lora_id=req.lora_id,
                lora_name=req.lora_name,
                medium="CPU",
            )

    def _forget(self, key: BlockHash) -> None:
        for h in self._blocks.pop(key, ()):
            if self._chunk_of.get(h) == key:
                del self._chunk_of[h]
        self._described.pop(key, None)

    def _stored_event(self, key: BlockHash) -> BlockStored:
        if self.self_describing:
            return self._described[key]
        return BlockStored([key], None, [], self.block_size, medium="CPU")

    def _removal_hashes(self, keys: list[BlockHash]) -> list[BlockHash]:
        if not self.self_describing:
            return list(keys)
        return [h for key in keys for h in self._blocks[key]]
