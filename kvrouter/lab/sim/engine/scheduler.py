"""Continuous batching with chunked prefill and recompute preemption, one call per engine step: vLLM v1's
``Scheduler.schedule`` and ``update_from_output`` (vllm/v1/core/sched/scheduler.py, FCFS).

Per step, within the token budget: (1) RUNNING requests in admission order, preempting the latest
admitted (back to the front of WAITING, recompute mode) when blocks run out; (2) if none was preempted,
WAITING requests FIFO up to ``max_num_seqs``, those back from a KV transfer (``holding``) first, each with
its prefix-cache hit (a CPU-tier hit loads asynchronously; ``reserve_full_sequence`` needs blocks for
the whole sequence); (3) every scheduled request advances, samples once its prompt is done, and finishes
at ``max_tokens`` (blocks freed tail first).

``cached_tokens`` is the computed-token count at first admission (vLLM's ``num_cached_tokens``).
Disaggregation (NIXL, pull mode): a prefill leg (``hold``) keeps its blocks in ``held`` until
``release_held``; a decode leg (``remote_tokens``) is admitted with its local hit, waits in ``loading``
while a ``KvLoad`` tells the shell what to pull, and ``finish_load`` puts it at the head of ``holding``
(landed: blocks cached, the last prompt token left to compute; failed: it computes the rest itself).
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import msgspec

from kvrouter.lab.sim.engine.encoder import EncoderCache
from kvrouter.lab.sim.engine.kvcache import KVCacheManager
from kvrouter.lab.sim.engine.request import Request, Status
from kvrouter.lab.sim.engine.types import BlockId, FinishReason
from kvrouter.lab.sim.errors import SimConfigError
from kvrouter.types import RequestId


class SchedulerConfig(msgspec.Struct, frozen=True):
    max_num_seqs: int = 256
    """Most requests running at once (vLLM ``--max-num-seqs``; 256 is its default on most GPUs)."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step, prefill and decode together (vLLM ``--max-num-batched-tokens``; 8192 is
    its default for the OpenAI server with chunked prefill)."""
    max_model_len: int | None = None
    """Longest prompt + output; None: the smaller of the profile's context and what the KV pool holds."""
    reserve_full_sequence: bool = True
    """Admit a waiting request only if its whole sequence fits in the free blocks (vLLM
    ``--scheduler-reserve-full-isl``, default on in 0.33), not merely its first prefill chunk."""

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise SimConfigError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise SimConfigError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SimConfigError("max_model_len must be >= 2")


class RequestOutput(msgspec.Struct, gc=False):
    """What one request produced in one step (only requests with news appear)."""

    request_id: RequestId
    new_token_ids: list[int]
    first_token: bool
    """The step produced the request's first output token (its TTFT ends here)."""
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache (``usage.prompt_tokens_details.cached_tokens``)."""
    cpu_loaded_tokens: int = 0
    """Of ``cached_tokens``, loaded from the CPU tier (the rest from GPU or ``shared_loaded_tokens``)."""
    shared_loaded_tokens: int = 0
    """Of ``cached_tokens``, loaded from a shared store."""


class KvLoad(msgspec.Struct, frozen=True, gc=False):
    """A decode leg admitted with a transfer to run: pull ``tokens`` prompt tokens after its first
    ``local_tokens`` (its own prefix-cache hit).  ``tokens`` 0: it caches its whole prompt; nothing to
    pull, but the prefill instance's held blocks are still to be released."""

    request_id: RequestId
    local_tokens: int
    tokens: int


class BatchStats(msgspec.Struct, gc=False):
    """What the step computed, for the timing model."""

    num_scheduled: int = 0
    prefill_tokens: int = 0
    """Tokens computed for prompts (and for recomputation after preemption); cache hits excluded."""
    decode_tokens: int = 0
    """Requests that decoded one token."""
    context_tokens: int = 0
    """KV tokens attention reads: every scheduled request's context after the step."""
    attention_pairs: int = 0
    """(query token, context token) pairs attention computes: its FLOPs grow with context."""
    loaded_tokens: int = 0
    """Tokens loaded from the CPU tier."""
    shared_loaded_tokens: int = 0
    """Tokens loaded from a shared store (``shared_store``)."""
    encoder_tokens: int = 0
    """Multimodal embeddings the encoder computed (items neither in the prefix hit nor in the encoder
    cache: ``encoder``)."""


