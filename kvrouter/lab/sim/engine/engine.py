"""``Engine``: one simulated vLLM engine (one data-parallel rank), pure and clock-agnostic.

::

    add_request ──▶ Scheduler ──▶ KVCacheManager ──▶ BlockPool (+ CpuOffloadTier)
                        │                                 │
    step() ◀── outputs, BatchStats ──▶ TimingModel        └──▶ events outbox ──▶ take_events()

``step()`` runs one scheduling iteration and returns what it produced with its modelled duration; it never
sleeps.  A live shell sleeps ``duration_s`` (real time), an evaluator advances a virtual clock by it.  The
events of a step are drained with ``take_events()`` after the step (one publisher batch per non-empty
step, as vLLM publishes).  Nothing here reads a clock, a global, or an environment variable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

from indexer.hashing import TokenIds
from kvrouter.lab.sim.engine.blockpool import BlockPool
from kvrouter.lab.sim.engine.events import KVEvent
from kvrouter.lab.sim.engine.hashing import block_extra_keys, chain_hashes, extra_digest, none_hash, warmup
from kvrouter.lab.sim.engine.kvcache import KVCacheManager
from kvrouter.lab.sim.engine.offload import CpuOffloadTier
from kvrouter.lab.sim.engine.request import Request
from kvrouter.lab.sim.engine.scheduler import BatchStats, KvLoad, RequestOutput, Scheduler, SchedulerConfig
from kvrouter.lab.sim.engine.shared_store import SharedStore, StoreClient
from kvrouter.lab.sim.engine.timing import TimingModel, get_profile
from kvrouter.lab.sim.engine.types import BlockHash, BlockId
from kvrouter.lab.sim.errors import DuplicateRequest, RequestRejected, RequestTooLong, SimConfigError
from kvrouter.types import RequestId


class CacheConfig(msgspec.Struct, frozen=True):
    block_size: int = 16
    """Tokens per KV block (vLLM's default for most attention backends)."""
    num_gpu_blocks: int | None = None
    """KV capacity in blocks; None: the timing profile's (derived from GPU memory)."""
    enable_prefix_caching: bool = True
    """vLLM ``--enable-prefix-caching`` (on by default in v1).  Off: no hits, no hashes, no events."""
    enable_kv_cache_events: bool = True
    """Queue KV events for the publisher (vLLM ``enable_kv_cache_events``)."""
    cpu_offload_blocks: int = 0
    """Capacity of the CPU offload tier in blocks, whole chunks of them; 0 disables it (see ``offload.py``
    for what is modelled)."""
    cpu_offload_blocks_per_chunk: int = 1
    """Blocks per chunk, the unit the CPU tier stores, evicts and loads (the connector's
    ``blocks_per_chunk``)."""
    cpu_offload_self_describing: bool = False
    """CPU stores name every block of their chunk with its tokens and parent, where by default each is
    one placeholder hash (the connector's ``self_describing_kv_events``)."""
    hash_seed: int = 0
    """Seed of NONE_HASH, the parent of every block 0 (vLLM >= 0.30: fixed unless PYTHONHASHSEED is set)."""

    def validate(self) -> None:
        if not 1 <= self.block_size <= 1024:
            raise SimConfigError("block_size must be in 1..1024")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise SimConfigError("num_gpu_blocks must be >= 1")
        if self.cpu_offload_blocks < 0:
            raise SimConfigError("cpu_offload_blocks must be >= 0")
        if self.cpu_offload_blocks_per_chunk < 1:
            raise SimConfigError("cpu_offload_blocks_per_chunk must be >= 1")
        if 0 < self.cpu_offload_blocks < self.cpu_offload_blocks_per_chunk:
            raise SimConfigError("cpu_offload_blocks must hold at least one chunk")


class EngineConfig(msgspec.Struct, frozen=True):
    profile: str = "test"
    """Timing profile name (``timing.PROFILES``)."""
    speed: float = 1.0
    """Run this many times faster than the modelled hardware (step durations are divided by it)."""
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    """KV pool, prefix cache, events and CPU tier."""
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    """Batching limits."""
    vocab_size: int = 32000
    """Generated token ids are drawn from 0 .. vocab_size - 1."""
    seed: int = 0
    """Base of the per-request output seeds when a request brings none."""

    def validate(self) -> None:
        if self.speed <= 0:
            raise SimConfigError("speed must be positive")
        if self.vocab_size < 1:
            raise SimConfigError("vocab_size must be >= 1")
        self.cache.validate()
        self.scheduler.validate()
        get_profile(self.profile).validate()


class StepResult(msgspec.Struct, gc=False):
    outputs: list[RequestOutput]
    """Requests that produced a token or finished this step."""
    duration_s: float
    """Modelled duration of the step (already divided by ``speed``); 0 when nothing ran."""
    num_scheduled: int
    prefill_tokens: int
    """Prompt (or recomputed) tokens computed; prefix-cache hits are not computed."""
    decode_tokens: int
    """Requests that decoded one token."""
    loaded_tokens: int
    """Tokens loaded from the CPU tier."""
    preempted: list[RequestId]
    shared_loaded_tokens: int = 0
    """Tokens loaded from the shared store."""
    encoder_tokens: int = 0
    """Multimodal embeddings the encoder computed (``encoder``)."""


class EngineMetrics(msgspec.Struct):
    """What vLLM's /metrics exposes (names in the field docs), as one snapshot."""

    num_requests_running: int
    """``vllm:num_requests_running``"""
    num_requests_waiting: int
    """``vllm:num_requests_waiting``"""
    kv_cache_usage_perc: float
    """``vllm:kv_cache_usage_perc`` (0..1: blocks held by running requests)"""
    prefix_cache_queries_total: int
    """``vllm:prefix_cache_queries_total`` (tokens of newly admitted requests)"""
    prefix_cache_hits_total: int
    """``vllm:prefix_cache_hits_total`` (of those, tokens found in the GPU prefix cache)"""
    external_prefix_cache_queries_total: int
    """``vllm:external_prefix_cache_queries_total`` (CPU tier)"""
    external_prefix_cache_hits_total: int
    """``vllm:external_prefix_cache_hits_total``"""
    num_preemptions_total: int
    """``vllm:num_preemptions_total``"""
    prompt_tokens_total: int
    """``vllm:prompt_tokens_total``"""
    generation_tokens_total: int
    """``vllm:generation_tokens_total``"""
    request_success_total: int
    """``vllm:request_success_total`` (finished by length)"""
    num_gpu_blocks: int
    """Capacity (``vllm:cache_config_info`` num_gpu_blocks)."""
    gpu_cached_blocks: int
    """Blocks holding a hash, running or evictable."""
    cpu_cached_blocks: int
    """Blocks in the CPU tier."""


class Engine:
    """A simulated vLLM engine.  Single-threaded: one owner calls every method."""

    def __init__(self, config: EngineConfig | None = None, *, shared: SharedStore | None = None) -> None:
        """``shared``: a store this engine attaches with others (``shared_store``), below its CPU tier."""
        config = config or EngineConfig()
        config.validate()
        self.config = config
        self.profile = get_profile(config.profile)
        self.shared_store = shared
        self.timing = (
            TimingModel(self.profile, config.speed, shared_load_bytes_per_s=shared.load_bytes_per_s)
            if shared is not None
            else TimingModel(self.profile, config.speed)
        )
        bs = self.block_size = config.cache.block_size
        self.num_gpu_blocks = config.cache.num_gpu_blocks or self.profile.kv_capacity_blocks(bs)
        if self.num_gpu_blocks < 1:
            raise SimConfigError("no KV blocks")
        fits = self.num_gpu_blocks * bs
        wanted = config.scheduler.max_model_len
        if wanted is not None and wanted > fits:
            # vLLM refuses to start when one max-length request cannot fit in the KV cache.
            raise SimConfigError(f"max_model_len {wanted} exceeds the KV cache ({fits} tokens)")
        self.max_model_len = min(wanted or fits, self.profile.max_context, fits)
        self._none_hash = none_hash(config.cache.hash_seed)
        warmup()
        self._build()

    def _build(self) -> None:
        cc = self.config.cache
        caching = cc.enable_prefix_caching
        self.pool = BlockPool(
            self.num_gpu_blocks,
            enable_caching=caching,
            enable_events=cc.enable_kv_cache_events and caching,
        )
        offload = (
            CpuOffloadTier(
                cc.cpu_offload_blocks,
                self.block_size,
                self.pool.emit,
                blocks_per_chunk=cc.cpu_offload_blocks_per_chunk,
                self_describing=cc.cpu_offload_self_describing,
            )
            if cc.cpu_offload_blocks and caching
            else None
        )
        shared = (
            StoreClient(self.shared_store, self.pool.emit)
            if self.shared_store is not None and caching
            else None
        )
        self.kv = KVCacheManager(self.pool, self.block_size, offload, shared)
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.max_model_len)
        self._lora_ids: dict[str, int] = {}
        self.steps = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        seed: int | None = None,
        output_token_ids: Sequence[int] | None = None,
        hold_blocks: bool = False,
        remote_prefill_tokens: int | None = None,
        mm_items: Sequence[tuple[str, int, int]] = (),
    ) -> None:
        """Queue a request.  Raises ``RequestRejected`` (a 400 in the shell) if vLLM would refuse it.

        ``output_token_ids``: the tokens the request will generate, in order (a trace's recorded answer);
        missing ones (and all, when None) are pseudo-random for ``seed`` (default: from the request id).
        ``hold_blocks``: a prefill leg, whose blocks outlive it until ``release_held``.
        ``remote_prefill_tokens``: a decode leg, whose first that many prompt tokens a prefill instance
        holds (they are pulled rather than computed: see ``take_loads`` and ``finish_load``).
        ``mm_items``: the prompt's multimodal items ``(identifier, offset, length)``: keyed into its blocks
        and published in its events' ``extra_keys`` as vLLM does."""
        rid = RequestId(request_id)
        if rid in self.scheduler.requests:
            raise DuplicateRequest(f"request {request_id!r} is already in the engine")
        if len(prompt_token_ids) == 0:
            raise RequestRejected("empty prompt")
        if max_tokens < 1:
            raise RequestRejected("max_tokens must be >= 1")
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise RequestTooLong(
                f"{len(prompt_token_ids)} prompt tokens + {max_tokens} max_tokens > "
                f"max_model_len {self.max_model_len}"
            )
        lora_id = None
        if lora_name is not None:
            lora_id = self._lora_ids.setdefault(lora_name, len(self._lora_ids) + 1)
        self.scheduler.add(
            Request(
                rid,
                prompt_token_ids if isinstance(prompt_token_ids, np.ndarray) else list(prompt_token_ids),
                max_tokens,
                block_size=self.block_size,
                none_hash=self._none_hash,
                seed=self._seed_for(rid) if seed is None else seed,
                vocab_size=self.config.vocab_size,
                cache_salt=cache_salt,
                lora_name=lora_name,
                lora_id=lora_id,
                hash_blocks=self.config.cache.enable_prefix_caching,
                output_token_ids=None if output_token_ids is None else list(output_token_ids),
                hold=hold_blocks,
                remote_tokens=remote_prefill_tokens,
                mm_items=mm_items,
            )
        )

    def _seed_for(self, rid: RequestId) -> int:
        d = hashlib.blake2b(f"{self.config.seed}/{rid}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "little")

    def abort(self, request_id: str) -> bool:
        """Drop a request (client disconnect): its blocks are freed, it produces nothing more."""
        return self.scheduler.abort(RequestId(request_id))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepResult:
        outputs, stats, preempted = self.scheduler.schedule_and_run()
        if stats.num_scheduled:
            self.steps += 1
        return StepResult(
            outputs,
            self.timing.step_time(stats),
            stats.num_scheduled,
            stats.prefill_tokens,
            stats.decode_tokens,
            stats.loaded_tokens,
            preempted,
            stats.shared_loaded_tokens,
            stats.encoder_tokens,
        )

    def step_many(self, max_steps: int, max_duration_s: float) -> StepResult:
        """Up to ``max_steps`` steps as one when they would be alike (every running request decoding,
        nothing waiting, no preemption, no request finishing early), bounded by ``max_duration_s`` of
        modelled time; otherwise exactly ``step()``.  The evaluator uses it to skip through long decode
        phases: cache contents, events and timings equal those of the separate steps, except that the
        events come as one batch at the end and outputs carry several tokens."""
        sch = self.scheduler
        k = sch.decode_run_length(max_steps)
        if k < 2:
            return self.step()
        first = self.timing.step_time(
            BatchStats(
                num_scheduled=len(sch.running),
                decode_tokens=len(sch.running),
                attention_pairs=sum(r.num_tokens for r in sch.running),
                context_tokens=sum(r.num_tokens for r in sch.running),
            )
        )
        if first > 0 and max_duration_s != float("inf"):
            k = min(k, int(max_duration_s // first))
        if k < 2:
            return self.step()
        n = len(sch.running)
        outputs, base_ctx = sch.run_decodes(k)
        self.steps += k
        return StepResult(outputs, self.timing.decode_run_time(n, base_ctx, k), n, 0, n * k, 0, [])

    def take_events(self) -> list[KVEvent]:
        """This step's KV events, in order (empty when events are disabled)."""
        return self.pool.take_events()

    # ------------------------------------------------------------------ disaggregated prefill and decode
    def take_loads(self) -> list[KvLoad]:
        """Transfers that admissions since the last call asked for (decode legs): the shell pulls each
        from its prefill instance and calls ``finish_load``."""
        loads, self.scheduler.loads = self.scheduler.loads, []
        return loads

    def finish_load(self, request_id: str, ok: bool = True) -> bool:
        """A decode leg's transfer ended; it is scheduled again from the next step (``ok``: landed, its
        blocks are cached and announced; else it computes what did not arrive).  False: not loading."""
        return self.scheduler.finish_load(RequestId(request_id), ok)

    def held(self, request_id: str) -> tuple[list[BlockId], int] | None:
        """A finished prefill leg's blocks and computed tokens (what ``kv_transfer_params`` names as
        ``remote_block_ids`` and ``remote_num_tokens``); None once released, or if it never held any."""
        req = self.scheduler.held.get(RequestId(request_id))
        if req is None:
            return None
        return list(self.kv.blocks_of(req.request_id)), req.num_computed_tokens

    def release_held(self, request_id: str) -> bool:
        """Free a finished prefill leg's blocks.  False if it holds none (already released, or lost)."""
        return self.scheduler.release_held(RequestId(request_id))

    @property
    def num_loading(self) -> int:
        return len(self.scheduler.loading)

    @property
    def num_held(self) -> int:
        return len(self.scheduler.held)

    # ------------------------------------------------------------------ admin
    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """vLLM's ``/reset_prefix_cache``: fails while requests hold blocks, unless first preempted."""
        if reset_running_requests:
            self.scheduler.preempt_all()
        return self.kv.reset()

    def restart(self) -> list[RequestId]:
        """A crash and restart: every request is lost (returned, so the shell can fail them), the cache is
        empty, queued events are dropped and none is emitted.  (The publisher restarts its sequence.)"""
        lost = list(self.scheduler.requests)
        self._build()
        return lost

    # ------------------------------------------------------------------ introspection
    def metrics(self) -> EngineMetrics:
        c = self.scheduler.counters
        off = self.kv.offload
        return EngineMetrics(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting) + len(self.scheduler.holding),
            kv_cache_usage_perc=self.pool.usage(),
            prefix_cache_queries_total=c.prefix_cache_queries,
            prefix_cache_hits_total=c.prefix_cache_hits,
            external_prefix_cache_queries_total=c.external_queries,
            external_prefix_cache_hits_total=c.external_hits,
            num_preemptions_total=c.preemptions,
            prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.generation_tokens,
            request_success_total=c.finished,
            num_gpu_blocks=self.num_gpu_blocks,
            gpu_cached_blocks=self.pool.num_cached_blocks(),
            cpu_cached_blocks=len(off) if off is not None else 0,
        )

    def block_hashes(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None, lora_name: str | None = None
    ) -> list[BlockHash]:
        """This engine's hashes of every full block of ``token_ids`` (what its events would carry)."""
        return chain_hashes(
            token_ids,
            self.block_size,
            parent=self._none_hash,
            first_extra=extra_digest(block_extra_keys(lora_name, cache_salt or None, 0)),
            rest_extra=extra_digest(block_extra_keys(lora_name, None, 1)),
        )

    def cached_prefix_blocks(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None, lora_name: str | None = None
    ) -> int:
        """Leading full blocks of ``token_ids`` in the GPU cache now (no last-token cap): the ground truth a
        router's index should report for this engine."""
        hashes = self.block_hashes(token_ids, cache_salt=cache_salt, lora_name=lora_name)
        return self.pool.leading_cached(hashes)
