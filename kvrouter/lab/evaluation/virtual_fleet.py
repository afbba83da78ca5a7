"""A fleet of simulated engines in virtual time, routed by the gateway's own Router and Indexer.

::

      arrival ──Router.route──▶ dispatch ─(net latency)─▶ FrontEnd.arrive ─(API server)─▶ Engine.add_request
                     ▲                                                                         │ step()
                     │ apply_payload ◀─(event delay)─ payload ◀──────────────────────────────┤ take_events()
                     │ first_token / finished ◀─(net latency + way back)───────────────────────┘ outputs

Nothing here routes or models an engine: routing is ``kvrouter.routing.Router`` over ``indexer.Indexer``
(fed the engines' events as real vLLM payloads), every engine is ``kvrouter.lab.sim.engine.engine.Engine``
behind its ``FrontEnd``, requests at every instance's cap wait in ``kvrouter.flows.FlowQueue``, and a
fleet with prefill/decode ``roles`` is planned by ``routing.disagg.DisaggPlanner``, as in the gateway.
This module only keeps the clock: a heap of timed actions.  Inter-token latency is recorded per request
from the engine steps' ends.  How a split request and the flow queue run here: docs/simulator.md.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from functools import partial

import msgspec

from indexer import Indexer, SourceKey
from indexer.hashing import I64Array
from kvrouter.api.requests import prefix_text as api_prefix_text
from kvrouter.flows import Fairness, Flow, FlowQueue, Refused, Waiter, WorkMeter, request_cost
from kvrouter.lab.sim.engine.engine import CacheConfig, Engine, EngineConfig
from kvrouter.lab.sim.engine.frontend import FrontEnd
from kvrouter.lab.sim.engine.payload import PayloadWriter
from kvrouter.lab.sim.engine.scheduler import SchedulerConfig
from kvrouter.lab.sim.engine.shared_store import SharedStore
from kvrouter.lab.sim.engine.tiers import tiers_config
from kvrouter.lab.sim.engine.timing import NO_FRONTEND, PROMPT_APIS, PromptApi, get_profile
from kvrouter.lab.sim.errors import RequestRejected, SimConfigError
from kvrouter.lab.workloads.blocks import BlockContentCache
from kvrouter.lab.workloads.spec import Request, Segment, TokenSpace, Workload
from kvrouter.lab.workloads.tokens import output_tokens, prompt_tokens, segments_tokens
from kvrouter.routing import READS_INDEX, DisaggPlanner, DisaggSettings, RouteInput, Router, RouterConfig
from kvrouter.routing.router import Target, route_input
from kvrouter.routing.tier_value import tier_values
from kvrouter.types import InstanceId, RequestId, Role, TargetKey, leg_id


class FleetSimConfig(msgspec.Struct, frozen=True):
    instances: int = 8
    profile: str = "llama-3.1-70b-8xh100"
    profiles: list[str] = []
    """Instance i's timing profile in a mixed fleet (empty: every instance ``profile``)."""
    capacity_blocks: int | None = None
    """KV blocks per instance (None: the profile's)."""
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    cpu_offload_blocks: int = 0
    """Each instance's own CPU tier (L1), in blocks (0: none)."""
    shared_l2_blocks: int = 0
    """A store every instance attaches (L2: HyperPod's Redis/tiered storage, an LMCache server), in blocks
    (0: none).  Written through from the instances' offloads; announces no removals (``shared_store``)."""
    shared_l2_gbps: float = 12.5
    """Load bandwidth from the L2 into an instance, GB/s (the router's fleet file says the same)."""
    event_delay_s: float = 0.005
    """Engine step end -> the router's index has the step's events (ZeroMQ + decode)."""
    event_loss: float = 0.0
    """Fraction of event batches lost on the way (no replay: the router sees gaps and stops trusting)."""
    net_latency_s: float = 0.0005
    """One way, router <-> engine."""
    release: str = "0.33.0"
    events: bool = True
    """Publish KV events to the router's index.  Policies that never read the index (prefix-hash and the
    baselines) route identically without them, so ``kvrouter eval`` turns them off there to save time."""
    queue_size: int = 100_000
    fairness: Fairness = "fifo"
    """How waiting requests are ordered (``kvrouter.flows.config.FAIRNESS``)."""
    priorities: dict[str, int] = {}
    """Priority per tenant (``Request.tenant``; others 0)."""
    sample_interval_s: float = 1.0
    seed: int = 0
    frontend: bool = True
    """Model vLLM's API server per request (the profile's ``FrontendCosts``: HTTP, rendering and
    tokenization queued on its worker, the hop to the engine core, detokenization and the streamed chunk
    on the way back).  False: requests reach the engine at dispatch + ``net_latency_s`` and outputs leave
    at the step's end (the engine alone)."""
    prompt_api: PromptApi = "chat"
    """How requests that carry neither messages nor text (token segments: synthetic workloads and traces,
    which stand for users' chats) are taken to reach vLLM: ``chat``, ``completion`` (text) or
    ``token_ids`` (no tokenization).  Requests with messages are chat, with text completion."""

    roles: list[Role] = []
    """Instance i's role in a disaggregated fleet (empty: every instance ``both``, aggregated)."""
    kv_bandwidth_bytes_per_s: float = 50e9
    """KV-cache transfer bandwidth into a decode instance (400 Gb/s RDMA)."""
    kv_latency_s: float = 0.002
    """Fixed cost of one KV transfer (handshake, notification)."""

    def instance_profiles(self) -> list[str]:
        """Each instance's timing profile."""
        return list(self.profiles) or [self.profile] * self.instances

    def validate(self) -> None:
        if self.profiles and len(self.profiles) != self.instances:
            raise SimConfigError(f"{len(self.profiles)} profiles for {self.instances} instances")
        if self.shared_l2_blocks < 0 or self.shared_l2_gbps <= 0:
            raise SimConfigError("shared_l2_blocks must be >= 0 and shared_l2_gbps positive")
        if self.prompt_api not in PROMPT_APIS:
            raise SimConfigError(f"prompt_api must be one of {', '.join(PROMPT_APIS)}")


