"""One simulated vLLM instance without its HTTP server: data-parallel ranks, tokenizer, faults, requests.

::

                     ┌────────────── SimInstance ──────────────┐
    OpenAI handler ─▶│ tokenizer (shared)   pick_rank(header)  │
     api_server() ──▶│ FrontEnd (vLLM's API server, modelled)  │
                     │ submit() ──▶ InFlight ◀── outputs ──────┼── EngineRank 0: Engine + EventPublisher
                     │ faults, crash(), recover()              │   EngineRank 1: ... (ports + rank)
                     └─────────────────────────────────────────┘

A request is pinned to a rank by ``X-data-parallel-rank`` (how the gateway addresses ranks); without it,
the rank with the lowest waiting x 4 + running wins, as vLLM's internal data-parallel balancer scores
engines.  Ties go round robin.

Before ``submit`` a handler waits out ``api_server()``: the time vLLM's API server would take to get the
request to its engine core (``engine.frontend.FrontEnd``, counted from the request's arrival, so the real
parsing and tokenization done here count towards it); ``InFlight.next`` holds each output for the way back
(the first token's detokenization, the streamed chunk).  Both are the profile's costs divided by the
engine's ``speed``, like its steps.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import zmq.asyncio

from indexer.encode import RELEASES
from kvrouter.api.errors import BadRequest, NotFound, ServiceUnavailable
from kvrouter.api.kv_transfer import DecodeRequestParams
from kvrouter.api.requests import too_long
from kvrouter.lab.sim.engine.engine import Engine, EngineConfig
from kvrouter.lab.sim.engine.frontend import FrontEnd
from kvrouter.lab.sim.engine.scheduler import RequestOutput
from kvrouter.lab.sim.engine.shared_store import SharedStore
from kvrouter.lab.sim.engine.timing import PromptApi
from kvrouter.lab.sim.errors import RequestRejected, SimConfigError, SimError
from kvrouter.lab.sim.server import env
from kvrouter.lab.sim.server.answers import AnswerVocab
from kvrouter.lab.sim.server.faults import FaultConfig, FaultState, FaultStatus, FaultUpdate
from kvrouter.lab.sim.server.kv_transfer import KvTransferAgent, KvTransferConfig
from kvrouter.lab.sim.server.prom import RequestStats
from kvrouter.lab.sim.server.publisher import EventPublisher, PublisherConfig, topic_for
from kvrouter.lab.sim.server.rank import Crashed, EngineRank, Stamped
from kvrouter.lab.sim.server.stored import ResponseStore
from kvrouter.types import Role
from tokenizer_cache import CachedTokenizer
from tokenizer_cache.cached import Encoded

DEFAULT_PROFILE = "qwen3-32b-2xh100"
"""Default timing profile of ``kvrouter sim``: Qwen3-32B on 2 x H100 in real time.  Its steps are long
enough that eight busy instances fit on two cores, and a cached prefix visibly cuts time to first token."""


class SimInstanceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = "sim-0"
    """Instance name (the fleet file's ``name``; the topic's ``<instance>`` in bind mode)."""
    host: str = "127.0.0.1"
    """Interface of the HTTP server and the ZeroMQ sockets."""
    port: int = 8000
    """HTTP port (0: any free port)."""
    events_port: int | None = 5557
    """PUB port of rank 0 (rank r: + r); None: no KV events."""
    replay_port: int | None = 5558
    """Replay ROUTER port of rank 0 (rank r: + r); None: no replay."""
    dp_size: int = 1
    """Data-parallel ranks: one engine and one publisher each."""
    model: str = "sim-model"
    """Served model name (``/v1/models``; requests naming another model get 404)."""
    lora_names: list[str] = []
    """LoRA adapters served from the start besides the base model (vLLM's ``--lora-modules``); their KV
    blocks are keyed apart."""
    runtime_lora: bool | None = None
    """Serve /v1/load_lora_adapter and /v1/unload_lora_adapter; None: as ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
    says when the instance is built."""
    responses_store: bool | None = None
    """Store Responses API answers (``previous_response_id``, GET, cancel); None: as
    ``VLLM_ENABLE_RESPONSES_API_STORE`` says when the instance is built."""
    pooling: bool = False
    """Also serve the pooling routes (embeddings, pooling, classify, score, rerank) and transcription, as a
    pooling or ASR model would (a generative vLLM model answers them 404)."""
    engine: EngineConfig = EngineConfig(profile=DEFAULT_PROFILE)
    """Engine model of every rank (profile, speed, KV capacity, batching)."""
    release: str = "0.33.0"
    """vLLM release whose KV-event wire format is published."""
    topic: str = ""
    """Frame 0 of every event message (in bind mode, default ``kv@<name>@<model>``)."""
    connect_endpoint: str | None = None
    """Bind mode: every PUB connects to this endpoint (the indexer's bound SUB) instead of binding
    ``events_port``, as vLLM does when its endpoint names a host rather than ``*``."""
    answer_tokens: int = 256
    """Mean length of an answer ending with EOS (see ``answers``); 0: answers always run to max_tokens."""
    seed: int = 0
    """Seed of the answers of requests that bring no ``seed``, and of the drop faults."""
    faults: FaultConfig = FaultConfig()
    """Faults at start."""
    role: Role = "both"
    """Its role in a disaggregated fleet, as written to the fleet file (the instance itself serves any
    leg it is sent, as a vLLM instance with ``kv_role: kv_both`` does)."""
    kv_transfer: KvTransferConfig = KvTransferConfig()
    """The simulated NIXL connector: prefill legs' leases, decode legs' pulls."""

    def validate(self) -> None:
        if not self.name or "@" in self.name:
            raise SimConfigError(f"invalid instance name {self.name!r}")
        if self.dp_size < 1:
            raise SimConfigError("dp_size must be >= 1")
        if self.release not in RELEASES:
            raise SimConfigError(f"unknown vLLM release {self.release!r}; known: {', '.join(RELEASES)}")
        if self.answer_tokens < 0:
            raise SimConfigError("answer_tokens must be >= 0")
        if self.replay_port is not None and self.events_port is None and self.connect_endpoint is None:
            raise SimConfigError("replay needs events")
        if self.connect_endpoint is not None and self.dp_size > 1:
            # vLLM offsets the endpoint by the rank even when connecting; an indexer binds one port.
            raise SimConfigError("bind mode (connect_endpoint) supports dp_size 1 only")
        self.engine.validate()
        self.faults.validate()
        self.kv_transfer.validate()

    @property
    def events_endpoint(self) -> str | None:
        """Where subscribers connect (None in bind mode: the publishers connect out)."""
        if self.connect_endpoint is not None or self.events_port is None:
            return None
        return f"tcp://{self.host}:{self.events_port}"

    def publisher_config(self, rank: int) -> PublisherConfig | None:
        if self.connect_endpoint is not None:
            endpoint, connect = self.connect_endpoint, True
            topic = self.topic or topic_for(self.name, self.model)
        elif self.events_port is not None:
            endpoint, connect, topic = f"tcp://{self.host}:{self.events_port}", False, self.topic
        else:
            return None
        return PublisherConfig(
            endpoint=endpoint,
            replay_endpoint=self.replay_endpoint,
            connect=connect,
            topic=topic,
            release=self.release,
            dp_rank=rank,
            drop_rate=self.faults.drop_rate,
            seed=self.seed * 1000 + rank,
        )

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://{self.host}:{self.replay_port}"

    @property
    def served_models(self) -> list[str]:
        return [self.model, *self.lora_names]


class EngineCrashed(SimError):
    """The instance crashed while the request was in it (the shell cuts the client's connection)."""

    reason = "crashed"


class InFlight:
    """One request inside a rank: its output channel and what the HTTP shell reports about it."""

    __slots__ = (
        "_due",
        "_last_t",
        "arrival",
        "cached_override",
        "cached_tokens",
        "channel",
        "done",
        "frontend",
        "hold",
        "leased",
        "num_output",
        "num_prompt",
        "rank",
        "request_id",
        "stats",
        "stops",
    )

    def __init__(
        self,
        request_id: str,
        rank: EngineRank,
        channel: asyncio.Queue[Stamped],
        num_prompt: int,
        stops: bool,
        stats: RequestStats,
        frontend: FrontEnd,
        *,
        hold: bool = False,
        cached_override: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.rank = rank
        self.channel = channel
        self.num_prompt = num_prompt
        self.stops = stops
        self.stats = stats
        self.frontend = frontend
        self.arrival = self._last_t = time.monotonic()
        self._due = 0.0
        self.num_output = 0
        self.cached_tokens = 0
        self.done = False
        self.hold = hold
        """A prefill leg: its blocks outlive it, under a lease once its answer names them."""
        self.leased = False
        self.cached_override = cached_override
        """A decode leg reports its prefill instance's cached tokens as its own (vLLM 0.33)."""

    async def next(self) -> RequestOutput:
        """The next step's output of this request, once its way back through the API server has passed
        (outputs in order: none overtakes the one before).  Raises ``EngineCrashed``."""
        released, item = await self.channel.get()
        if isinstance(item, Crashed):
            self.done = True  # nothing to abort: the engine that held it is gone
            raise EngineCrashed(self.request_id)
        self._due = max(self._due, released + self.frontend.delay(item.first_token, self.num_prompt))
        wait = self._due - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        now = time.monotonic()
        if item.first_token:
            self.stats.ttft.observe(now - self.arrival)
        else:
            self.stats.itl.observe(now - self._last_t)
        self._last_t = now
        self.num_output = item.num_output_tokens
        self.cached_tokens = item.cached_tokens if self.cached_override is None else self.cached_override
        if item.finished:
            self.done = True
            self.stats.finished[self.finish_reason] += 1
            self.stats.e2e.observe(now - self.arrival)
        return item

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stops else "length"

    def close(self) -> None:
        """Called when the handler ends: a request still running was abandoned by its client.  A prefill
        leg whose answer never named its blocks frees them (nobody can read them)."""
        if not self.done:
            self.done = True
            self.rank.abort(self.request_id)
            self.stats.finished["abort"] += 1
        if self.hold and not self.leased:
            self.rank.engine.release_held(self.request_id)


class SimInstance:
    """Ranks, faults and request admission of one simulated instance (single event loop)."""

    def __init__(
        self,
        config: SimInstanceConfig,
        tokenizer: CachedTokenizer,
        *,
        vocab: AnswerVocab | None = None,
        zmq_ctx: zmq.asyncio.Context | None = None,
        chat_template: str | None = None,
        shared: SharedStore | None = None,
    ) -> None:
        """``chat_template``: the template the tokenizer applies beyond its own (its facts decide how
        Anthropic requests are converted, as vLLM probes them).  ``shared``: a store the ranks attach with
        other instances' (``sim.engine.shared_store``)."""
        config.validate()
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer.hf_tokenizer, "chat_template", None)
        self.adapters: dict[str, str] = {name: name for name in config.lora_names}
        """Loaded LoRA adapters: name -> path (static ones: their name)."""
        self.runtime_lora = env.runtime_lora() if config.runtime_lora is None else config.runtime_lora
        self.store_responses = (
            env.responses_store() if config.responses_store is None else config.responses_store
        )
        self.responses = ResponseStore()
        self.background: dict[str, asyncio.Task[None]] = {}
        self.audio_bytes_seen = 0
        """Bytes of the audio upload being read (so far): a test sees an upload arrive while it is sent."""
        self.trace_contexts: deque[str | None] = deque(maxlen=1024)
        """The W3C ``traceparent`` of each generation request received (None: none sent), newest last:
        the context vLLM's own spans (``--otlp-traces-endpoint``) would join."""
        self.anthropic_facts: tuple[bool, str] | None = None
        """How this template takes Anthropic requests (inline system merged, disabled-thinking effort),
        probed on the first one as vLLM probes at start."""
        self.vocab = vocab or AnswerVocab.from_tokenizer(tokenizer)
        self.faults = FaultState(config.faults)
        self.ranks: list[EngineRank] = []
        for r in range(config.dp_size):
            pcfg = config.publisher_config(r)
            pub = None if pcfg is None else EventPublisher(pcfg, ctx=zmq_ctx)
            self.ranks.append(EngineRank(r, Engine(config.engine, shared=shared), pub, self.faults))
        self.stats = [RequestStats() for _ in self.ranks]
        self.max_model_len = self.ranks[0].engine.max_model_len
        # vLLM runs one API server per data-parallel rank by default, all taking requests for any rank.
        costs = self.ranks[0].engine.profile.frontend
        self.frontend = FrontEnd(
            costs, speed=config.engine.speed, workers=costs.renderer_workers * config.dp_size
        )
        self.transfers = KvTransferAgent(
            config.name,
            config.host,
            self.ranks,
            self.faults,
            config.kv_transfer,
            num_gpus=self.ranks[0].engine.profile.num_gpus,
        )
        for rank in self.ranks:
            rank.on_loads = self.transfers.on_loads
        self.created = int(time.time())
        self._rng = random.Random(f"{config.seed}/{config.name}")
        self._tiebreak = itertools.count()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for rank in self.ranks:
            if rank.publisher is not None:
                await rank.publisher.start()
            rank.start()

    async def stop(self) -> None:
        await self.transfers.stop()
        for task in list(self.background.values()):
            task.cancel()
        for rank in self.ranks:
            await rank.stop()
            if rank.publisher is not None:
                await rank.publisher.stop()

    async def crash(self) -> int:
        """Every engine dies (requests lost, caches empty) and every publisher closes (sequence back to 0
        on recovery).  Returns the number of requests lost."""
        self.faults.crashed = True
        self.faults.crashes += 1
        lost = 0
        self.transfers.reset()
        for rank in self.ranks:
            lost += rank.crash()
            if rank.publisher is not None:
                await rank.publisher.crash()
        self.stats = [RequestStats() for _ in self.ranks]
        self.responses.clear()  # process memory: gone with the process
        for task in self.background.values():
            task.cancel()
        self.adapters = {name: name for name in self.config.lora_names}
        return lost

    async def recover(self) -> None:
        """Coming back after a crash: publishers reopen (from sequence 0).  Requests are admitted again
        only after ``resume()`` (the server calls it once its port is open again)."""
        for rank in self.ranks:
            if rank.publisher is not None:
                await rank.publisher.restart()
                self._apply_publisher_faults(rank.publisher)

    def resume(self) -> None:
        self.faults.crashed = False

    # ------------------------------------------------------------------ requests
    def pick_rank(self, header: str | None) -> EngineRank:
        if header is not None:
            try:
                r: int | None = int(header)
            except ValueError:
                r = None  # vLLM ignores a header it cannot parse
            if r is not None:
                if not 0 <= r < len(self.ranks):
                    raise BadRequest(
                        f"data_parallel_rank {r} is out of range [0, {len(self.ranks)}).",
                        param="X-data-parallel-rank",
                    )
                return self.ranks[r]
        if len(self.ranks) == 1:
            return self.ranks[0]
        turn = next(self._tiebreak)
        n = len(self.ranks)
        return min((self.ranks[(turn + i) % n] for i in range(n)), key=EngineRank.load)

    async def api_server(self, arrived: float, num_prompt_tokens: int, api: PromptApi) -> None:
        """Wait until vLLM's API server would have handed the request that reached it at ``arrived``
        (``time.monotonic()``) to its engine core: HTTP, the renderer queue, the hop (``FrontEnd``)."""
        wait = self.frontend.arrive(arrived, num_prompt_tokens, api) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    def lora_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model).  Raises ``NotFound``."""
        if model is None or model == self.config.model:
            return None
        if model in self.adapters:
            return model
        raise NotFound(f"The model `{model}` does not exist.", param="model")

    def submit(
        self,
        prefix: str,
        prompt: Sequence[int],
        max_tokens: int | None,
        *,
        rank_header: str | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
        hold: bool = False,
        pull: DecodeRequestParams | None = None,
        mm_items: Sequence[tuple[str, int, int]] = (),
    ) -> InFlight:
        """Admit a request into a rank.  Raises ``BadRequest`` (vLLM would refuse it) or
        ``ServiceUnavailable`` (crashed).  ``request_id``: the client's ``X-Request-Id`` (vLLM's base of
        the request's id); ``hold``: a prefill leg; ``pull``: a decode leg's transfer."""
        if self.faults.crashed:
            raise ServiceUnavailable("the engine is down")
        rank = self.pick_rank(rank_header)
        if not prompt:
            raise BadRequest("The decoder prompt cannot be empty", param="prompt")
        err = too_long(self.max_model_len, len(prompt), max_tokens)
        if err is not None:
            raise err
        limit = self.max_model_len - len(prompt) if max_tokens is None else max_tokens
        plan = self.vocab.plan(
            self._rng.getrandbits(64) if seed is None else seed,
            limit,
            answer_tokens=self.config.answer_tokens,
            ignore_eos=ignore_eos,
        )
        rid = f"{prefix}-{request_id or uuid.uuid4().hex}"
        if rid in rank.engine.scheduler.requests or rank.engine.held(rid) is not None:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"  # an id already in use here stays unique
        try:
            channel = rank.submit(
                rid,
                prompt,
                len(plan.token_ids),
                output_token_ids=plan.token_ids,
                cache_salt=cache_salt,
                lora_name=lora_name,
                hold_blocks=hold,
                remote_prefill_tokens=len(prompt) if pull is not None else None,
                mm_items=mm_items,
            )
        except RequestRejected as e:
            raise BadRequest(str(e)) from None
        if pull is not None:
            self.transfers.expect(rid, pull)
        cached = pull.remote_prefill_cached_tokens if pull is not None else None
        return InFlight(
            rid,
            rank,
            channel,
            len(prompt),
            plan.stops,
            self.stats[rank.rank],
            self.frontend,
            hold=hold,
            cached_override=cached,
        )

    def lease(self, req: InFlight) -> dict[str, Any] | None:
        """A finished prefill leg leases the blocks it holds: the ``kv_transfer_params`` its answer names
        them by (None for any other request, or a leg that holds none)."""
        if not req.hold:
            return None
        kv = self.transfers.held(req.rank, req.request_id, req.cached_tokens)
        req.leased = kv is not None
        return kv

    # ------------------------------------------------------------------ admin
    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        ok = True
        for rank in self.ranks:
            # AllBlocksCleared goes out with the next step's batch (vLLM publishes only from a step)
            ok = rank.engine.reset_prefix_cache(reset_running_requests=reset_running_requests) and ok
        return ok

    async def encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        """``encode_chat_ex``'s token ids."""
        return (await self.encode_chat_ex(body)).tokens

    async def encode_chat_ex(self, body: Mapping[str, Any]) -> Encoded:
        """A chat request's prompt tokens as this instance renders it (vLLM 0.33's whole chat path, the
        tokenizer cache's ``aencode_chat_request``).  Under ``render_fault`` it renders as an instance
        started with another template would: a system line the fleet's template never writes comes first,
        so every token id after the first few differs from the router's."""
        if self.faults.render_fault:
            body = {
                **body,
                "messages": [
                    {"role": "system", "content": "[rendered by another template]"},
                    *body["messages"],
                ],
            }
        return await self.tokenizer.aencode_chat_request(body)

    def apply_faults(self, update: FaultUpdate) -> FaultStatus:
        """Every knob of ``update`` except ``crash`` (the server's: it owns the port)."""
        update.validate()
        f = self.faults
        if update.drop_rate is not None:
            f.drop_rate = update.drop_rate
        if update.dead is not None:
            f.dead = update.dead
        if update.latency_s is not None:
            f.latency_s = update.latency_s
        if update.slowdown is not None:
            f.slowdown = update.slowdown
        if update.stall_s is not None:
            f.stall(update.stall_s)
        if update.stall_events is not None:
            f.stall_events = update.stall_events
        if update.mute_replay is not None:
            f.mute_replay = update.mute_replay
        if update.render_fault is not None:
            f.render_fault = update.render_fault
        for rank in self.ranks:
            if rank.publisher is not None:
                self._apply_publisher_faults(rank.publisher)
                if update.corrupt_next:
                    rank.publisher.corrupt_next(update.corrupt_next)
        return f.status()

    def _apply_publisher_faults(self, pub: EventPublisher) -> None:
        f = self.faults
        pub.set_drop_rate(f.drop_rate)
        pub.replay_muted = f.mute_replay
        if f.stall_events and not pub.stalled:
            pub.stall()
        elif not f.stall_events and pub.stalled:
            pub.resume()