class Counters(msgspec.Struct):
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0


class Scheduler:
    """Waiting queue, running list, and one ``schedule_and_run`` per step."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.holding: deque[Request] = deque()
        """Back from a KV transfer with their blocks held: scheduled before any waiting request (vLLM's
        ``kv_holding_waiting``), so a request preempted meanwhile cannot starve them of the blocks they
        would free."""
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self.counters = Counters()
        self.loading: dict[RequestId, tuple[Request, int]] = {}
        """Decode legs whose prompt is on its way, with their local hit in tokens."""
        self.loads: list[KvLoad] = []
        """Transfers to start, from admissions since the shell last took them."""
        self.held: dict[RequestId, Request] = {}
        """Finished prefill legs whose blocks stay allocated until released."""
        self.encoder_cache = EncoderCache(config.max_num_batched_tokens)
        """vLLM's default encoder cache holds ``max_num_batched_tokens`` embeddings."""
        self._cpu_loading: list[Request] = []
        """Admitted this step with a load from the CPU tier (also in ``loading``), in admission order."""

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: RequestId) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.LOADING:
            del self.loading[request_id]
        else:
            (self.holding if req in self.holding else self.waiting).remove(req)
        self.kv.finished(req, aborted=True)
        self.kv.free(req)
        req.status = Status.FINISHED
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.holding)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        if req.encoder is not None:
            req.encoder.reset()
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(req)

    def schedule_and_run(self) -> tuple[list[RequestOutput], BatchStats, list[RequestId]]:
        """One step.  Returns the outputs, what was computed, and the requests preempted."""
        kv = self.kv
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[RequestId] = []
        stats = BatchStats()
        running = self.running

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            ok = kv.allocate_slots(req, n)
            while not ok:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                ok = kv.allocate_slots(req, n)
            if not ok:
                break
            scheduled.append((req, n))
            budget -= n
            i += 1

        if not preempted:
            self._admit(scheduled, budget, stats)

        kv.end_schedule(scheduled)
        outputs = self._run(scheduled, stats)
        kv.end_step()
        self._cpu_loads_landed()
        return outputs, stats, preempted

    def _cpu_loads_landed(self) -> None:
        """The CPU tier's loads of this step are done (they take no longer than the step): their requests
        wait in ``holding``, blocks held, cached when next scheduled."""
        landed, self._cpu_loading = self._cpu_loading, []
        for req in landed:
            if self.loading.pop(req.request_id, None) is None:
                continue  # aborted meanwhile
            req.loaded = True
            req.status = Status.WAITING
            self.holding.append(req)

    def _admit(self, scheduled: list[tuple[Request, int]], budget: int, stats: BatchStats) -> None:
        kv, waiting, running = self.kv, self.waiting, self.running
        bs = kv.block_size
        c = self.counters
        skipped: list[Request] = []  # asked to look again next step; keep their places
        holding = self.holding
        while (holding or waiting) and budget > 0 and len(running) < self.config.max_num_seqs:
            req = holding[0] if holding else waiting[0]
            if req.loaded:
                # Back from a transfer: its blocks exist and its computed tokens are set.  Caching the
                # loaded blocks again is a no-op for a decode leg (cached when its load landed).
                kv.cache_loaded(req, req.num_computed_tokens)
                if req.num_computed_tokens >= req.num_tokens:
                    req.num_computed_tokens = req.num_tokens - 1  # vLLM computes the last token to sample
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if (
                    self.config.reserve_full_sequence
                    and not kv.whole_sequence_fits(req, kv.blocks_of(req.request_id), self.max_model_len)
                ) or not kv.allocate_slots(req, n):
                    break
                holding.popleft()
                running.append(req)
                req.loaded = False
                req.status = Status.RUNNING
                scheduled.append((req, n))
                budget -= n
                continue
            hits = kv.computed_blocks(req)
            if req.remote_tokens is not None:
                went = self._admit_loading(req, hits)
                if went == "loading":
                    continue
                if went == "blocked":
                    break
            split = kv.external_split(req, len(hits))
            if split is None:
                skipped.append(waiting.popleft())
                continue
            ext_cpu, ext_shared = split
            ext = ext_cpu + ext_shared
            computed = len(hits) * bs + ext
            # A load from the CPU tier is asynchronous (vLLM's connector): the request takes its blocks
            # now and is scheduled once the load has landed (next step), taking no budget meanwhile.
            n = 0 if ext_cpu else min(req.num_tokens - computed, budget)
            if self.config.reserve_full_sequence and not kv.whole_sequence_fits(
                req, hits, self.max_model_len
            ):
                break
            if not kv.allocate_slots(req, n, hits, ext, cache=not ext_cpu):
                break
            waiting.popleft()
            if req.num_preemptions:
                c.preempted_queries += req.num_tokens
                c.preempted_hits += len(hits) * bs
            else:
                c.prefix_cache_queries += req.num_tokens
                c.prefix_cache_hits += len(hits) * bs
                if kv.has_external:
                    c.external_queries += req.num_tokens - len(hits) * bs
                    c.external_hits += ext
            req.num_computed_tokens = computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
                req.cpu_loaded_tokens, req.shared_loaded_tokens = ext_cpu, ext_shared
            stats.loaded_tokens += ext_cpu
            stats.shared_loaded_tokens += ext_shared
            if kv.offload is not None:
                kv.offload.admitted(req, len(hits), ext_cpu)
            if ext_cpu:
                req.status = Status.LOADING
                self.loading[req.request_id] = (req, len(hits) * bs)
                self._cpu_loading.append(req)
                continue
            running.append(req)
            req.status = Status.RUNNING
            scheduled.append((req, n))
            budget -= n
        waiting.extendleft(reversed(skipped))

    def _admit_loading(self, req: Request, hits: list[BlockId]) -> Literal["loading", "local", "blocked"]:
        """Admit a decode leg whose prompt a prefill instance holds: ``loading`` (its transfer starts),
        ``blocked`` (its blocks do not fit: admission stops, as for any request), or ``local`` (its whole
        prompt is cached here: admitted as any other request)."""
        kv, bs = self.kv, self.kv.block_size
        local = len(hits) * bs
        remote, req.remote_tokens = req.remote_tokens or 0, None
        pull = max(0, min(remote, req.num_prompt_tokens) - local)
        if pull == 0:
            self.loads.append(KvLoad(req.request_id, local, 0))
            return "local"
        if (
            self.config.reserve_full_sequence and not kv.whole_sequence_fits(req, hits, self.max_model_len)
        ) or not kv.allocate_slots(req, 0, hits, pull, cache=False):
            req.remote_tokens = remote  # not admitted: it asks again next step
            return "blocked"
        self.waiting.popleft()
        c = self.counters
        c.prefix_cache_queries += req.num_tokens
        c.prefix_cache_hits += local
        req.status = Status.LOADING
        req.num_computed_tokens = local + pull
        req.num_cached_tokens = local + pull
        self.loading[req.request_id] = (req, local)
        self.loads.append(KvLoad(req.request_id, local, pull))
        return "loading"

    def finish_load(self, request_id: RequestId, ok: bool) -> bool:
        """A decode leg's transfer ended (``ok``: its blocks landed).  False if it is not loading (aborted,
        or lost in a restart)."""
        entry = self.loading.pop(request_id, None)
        if entry is None:
            return False
        req, local = entry
        if ok:
            self.kv.cache_loaded(req, req.num_computed_tokens)
        else:
            req.num_computed_tokens = local
        if req.num_computed_tokens >= req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1  # vLLM computes the last token to sample
        req.loaded = True
        req.status = Status.WAITING
        self.holding.appendleft(req)
        return True

    def release_held(self, request_id: RequestId) -> bool:
        """Free a finished prefill leg's blocks (read by its decode instance, or its lease expired)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def _finished(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.kv.finished(req)
        if req.hold:
            self.held[req.request_id] = req  # blocks kept until ``release_held``
        else:
            self.kv.free(req)
        req.status = Status.FINISHED
        self.counters.finished += 1

    def _run(self, scheduled: list[tuple[Request, int]], stats: BatchStats) -> list[RequestOutput]:
        """The model "forward": advance computed tokens, sample, finish."""
        outputs: list[RequestOutput] = []
        c = self.counters
        finished: list[Request] = []
        max_len = self.max_model_len
        decode = prefill = pairs = context = generated = encoded = 0
        for req, n in scheduled:
            before = req.num_computed_tokens
            after = before + n
            if req.encoder is not None:
                encoded += req.encoder.encode(before, after, self.encoder_cache)
            req.num_computed_tokens = after
            context += after
            if n == 1 and req.num_output_tokens and after == req.num_tokens:
                decode += 1
                pairs += after
            else:
                prefill += n
                pairs += n * before + n * (n + 1) // 2
            if after < req.num_tokens:
                continue  # a prefill chunk: no token yet
            tok = req.append_output_token()
            generated += 1
            n_out = req.num_output_tokens
            if n_out == 1:
                c.prompt_tokens += req.num_prompt_tokens
            done = n_out >= req.max_tokens or req.num_tokens >= max_len
            outputs.append(
                RequestOutput(
                    req.request_id,
                    [tok],
                    n_out == 1,
                    done,
                    "length" if done else None,
                    req.num_prompt_tokens,
                    n_out,
                    req.num_cached_tokens,
                    req.cpu_loaded_tokens,
                    req.shared_loaded_tokens,
                )
            )
            if done:
                finished.append(req)
        c.generation_tokens += generated
        stats.num_scheduled = len(scheduled)
        stats.decode_tokens = decode
        stats.prefill_tokens = prefill
        stats.attention_pairs = pairs
        stats.context_tokens = context
        stats.encoder_tokens = encoded
        if finished:
            for req in finished:
                self._finished(req)
            self.running[:] = [r for r in self.running if r.status is not Status.FINISHED]
        return outputs

    # ------------------------------------------------------------------ coalesced decode
    def decode_run_length(self, max_steps: int) -> int:
        """How many coming steps are alike and may run as one: every running request decoding (one token
        each), nothing waiting, the batch within the token budget, no request finishing before the last
        of them, and enough free blocks that no step would preempt.  0 when the next step is not such."""
        running = self.running
        if self.waiting or self.holding or not running or len(running) > self.config.max_num_batched_tokens:
            return 0
        k = max_steps
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or not req.num_output_tokens:
                return 0
            k = min(k, req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        if k < 2:
            return 0
        bs = self.kv.block_size
        while k >= 2:
            need = sum(
                max(0, -(-(r.num_tokens + k - 1) // bs) - len(self.kv.blocks_of(r.request_id)))
                for r in running
            )
            if need <= self.kv.pool.num_free:
                return k
            k //= 2
        return 0

    def run_decodes(self, k: int) -> tuple[list[RequestOutput], int]:
        """``k`` decode steps of the running batch at once (``decode_run_length`` said they are alike).

        Each request samples k tokens; its blocks are allocated and cached as the k steps would have
        (full blocks of known tokens only, in the same order per request), so cache contents and events
        are those of k separate steps, one batch of events instead of k.  Returns the outputs and the
        context tokens of the first step (step j has ``base + j * batch``), for the timing model."""
        kv = self.kv
        c = self.counters
        running = self.running
        base_ctx = sum(r.num_tokens for r in running)
        n = len(running)
        kv.end_schedule([(r, k) for r in running])
        outputs: list[RequestOutput] = []
        max_len = self.max_model_len
        for req in running:
            new = req.append_output_tokens(k - 1)
            ok = kv.allocate_slots(req, k)
            assert ok, "decode_run_length checked the free blocks"
            req.num_computed_tokens += k
            new.append(req.append_output_token())
            n_out = req.num_output_tokens
            done = n_out >= req.max_tokens or req.num_tokens >= max_len
            outputs.append(
                RequestOutput(
                    req.request_id,
                    new,
                    False,
                    done,
                    "length" if done else None,
                    req.num_prompt_tokens,
                    n_out,
                    req.num_cached_tokens,
                    req.cpu_loaded_tokens,
                    req.shared_loaded_tokens,
                )
            )
        c.generation_tokens += k * n
        finished = [running[i] for i, o in enumerate(outputs) if o.finished]
        for req in finished:
            self._finished(req)
        if finished:
            self.running[:] = [r for r in running if r.status is not Status.FINISHED]
        kv.end_step()
        return outputs, base_ctx

    def preempt_all(self) -> list[RequestId]:
        """Preempt every running request (``reset_prefix_cache(reset_running_requests=True)``)."""
        ids: list[RequestId] = []
        while self.running:
            req = self.running.pop()
            self._preempt(req)
            ids.append(req.request_id)
        return ids