class RequestRecord(msgspec.Struct, gc=False):
    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 0
    instance: str | None = None
    dispatch_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    cpu_tokens: int = 0
    """Of ``cached_tokens``, loaded from the instance's CPU tier ..."""
    l2_tokens: int = 0
    """... and from the shared L2 (the rest were GPU hits)."""
    predicted_cached_tokens: int = 0
    rejected: bool = False
    prefill_instance: str | None = None
    """A split request's prefill instance (its ``instance`` decodes)."""
    pd_reason: str | None = None
    """Disaggregated fleets: the plan's reason (remote_prefill when split)."""
    transfer_tokens: int = 0
    """Prompt tokens pulled from the prefill instance."""
    itl_sum_s: float = 0.0
    """Time from the first token to the last (the inter-token gaps summed)."""
    itl_max_s: float = 0.0
    """The longest gap between two consecutive tokens (a decode stalled behind a prefill shows here)."""


class FleetRun(msgspec.Struct):
    records: list[RequestRecord]
    load_times: list[float]
    load_samples: list[list[int]]
    """In flight per instance at each sample time."""
    work_tokens: list[int]
    """Tokens each instance computed (prefill + decode)."""
    index_errors: dict[str, int]
    makespan_s: float
    busy_s: list[float] = []
    """Seconds each instance spent in engine steps (its GPUs busy): the fleet's compute cost."""
    encoder_tokens: list[int] = []
    """Multimodal embeddings each instance's encoder computed (items missed by the prefix and encoder
    caches)."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(self) -> None:
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()

    def pending(self) -> int:
        return len(self._heap)


class VirtualFleet:
    """Runs one workload under one router configuration."""

    def __init__(
        self,
        workload: Workload,
        cfg: FleetSimConfig,
        router_cfg: RouterConfig,
        *,
        hashes: BlockContentCache | None = None,
        progress: Callable[[int], None] | None = None,
        pooled_of: int = 1,
        disagg: DisaggSettings | None = None,
    ) -> None:
        """``pooled_of`` > 1 builds the pooled-cache bound: one engine with that many instances' capacity
        and speed (same batch limits scaled by the caller)."""
        cfg.validate()
        self.workload = workload
        self.cfg = cfg
        self.clock = _Clock()
        profile = get_profile(cfg.profile)
        # The router's view of the tiers is the fleet file's: the L2 declared as a shared store, every
        # tier valued from the simulated hardware's own figures.
        self.tiers = tiers_config(profile, cfg.shared_l2_blocks, cfg.shared_l2_gbps)
        self.indexer = Indexer(cfg.block_size, shared=self.tiers.shared)
        router_cfg = msgspec.structs.replace(router_cfg, tiers=tier_values(self.tiers))
        self.router = Router(self.indexer, router_cfg)
        self.saturation = router_cfg.saturation
        self.isolation = router_cfg.isolation
        self.meter = WorkMeter(router_cfg.isolation.half_life_s)
        self.prefix_length = router_cfg.settings.prefix_hash.prefix_length
        # Without events the index holds only speculative entries, which no policy outside READS_INDEX
        # reads (they rank by load, turn or hash): such runs skip hashing, lookups and speculative entries,
        # and route exactly as with them.
        self.lookups = cfg.events or bool(
            READS_INDEX & {router_cfg.policy, *router_cfg.model_policies.values()}
        )
        self.hashes = hashes or BlockContentCache(workload.token_space, cfg.block_size)
        self.progress = progress
        self.rng = random.Random(cfg.seed)
        capacity = cfg.capacity_blocks
        if capacity is None and pooled_of > 1:
            capacity = profile.kv_capacity_blocks(cfg.block_size) * pooled_of
        ecfg = EngineConfig(
            profile=profile.name,
            speed=float(pooled_of),
            cache=CacheConfig(
                block_size=cfg.block_size,
                enable_kv_cache_events=cfg.events,
                num_gpu_blocks=capacity,
                cpu_offload_blocks=cfg.cpu_offload_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens
            ),
            seed=cfg.seed,
        )
        self.names = [f"sim-{i}" for i in range(cfg.instances)]
        self.l2 = (
            SharedStore(cfg.shared_l2_blocks, cfg.block_size, cfg.shared_l2_gbps * 1e9)
            if cfg.shared_l2_blocks and pooled_of == 1
            else None
        )
        self.profiles = [get_profile(n) for n in cfg.instance_profiles()]
        self.engines = [
            Engine(msgspec.structs.replace(ecfg, profile=p.name), shared=self.l2) for p in self.profiles
        ]
        # A pooled engine stands for pooled_of instances: as many API servers, each as fast as one (its
        # engine's speed-up is throughput, not a shorter path for each request).
        self.frontends = [
            FrontEnd(c, workers=c.renderer_workers * pooled_of)
            for c in (p.frontend if cfg.frontend else NO_FRONTEND for p in self.profiles)
        ]
        self._first_out: dict[str, float] = {}
        """When each request's first token reaches the router (its later outputs cannot come before)."""
        self.writers = [PayloadWriter(cfg.release) for _ in self.names]
        self.seqs = [0] * cfg.instances
        self.busy = [False] * cfg.instances
        self.work = [0] * cfg.instances
        self.busy_s = [0.0] * cfg.instances
        self.encoder_tokens = [0] * cfg.instances
        if cfg.roles and len(cfg.roles) != cfg.instances:
            raise ValueError(f"{len(cfg.roles)} roles for {cfg.instances} instances")
        roles = cfg.roles or ["both"] * cfg.instances
        self.targets = [Target(InstanceId(n), role=r) for n, r in zip(self.names, roles)]
        self.index = {n: i for i, n in enumerate(self.names)}
        planner = DisaggPlanner(self.router, disagg)
        self.planner = planner if planner.applies(self.targets) else None
        if self.planner is not None:
            self.lookups = True  # the decode policy reads the index
        self.legs: dict[str, str] = {}
        """Prefill legs in an engine: engine request id -> the request's id."""
        self.pulls: dict[str, tuple[int, int]] = {}
        """Split requests: id -> (prefill engine, decode engine)."""
        self.last_out: dict[str, float] = {}
        for n in self.names:
            self.indexer.register(SourceKey(n, 0))
        self.records: dict[str, RequestRecord] = {}
        self.by_id = {r.id: r for r in workload.requests}
        self.inputs: dict[str, RouteInput] = {}
        self.queue: FlowQueue[str] = FlowQueue(cfg.queue_size, cfg.fairness)
        self._tickets = itertools.count()
        self.charged: dict[str, float] = {}
        """Tokens charged per tenant at admission in the work measure (uncached prompt + output)."""
        self.dependents: dict[str, list[Request]] = {}
        self.finished = 0
        self.load_times: list[float] = []
        self.load_samples: list[list[int]] = []
        self._closed_next = 0
        self._last_finish = 0.0
        # Times at which the router may hand some engine a new request (arrivals, finishes that free a
        # slot, dispatches on their way): an engine may coalesce decode steps only up to the next one.
        self._activity: list[float] = []

    # ------------------------------------------------------------------ running
    def run(self) -> FleetRun:
        reqs = self.workload.requests
        if self.workload.closed_loop:
            conc = getattr(self.workload.mode, "concurrency", 1)
            for _ in range(min(conc, len(reqs))):
                self._release_closed(0.0)
        else:
            for r in reqs:
                if r.depends_on is not None and r.depends_on in self.by_id:
                    self.dependents.setdefault(r.depends_on, []).append(r)
                else:
                    self._at_activity(r.arrival_s or 0.0, partial(self._arrive, r))
        self.clock.at(0.0, self._sample)
        self.clock.run()
        recs = [self.records[r.id] for r in reqs if r.id in self.records]
        return FleetRun(
            recs,
            self.load_times,
            self.load_samples,
            self.work,
            dict(self.indexer.counters.event_errors)
            | {f"decode:{k}": v for k, v in self.indexer.counters.decode_errors.items()},
            self._last_finish,
            self.busy_s,
            self.encoder_tokens,
        )

    def _sample(self) -> None:
        self.load_times.append(self.clock.now)
        self.load_samples.append([self.router.load.get(TargetKey(n)).in_flight for n in self.names])
        if self.finished < len(self.workload.requests) and self.clock.pending():
            self.clock.at(self.clock.now + self.cfg.sample_interval_s, self._sample)

    def _release_closed(self, now: float) -> None:
        """Closed loop: the next request not yet sent whose predecessor (if any) is done."""
        reqs = self.workload.requests
        while self._closed_next < len(reqs):
            r = reqs[self._closed_next]
            self._closed_next += 1
            dep = r.depends_on
            if (
                dep is not None
                and dep in self.by_id
                and self.records.get(dep, RequestRecord("", 0, 0)).finish_s is None
            ):
                self.dependents.setdefault(dep, []).append(r)
                continue
            self._at_activity(now + (r.think_s if dep else 0.0), partial(self._arrive, r))
            return

    # ------------------------------------------------------------------ router side
    def _arrive(self, r: Request) -> None:
        now = self.clock.now
        chains: I64Array | None = self.hashes.chain_hashes(r) if self.lookups else None
        n = r.num_prompt_tokens
        inp = route_input(
            RequestId(r.id),
            chains=chains,
            num_tokens=n,
            prefix_text=prefix_text(r, self.workload.token_space, self.prefix_length),
            affinity=r.affinity_id,
            model=None,
            prefix_length=self.prefix_length,
        )
        self.inputs[r.id] = inp
        self.records[r.id] = RequestRecord(r.id, now, n)
        self._try_route(r.id, queue_if_full=True)

    def _try_route(self, rid: str, *, queue_if_full: bool) -> bool:
        if self.planner is not None:
            return self._try_plan(self.planner, rid, queue_if_full=queue_if_full)
        now = self.clock.now
        inp = self.inputs[rid]
        self._set_reserved(rid)
        d = self.router.route(inp, self.targets, now)
        if d.chosen is None:
            self._unrouted(rid, d.reason, queue_if_full)
            return False
        rec = self.records[rid]
        rec.instance, rec.dispatch_s = d.chosen.target, now
        rec.predicted_cached_tokens = d.chosen.hit_tokens
        self._charge(rid, d.predicted_cached_tokens)
        self.router.dispatched(inp, d.chosen, now)
        i = self.index[d.chosen.instance]
        self._to_engine(i, rid, now)
        return True

    def _api(self, r: Request) -> PromptApi:
        if r.messages is not None:
            return "chat"
        if r.text is not None:
            return "completion"
        return self.cfg.prompt_api

    def _to_engine(
        self, i: int, rid: str, now: float, *, prefill_leg: bool = False, decode_leg: bool = False
    ) -> None:
        """Send a request (or one of its legs) to instance i: it crosses the network, then that instance's API
        server.  Dispatches happen in time order and the latency is fixed: arrivals at an API server are in
        order."""
        r = self.by_id[rid]
        at_engine = self.frontends[i].arrive(now + self.cfg.net_latency_s, r.num_prompt_tokens, self._api(r))
        self._at_activity(
            at_engine, partial(self._engine_add, i, rid, prefill_leg=prefill_leg, decode_leg=decode_leg)
        )

    def flow(self, rid: str) -> Flow:
        tenant = self.by_id[rid].tenant or "default"
        return Flow(tenant, self.cfg.priorities.get(tenant, 0))

    def _set_reserved(self, rid: str) -> None:
        """As the gateway's pipeline (``set_reserved``): whether the request may fill the capacity kept for
        high priority, and whether its flow is heavy (quiet targets: ``routing.isolation``)."""
        f, inp = self.flow(rid), self.inputs[rid]
        waiting = self.queue.waiting(f)
        inp.reserved = self.cfg.fairness == "fifo" or self.saturation.reserved(f.priority, waiting)
        inp.heavy, inp.quiet_open = self.meter.lanes(self.isolation, f, self.clock.now, waiting=waiting)

    def _charge(self, rid: str, cached_tokens: int) -> None:
        """Admitted: its flow is charged as the gateway charges it (its output known exactly here)."""
        r, f = self.by_id[rid], self.flow(rid)
        n, out = r.num_prompt_tokens, r.max_output_tokens
        self.queue.charge(f, request_cost(self.cfg.fairness, n, cached_tokens, out))
        work = max(0, n - cached_tokens) + out
        self.charged[f.tenant] = self.charged.get(f.tenant, 0.0) + work
        self.meter.add(f.tenant, work, self.clock.now, light=not self.inputs[rid].heavy)

    def _unrouted(self, rid: str, reason: str, queue_if_full: bool) -> None:
        if reason == "at_capacity" and queue_if_full:
            try:
                displaced = self.queue.push(Waiter(rid, self.flow(rid), next(self._tickets)))
            except Refused:
                self._reject(rid)
                return
            if displaced is not None:
                self._reject(displaced.item)
        elif queue_if_full:
            self._reject(rid)

    def _try_plan(self, planner: DisaggPlanner, rid: str, *, queue_if_full: bool) -> bool:
        now = self.clock.now
        inp = self.inputs[rid]
        self._set_reserved(rid)
        plan = planner.plan(inp, self.targets, now, shadow=False)
        d = plan.decode.chosen
        if d is None:
            self._unrouted(rid, plan.reason, queue_if_full)
            return False
        rec = self.records[rid]
        rec.instance, rec.dispatch_s, rec.pd_reason = d.target, now, plan.reason
        pc = plan.prefill_target
        self._charge(rid, (pc or d).hit_tokens)
        if pc is None:
            rec.predicted_cached_tokens = d.hit_tokens
            self.router.dispatched(inp, d, now)
            self._to_engine(self.index[d.instance], rid, now)
            return True
        rec.prefill_instance = pc.target
        rec.predicted_cached_tokens = pc.hit_tokens
        self.router.dispatched(inp, pc, now, request_id=leg_id(RequestId(rid)))
        self.router.dispatched(inp, d, now, prefill_tokens=0)
        ip = self.index[pc.instance]
        self.pulls[rid] = (ip, self.index[d.instance])
        self._to_engine(ip, rid, now, prefill_leg=True)
        return True

    def _reject(self, rid: str) -> None:
        self.records[rid].rejected = True
        self._done(rid)

    def _done(self, rid: str) -> None:
        self.finished += 1
        if self.progress:
            self.progress(1)
        self.inputs.pop(rid, None)
        now = self.clock.now
        self._last_finish = max(self._last_finish, now)
        for dep in self.dependents.pop(rid, []):
            at = max(dep.arrival_s or 0.0, now + dep.think_s)
            self._at_activity(at, partial(self._arrive, dep))
        if self.workload.closed_loop:
            self._release_closed(now)

    def _first_token(self, rid: str, t: float) -> None:
        self.records[rid].first_token_s = t
        if self.router.first_token(RequestId(rid), t) is not None:
            self.router.latency.train()  # virtual time: training costs none of it
        if self.saturation.max_prefill_tokens and self.queue:
            self._drain_queue()  # its prompt is computed: a target full of prefill may take another

    def _finish(self, rid: str, cached: tuple[int, int, int], out_tokens: int) -> None:
        rec = self.records[rid]
        rec.finish_s = self.clock.now
        if self.pulls.pop(rid, None) is None:
            # a split request reports its prefill instance's hit (vLLM 0.33), set by _prefill_done
            rec.cached_tokens, rec.cpu_tokens, rec.l2_tokens = cached
        rec.output_tokens = out_tokens
        self.last_out.pop(rid, None)
        if self.router.finished(RequestId(rid), rec.finish_s, out_tokens) is not None:
            self.router.latency.train()
        self._done(rid)
        self._drain_queue()

    def _drain_queue(self) -> None:
        """As the gateway's gate hands out freed capacity: the best head first; a head that finds none
        makes the heads of its class (priority, and whether its flow has others waiting) wait."""
        failed: set[tuple[int, bool, bool]] = set()
        while True:
            heads = [h for h in self.queue.heads() if self._class(h) not in failed]
            if not heads:
                return
            w = heads[0]
            if self._try_route(w.item, queue_if_full=False):
                self.queue.remove(w)
            else:
                failed.add(self._class(w))

    def _class(self, w: Waiter[str]) -> tuple[int, bool, bool]:
        return (w.flow.priority, self.queue.waiting(w.flow) > 1, self.inputs[w.item].heavy)

    def _prefill_done(self, rid: str, cached: int) -> None:
        """A prefill leg answered: its time is the prefill instance's TTFT to learn, its load is released,
        its decode leg sent with its params."""
        leg = leg_id(RequestId(rid))
        if self.router.first_token(leg, self.clock.now) is not None:
            self.router.latency.train()
        self.router.finished(leg)
        self.records[rid].cached_tokens = cached
        _, i_decode = self.pulls[rid]
        self._to_engine(i_decode, rid, self.clock.now, decode_leg=True)
        self._drain_queue()

    def _landed(self, i: int, rid: str, tokens: int) -> None:
        """A decode leg's transfer ended: its blocks are in (announced), the prefill's are released."""
        if tokens:
            self.engines[i].finish_load(rid, ok=True)
            self.records[rid].transfer_tokens = tokens
            self._wake(i)
        ip = self.pulls[rid][0] if rid in self.pulls else None
        if ip is not None and self.engines[ip].release_held(leg_id(RequestId(rid))):
            self._wake(ip)

    def _wake(self, i: int) -> None:
        if not self.busy[i] and self.engines[i].has_work():
            self.busy[i] = True
            self.clock.at(self.clock.now, lambda: self._engine_step(i))

    # ------------------------------------------------------------------ engine side
    def _engine_add(self, i: int, rid: str, *, prefill_leg: bool = False, decode_leg: bool = False) -> None:
        r = self.by_id[rid]
        eng = self.engines[i]
        erid = leg_id(RequestId(rid)) if prefill_leg else rid
        space = self.workload.token_space
        prompt = prompt_tokens(r, space)
        try:
            out = output_tokens(r, space) if r.output_segments and not prefill_leg else None
            eng.add_request(
                erid,
                prompt,
                1 if prefill_leg else r.max_output_tokens,
                cache_salt=r.cache_salt,
                hold_blocks=prefill_leg,
                remote_prefill_tokens=len(prompt) if decode_leg else None,
                mm_items=r.items,
                **({"output_token_ids": out.tolist()} if out is not None and _supports_output(eng) else {}),
            )
        except RequestRejected:
            pull = self.pulls.pop(rid, None)
            if pull is not None:  # a split request: both legs' loads go, and any blocks held for it
                self.router.finished(leg_id(RequestId(rid)))
                if self.engines[pull[0]].release_held(leg_id(RequestId(rid))):
                    self._wake(pull[0])
            self.router.finished(RequestId(rid))
            self._reject(rid)
            return
        if prefill_leg:
            self.legs[erid] = rid
        self._wake(i)

    def _at_activity(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._activity, t)
        self.clock.at(t, fn)

    def _next_activity(self) -> float:
        act, now = self._activity, self.clock.now
        while act and act[0] < now:
            heapq.heappop(act)
        return act[0] if act else float("inf")

    def _engine_step(self, i: int) -> None:
        eng = self.engines[i]
        res = eng.step_many(100_000, self._next_activity() - self.clock.now)
        end = self.clock.now + res.duration_s
        self.work[i] += res.prefill_tokens + res.decode_tokens
        self.busy_s[i] += res.duration_s
        self.encoder_tokens[i] += res.encoder_tokens
        events = eng.take_events()
        if events:
            seq = self.seqs[i]
            self.seqs[i] += 1
            if not (self.cfg.event_loss and self.rng.random() < self.cfg.event_loss):
                payload = self.writers[i].payload(events, ts=end)
                name = self.names[i]
                self.clock.at(end + self.cfg.event_delay_s, lambda: self._deliver(name, seq, payload))
        lat = self.cfg.net_latency_s
        fe = self.frontends[i]
        for o in res.outputs:
            rid = o.request_id
            if rid in self.legs:  # a prefill leg: its one token ends it
                if o.finished:
                    req = self.legs.pop(rid)
                    self._at_activity(end + lat, partial(self._prefill_done, req, o.cached_tokens))
                continue
            if o.first_token:
                t = end + lat + fe.first_output_delay(self.records[rid].prompt_tokens)
                self._first_out[rid] = t
                # With a prefill limit a first token frees capacity: the router may dispatch then.
                at = self._at_activity if self.saturation.max_prefill_tokens else self.clock.at
                at(t, partial(self._first_token, rid, t))
            else:
                last = self.last_out.get(rid, end)
                rec = self.records[rid]
                rec.itl_sum_s += end - last
                rec.itl_max_s = max(rec.itl_max_s, (end - last) / max(1, len(o.new_token_ids)))
            self.last_out[rid] = end
            if o.finished:
                cached = (o.cached_tokens, o.cpu_loaded_tokens, o.shared_loaded_tokens)
                n_out = o.num_output_tokens
                # The API server handles a request's outputs in order: the last never overtakes the first.
                t = max(end + lat + fe.output_delay(), self._first_out.pop(rid, 0.0))
                self._at_activity(t, partial(self._finish, rid, cached, n_out))
        for load in eng.take_loads():
            t = end + (self._transfer_s(i, load.tokens) if load.tokens else 0.0)
            self._at_activity(t, partial(self._landed, i, load.request_id, load.tokens))
        if not (res.num_scheduled or res.preempted or res.loaded_tokens):
            # Nothing could run: every waiting request waits for blocks that only a transfer landing or
            # a held prefill being released frees (``_wake`` starts the engine again then).  A step that
            # only loaded from CPU made progress: its requests run from the next step.
            self.busy[i] = False
        elif eng.has_work():
            self.clock.at(max(end, self.clock.now + 1e-9), lambda: self._engine_step(i))
        else:
            # The engine is busy until its step ends: a request arriving meanwhile waits for it.
            self.clock.at(end, lambda: self._step_ended(i))

    def _step_ended(self, i: int) -> None:
        self.busy[i] = False
        self._wake(i)

    def _transfer_s(self, i: int, tokens: int) -> float:
        kv_bytes = tokens * self.engines[i].profile.kv_bytes_per_token
        return self.cfg.kv_latency_s + kv_bytes / self.cfg.kv_bandwidth_bytes_per_s

    def _deliver(self, name: str, seq: int, payload: bytes) -> None:
        if self.cfg.event_loss:
            self.indexer.on_message(SourceKey(name, 0), seq, payload)  # gaps are seen and distrusted
        else:
            self.indexer.apply_payload(name, payload)


def prefix_text(r: Request, space: TokenSpace, n_chars: int) -> str:
    """The first ``n_chars`` of the text prefix-hash routing reads (``api.requests.prefix_text``) of the
    HTTP body ``http_call`` sends for this request, built without materialising more than it needs."""
    if r.messages is not None:
        return api_prefix_text([{"content": m.content} for m in r.messages])[:n_chars]
    if r.text is not None:
        return api_prefix_text(prompt=r.text)[:n_chars]
    k = n_chars // 2 + 1  # every id takes at least two characters (a digit and a space)
    if r.token_ids is not None:
        ids = r.token_ids[:k]
    else:
        segs, left = [], k
        for s in r.segments:
            if left <= 0:
                break
            segs.append(Segment(s.key, min(s.length, left)))
            left -= s.length
        ids = segments_tokens(space, segs).tolist()
    return api_prefix_text(prompt=ids)[:n_chars]


def _supports_output(eng: Engine) -> bool:
    import inspect

    return "output_token_ids" in inspect.signature(eng.add_request).parameters
