"""The request path, once, for every front door (the HTTP proxy, the endpoint picker)::

    prepare   body + headers ──parse──▶ session, tenant (flow, rate limits), LoRA adapter ──▶ model
              served? ──▶ [previous_response_id: pinned] ──tokenize──▶ request_chains ──▶ route_input
              ──▶ [remote indexer lookup]                                                 = Prepared
    admit     Prepared ──Router.route (limits)──▶ Decision; every target at its cap: wait in the
              CapacityGate or Overloaded; no target: ServiceUnavailable (``admit_plan``: a ``PDPlan``)
    dispatch  the front door sends it to ``chosen``: load accounted, speculative entries
    first_token / finished(usage)   load released (and the gate woken), reported cached tokens recorded

Invariant: every load taken is released exactly once, whatever fails (a split request has two: its
prefill leg's and its decode leg's; docs/disaggregation.md).  The front door owns the bytes and calls
these in order; ``reroute`` gives the next-best target after a failed attempt.  Decisions, shadow scoring
and rejections are recorded here, so every front door reports the same.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import msgspec

from indexer import LookupResult
from indexer.extra_keys import mm_request_chains
from indexer.hashing import I64Array, TokenIds, request_chains
from indexer.types import SourceKey
from tokenizer_cache.agent_inputs import AgentInputError, responses_messages

from ..api.errors import NotFound, Overloaded, ServiceUnavailable, Unauthorized
from ..api.kv_transfer import leg_kind
from ..api.parsed import StoredConversation
from ..api.requests import Kind, ParsedRequest, parse_body
from ..api.responses import ResponseNotFound
from ..api.routes import is_admin
from ..api.usage import UsageReport
from ..config import RouterFleetConfig
from ..flows import (
    Flow,
    Objective,
    RateLimiter,
    TargetView,
    WorkMeter,
    best,
    identify,
    miss,
    predict,
    read_objective,
    request_cost,
)
from ..loop_lag import LoopLag
from ..routing import Candidate, Decision, DisaggPlanner, PDPlan, RouteInput, Router, Target, route_input
from ..routing.disagg import explain_plan
from ..routing.new_placements import ClaimAnswer
from ..routing.policies import NOT_LEARNED, Observation
from ..routing.response_affinity import Holder, ResponseAffinity
from ..routing.tier_value import DEFAULT_TIER_VALUES, TierValues
from ..telemetry import RequestRecord, Telemetry
from ..types import RequestId, leg_id
from .admission import Admission, HeldCount
from .event_watch import EventWatch
from .gate import DEFAULT_FLOW, CapacityGate, QueueFull, SharedQueue
from .metrics import PipelineMetrics
from .parity import ParityTracker
from .response_history import ResponseHistory
from .tokens import TokenSource
from .trace_steps import trace_decision, trace_plan, usage_attrs

SAGEMAKER_AFFINITY = "x-amzn-sagemaker-prefix-aware-id"
"""Header names here are lower case: aiohttp's and the lean core's lookups ignore case, the picker's map is
lower-cased (Envoy's HTTP/2 names), so only lower case reads the same through every front door."""
_T = TypeVar("_T")


class Fleet(Protocol):
    """What the request path needs to know about the fleet right now."""

    def targets(self, model: str | None) -> list[Target]:
        """Every routable (instance, rank) serving ``model``, with its health (an adapter: only where it
        is loaded)."""

    def known_model(self, model: str | None) -> bool: ...

    def base_model(self, model: str | None) -> str | None:
        """The model ``model`` adapts when it names a LoRA adapter; None otherwise."""

    def instance_targets(self, name: str) -> list[Target] | None:
        """One instance's (instance, rank) targets, draining or not; None when it is not in the fleet."""


RemoteLookup = Callable[[ParsedRequest, TokenIds], Awaitable[LookupResult | None]]
"""A remote indexer's answer for a request (None when it cannot be had: route on load alone)."""

FindResponse = Callable[[str], Awaitable[str | None]]
"""The instance holding a response id no one told this router about (asked of the fleet), or None."""


class Prepared(msgspec.Struct):
    """A request ready to decide on: what the client sent and what the router reads of it."""

    req: ParsedRequest
    inp: RouteInput
    tokens: TokenIds | None
    remote: LookupResult | None
    started: float
    """``time.perf_counter()`` when preparation began (the decision's time runs from here)."""
    pinned: str | None = None
    """The instance this request must go to (it holds the response the request continues)."""
    rec: RequestRecord | None = None
    """Its trace and access-log facts (None: neither traced nor logged, nothing is recorded)."""
    attempts: int = 0
    """Upstream attempts and legs sent so far."""
    flow: Flow = DEFAULT_FLOW
    """Its tenant and priority (``kvrouter.flows.identify``)."""
    expected_output: int = 0
    """Decode tokens charged to its flow at admission (corrected by vLLM's report once)."""
    corrected: bool = False
    flow_notes: list[str] = []
    """Tenant or priority headers ignored (``header:reason``)."""
    objective: Objective | None = None
    """The TTFT/TPOT it states (``flows.slo``), if any."""
    slo: str | None = None
    """What admission made of its objective (``met``, ``demoted; ttft``...): the ``x-kvrouter-slo`` header."""

    def exemplar(self) -> dict[str, str] | None:
        """Exemplar labels for an observation made for this request (a traced request's trace id)."""
        return None if self.rec is None else self.rec.exemplar()

    def trace_headers(self) -> dict[str, str]:
        """The trace context to send upstream with the attempt on its way (``traceparent``)."""
        return {} if self.rec is None else self.rec.upstream_headers()


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison: how long a wrong token takes to refuse says nothing about the right one."""
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer(authorization: str | None) -> str:
    a = authorization or ""
    return a[7:].strip() if a.lower().startswith("bearer ") else ""


class PlacementClaims(Protocol):
    """Where router replicas (``replicas.PrefixClaims``), or the workers of one host
    (``host.HostClaims``), agree to place a prompt no target holds."""

    tells_placements: bool
    """Answers list the new prompts placed by the others (``ClaimAnswer.newer``): then the host's other
    workers learn this one's placements from them, and not through the host's rings as well."""

    async def claim(
        self, chain: int, target: str, chains: I64Array, *, look: bool = True
    ) -> ClaimAnswer | None:
        """Where the prompt whose first block is ``chain`` goes: ``target`` if this call claimed it, another
        replica's claim if one lives; with ``look``, no owner but the new prompts placed since this process
        last asked, if any (nothing claimed); None if unknown (then the local view decides)."""
        ...


CLAIM_LOOKS = 3
"""Claims of one new prompt that first look for placements made since (each a decision again when there
were some); one more then claims without looking, so a stream of new prompts cannot hold one back."""


class RequestPipeline:
    def __init__(
        self,
        cfg: RouterFleetConfig,
        router: Router,
        fleet: Fleet,
        tokens: TokenSource,
        metrics: PipelineMetrics,
        *,
        remote: RemoteLookup | None = None,
        parity: ParityTracker | None = None,
        find_response: FindResponse | None = None,
        lag: LoopLag | None = None,
        telemetry: Telemetry | None = None,
        host_queue: SharedQueue | None = None,
        held_host: HeldCount | None = None,
        id_prefix: str = "r",
    ) -> None:
        """``host_queue`` and ``held_host``: the host's limits queue and held count, shared by its workers
        (None: this process's own); ``id_prefix``: of this process's request ids (each worker its own);
        ``lag``: this process's event-loop delay, read by admission (None: admission by count alone)."""
        self.cfg = cfg
        self.telemetry = telemetry or Telemetry()
        self.router = router
        self.fleet = fleet
        self.tokens = tokens
        self.metrics = metrics
        self.remote = remote
        self.parity = parity or ParityTracker(cfg.parity)
        self.event_watch = EventWatch(cfg.block_size)
        """Requests that must have made their instance publish, against what its live stream brought."""
        self.affinity = ResponseAffinity(cfg.responses.affinity_ttl_s, cfg.responses.max_entries)
        self.history = ResponseHistory(cfg.responses.history_entries, cfg.responses.history_bytes)
        self.find_response = find_response if cfg.responses.probe else None
        flows = cfg.flows
        self.meter = WorkMeter(cfg.limits.isolation.half_life_s)
        """This process's reading of each flow's recent work: who is heavy (``routing.isolation``)."""
        self.gate = CapacityGate(
            cfg.limits.queue_size,
            cfg.limits.queue_timeout_s,
            fairness=flows.fairness,
            weight=lambda tenant: flows.tenant(tenant).weight,
            on_depth=self.metrics.queue_depth.set,
            on_flow_depth=self._flow_depth,
            shared=host_queue,
            early_refusal=cfg.limits.early_refusal,
            max_flows=flows.max_flows,
        )
        self.rate = RateLimiter(flows.tenant, None if host_queue is None else host_queue.flows)
        self._keyed = frozenset(t.name for t in cfg.tenants.api_keys.values())
        """Tenants that have an API key: never taken from a header."""
        self._named = self._keyed | set(flows.tenants) | {flows.default_tenant}
        """Tenants with a metrics label of their own (the others are ``other``)."""
        self._levels = flows.levels()
        """The priorities a request can have (a header's other integers are snapped to one of them)."""
        self.planner = DisaggPlanner(router, cfg.routing.disaggregation)
        self.admission = Admission(cfg.limits, metrics, lag=lag, held_host=held_host)
        """Whether a request is taken, before its body is read (``held``); ``limits.max_requests`` bounds
        every worker's held requests together (``held_host``)."""
        self.claims: PlacementClaims | None = None
        self.publish_now: Callable[[], None] | None = None
        self.peers_fresh: Callable[[], Awaitable[None]] | None = None
        """Router replicas sharing state (``replicas.claim_new_prefixes``): a prompt no target holds is
        placed once the other replicas' latest placements are known (``peers_fresh``, the worker that makes
        the round trips), where the first replica to place it claimed, and published at once (a
        disaggregated plan is made on this router's view alone)."""
        self._ids = itertools.count()
        self._decisions = 0
        self._training = False
        """A ``latency.train`` is scheduled."""
        self.id_prefix = id_prefix
        """Request ids are ``<prefix><n>``: unique in this process (each worker of a host has its own)."""

    # ------------------------------------------------------------------ admission
    def held(self) -> AbstractContextManager[None]:
        """Hold one request for its whole life; ``Overloaded`` before its body is read when the gateway
        is full or its event loop behind (``admission``).  Every front door calls this first."""
        return self.admission.held()

    def rejected(self, err: Overloaded | ServiceUnavailable) -> Overloaded | ServiceUnavailable:
        """Count a rejection by its reason; returns it for the caller to raise."""
        self.metrics.rejections.labels(err.reason).inc()
        return err

    # ------------------------------------------------------------------ a request's record
    def begin(self, route: str, headers: Mapping[str, str]) -> RequestRecord | None:
        """A front door's first step: whether this request is traced or logged (None: neither)."""
        return self.telemetry.begin(route, headers)

    def end(self, rec: RequestRecord | None, status: int) -> None:
        """A front door's last step, whatever happened: spans exported, the access-log line written."""
        if rec is not None:
            self.telemetry.end(rec, status)

    # ------------------------------------------------------------------ prepare
    def admin_allowed(self, path: str, authorization: str | None) -> bool:
        """Whether a request to ``path`` may pass: any but an admin path (``api.routes.ADMIN_PATHS``) when
        ``gateway.admin_token`` is set, and those with that token as the bearer key."""
        token = self.cfg.gateway.admin_token
        return not token or not is_admin(path) or same_secret(authorization or "", f"Bearer {token}")

    def tenant_salt(self, authorization: str | None, *, operator: bool = False) -> str | None:
        """The salt of the caller's API key.  ``Unauthorized`` if keys are required and this one is unknown;
        ``operator``: the admin token is accepted too (an admin route), with no tenant of its own."""
        t = self.cfg.tenants
        if not t.api_keys and not t.require_api_key:
            return None
        key = bearer(authorization)
        tenant = t.api_keys.get(key)
        admin = self.cfg.gateway.admin_token
        if tenant is None and operator and admin and same_secret(key, admin):
            return None
        if tenant is None:
            if t.require_api_key:
                raise Unauthorized("missing or unknown API key")
            return None
        return tenant.salt

    async def prepare(
        self,
        raw: bytes,
        kind: Kind | None,
        headers: Mapping[str, str],
        *,
        operator: bool = False,
        rec: RequestRecord | None = None,
    ) -> Prepared:
        """Everything the decision reads, from the body and headers as the client sent them."""
        t0 = time.perf_counter()
        ns0 = time.time_ns() if rec is not None else 0
        req = parse_body(raw, kind, headers.get(SAGEMAKER_AFFINITY))
        if rec is not None:
            ns1 = time.time_ns()
            rec.phase(
                "kvrouter.parse", ns0, ns1, {"kvrouter.kind": req.kind, "kvrouter.body_bytes": len(raw)}
            )
            tenant = self.cfg.tenants.api_keys.get(bearer(headers.get("authorization")))
            rec.facts.update(model=req.model, tenant=None if tenant is None else tenant.name)
        req.session = headers.get(self.cfg.routing.session.header) or req.session
        salt = self.tenant_salt(headers.get("authorization"), operator=operator)
        if salt is not None and req.cache_salt != salt:
            # A tenant's salt is enforced, never chosen by the client: its cache stays its own.
            req.set_salt(salt)
        flow, notes = self.flow_of(headers)
        objective, slo_notes = read_objective(self.cfg.flows.slo, headers)
        base = self.fleet.base_model(req.model)
        if base is not None:  # a LoRA adapter: its blocks are keyed by its name, its tokenizer is its base's
            req.lora_name, req.base_model = req.model, base
        if req.model is not None and not self.fleet.known_model(req.model):
            raise NotFound(f"model {req.model!r} is not served by this fleet", param="model")
        pinned: Holder | None = None
        if req.previous_response_id is not None:
            pinned = await self.holder(req.previous_response_id)
            req.history = self.history.get(req.previous_response_id)
        if rec is not None:
            ns1 = time.time_ns()
        tokens = await self.tokens.tokens(req)
        if rec is not None:
            reused = req.reused_tokens
            rec.phase(
                "kvrouter.tokenize",
                ns1,
                time.time_ns(),
                {
                    "kvrouter.tokens": -1 if tokens is None else len(tokens),
                    "kvrouter.tokenizer_cache": "none" if reused is None else ("hit" if reused else "miss"),
                    "kvrouter.tokenizer_cache.reused_tokens": reused or 0,
                },
            )
        chains = None
        # While the fleet renders this model differently, its token ids predict nothing: route it by
        # prefix text and load until the parity checks pass again.
        for path in req.media_paths:
            self.metrics.mm_items.labels(path).inc()
        if req.untokenized is not None:
            self.metrics.untokenized.labels(req.untokenized).inc()
        if tokens is not None and req.mm_items and self.parity.trusted(req.model):
            chains = mm_request_chains(
                tokens, self.cfg.block_size, req.mm_items, lora_name=req.lora_name, cache_salt=req.cache_salt
            )
        elif tokens is not None and self.parity.trusted(req.model):
            chains = request_chains(
                tokens, self.cfg.block_size, lora_name=req.lora_name, cache_salt=req.cache_salt
            )
        text = req.prefix_text()
        num_tokens = len(tokens) if tokens is not None else None
        if pinned is not None and num_tokens is None:
            num_tokens = pinned.tokens + len(text) // 4  # the history it continues, and its new input
        inp = route_input(
            RequestId(f"{self.id_prefix}{next(self._ids)}"),
            chains=chains,
            num_tokens=num_tokens,
            prefix_text=text,
            affinity=req.affinity,
            model=req.model,
            prefix_length=self.cfg.routing.prefix_hash.prefix_length,
            session=req.session,
        )
        # A remote indexer is asked with token ids only: it cannot key a multimodal prompt's blocks.
        remote = (
            await self.remote(req, tokens)
            if self.remote is not None and tokens is not None and not req.mm_items
            else None
        )
        if rec is not None:
            rec.facts.update(request_id=inp.request_id, prompt_tokens=inp.num_tokens)
        expected = _expected_output(req.body, self.cfg.flows.expected_output_tokens)
        self.rate_limit(flow, inp.num_tokens + expected)
        return Prepared(
            req,
            inp,
            tokens,
            remote,
            t0,
            None if pinned is None else pinned.instance,
            rec,
            flow=flow,
            expected_output=expected,
            flow_notes=notes + self._warned(slo_notes),
            objective=objective,
        )

    # ------------------------------------------------------------------ flows
    def flow_of(self, headers: Mapping[str, str]) -> tuple[Flow, list[str]]:
        """The request's flow; each header ignored is counted (a warning, never an error)."""
        key = self.cfg.tenants.api_keys.get(bearer(headers.get("authorization")))
        name = None if key is None else key.name
        flow, notes = identify(self.cfg.flows, name, headers, self._keyed, self._levels)
        return flow, self._warned(notes)

    def _warned(self, notes: list[str]) -> list[str]:
        for n in notes:
            header, _, reason = n.partition(":")
            self.metrics.flows.header_warnings.labels(header, reason).inc()
        return notes

    def flow_labels(self, flow: Flow) -> tuple[str, str]:
        return (flow.tenant if flow.tenant in self._named else "other", str(flow.priority))

    def _flow_depth(self, flow: Flow, depth: int) -> None:
        self.metrics.flows.depth.labels(*self.flow_labels(flow)).set(depth)

    def rate_limit(self, flow: Flow, tokens: int) -> None:
        """``Overloaded`` (429 with Retry-After) when ``flow``'s tenant is past its requests or tokens per
        minute; otherwise the request is taken from its allowance."""
        wait = self.rate.take(flow.tenant, tokens, time.monotonic())
        if wait > 0:
            self.metrics.flows.rate_limited.labels(self.flow_labels(flow)[0]).inc()
            err = Overloaded(
                f"tenant {flow.tenant!r} is over its rate limit; retry in {wait:.1f} s", reason="rate_limited"
            )
            err.retry_after_s = max(1, math.ceil(wait))
            raise self.rejected(err)

    def _charge(self, p: Prepared, cached_tokens: int) -> float:
        """What admitting ``p`` costs its flow (``cached_tokens``: where it goes); its work is counted."""
        n = p.inp.num_tokens
        uncached = max(0, n - cached_tokens)
        self.metrics.flows.work.labels(*self.flow_labels(p.flow)).inc(uncached)
        self.meter.add(p.flow.tenant, uncached + p.expected_output, time.monotonic(), light=not p.inp.heavy)
        return request_cost(self.cfg.flows.fairness, n, cached_tokens, p.expected_output)

    def _output_known(self, p: Prepared, out: int | None) -> None:
        """The decode charged at admission, put right by what vLLM reports it generated (once)."""
        if p.corrected or out is None:
            return
        p.corrected = True
        self.metrics.flows.work.labels(*self.flow_labels(p.flow)).inc(out)
        self.meter.add(p.flow.tenant, out - p.expected_output, time.monotonic())
        if self.cfg.flows.fairness != "requests":
            self.gate.charge(p.flow, out - p.expected_output)

    # ------------------------------------------------------------------ stored responses
    async def holder(self, response_id: str) -> Holder:
        """The instance holding a stored response, able to take requests now.  ``ResponseNotFound``: no
        instance holds it (vLLM's 404), or the one that did left the fleet (with that reason);
        ``ServiceUnavailable``: it is out of rotation right now (come back later)."""
        now = time.monotonic()
        h = self.affinity.lookup(response_id, now)
        if h is None and self.find_response is not None:
            found = await self.find_response(response_id)
            if found is not None:
                h = Holder(found)
                self.affinity.record(response_id, h, now)
        if h is None:
            self.metrics.rejections.labels("response_not_found").inc()
            raise ResponseNotFound(response_id)
        targets = self.fleet.instance_targets(h.instance)
        if targets is None:
            self.metrics.rejections.labels("response_holder_gone").inc()
            raise ResponseNotFound(
                response_id,
                f"Response with id '{response_id}' not found: it was stored on instance {h.instance!r}, "
                "which has left the fleet (stored responses live in that instance's memory).",
            )
        if not any(t.healthy for t in targets):
            raise self.rejected(
                ServiceUnavailable(
                    f"instance {h.instance!r}, which holds response '{response_id}', is out of rotation; "
                    "retry later",
                    reason="response_holder_down",
                )
            )
        return h

    def response_seen(self, p: Prepared, response_id: str, chosen: Candidate) -> None:
        """A response id came back from ``chosen``: a later request continuing it must go there."""
        if p.req.store:
            self.affinity.record(response_id, Holder(chosen.instance, p.inp.num_tokens), time.monotonic())

    def response_done(self, p: Prepared, response_id: str, output: list[dict[str, Any]]) -> None:
        """A stored response was answered: what vLLM keeps for its continuations is kept here too (the
        messages rendered for it, as ``construct_input_messages`` builds them, and its output items)."""
        req = p.req
        if not req.store or self.history.max_entries <= 0:
            return
        if req.previous_response_id is not None and req.history is None:
            return  # its history is not known here, so neither is what the instance stored
        prev = req.history
        if prev is None:
            # A first turn: ``parse_responses`` already rendered this body's messages (None when vLLM
            # refuses the input, so stores nothing).
            if req.messages is None:
                return
            messages = req.messages
        else:
            try:
                messages = responses_messages(
                    req.body.get("instructions"),
                    req.body.get("input"),
                    previous_messages=prev.messages,
                    previous_output=prev.output,
                )
            except AgentInputError:
                return  # vLLM refused it, so stored nothing
        self.history.put(response_id, StoredConversation(messages, output))

    def prepare_bodyless(self) -> Prepared:
        """A request without a body (a GET through a gateway that sends every request to its picker):
        no model, no prompt, so the policy decides by load among every target."""
        t0 = time.perf_counter()
        req = ParsedRequest("other", {}, b"")
        inp = route_input(
            RequestId(f"{self.id_prefix}{next(self._ids)}"),
            chains=None,
            num_tokens=0,
            prefix_text="",
            affinity=None,
            model=None,
            prefix_length=self.cfg.routing.prefix_hash.prefix_length,
        )
        return Prepared(req, inp, None, None, t0)

    # ------------------------------------------------------------------ decide
    def decide(
        self,
        p: Prepared,
        exclude: Collection[str] = (),
        *,
        only: Collection[str] | None = None,
        dry_run: bool = False,
        shadow: bool = True,
        model: str | None = None,
    ) -> Decision:
        """The router's decision among the model's targets (``model``: another model's, such as the base
        model of an adapter to load), without ``exclude`` and (if given) only among ``only`` (a front
        door's candidate subset)."""
        if p.pinned is not None:
            pool = self.fleet.instance_targets(p.pinned)
        else:
            pool = self.fleet.targets(model if model is not None else p.inp.model)
        targets = [t for t in pool or () if t.key not in exclude and (only is None or t.key in only)]
        now = time.monotonic()
        rec = p.rec if p.rec is not None and p.rec.traced and not dry_run else None
        ns0 = time.time_ns() if rec is not None else 0
        cands = self.router.candidates(p.inp, targets, now, p.remote)
        if rec is None:
            return self.router.route_among(p.inp, cands, now=now, dry_run=dry_run, shadow=shadow)
        ns1 = time.time_ns()
        d = self.router.route_among(p.inp, cands, now=now, dry_run=dry_run, shadow=shadow)
        trace_decision(rec, d, ns0, ns1, time.time_ns())
        return d

    async def admit(self, p: Prepared, *, only: Collection[str] | None = None) -> Decision:
        """A decision with a target, waiting for capacity in the gate if every target is at its cap.
        ``Overloaded`` (queue full or timed out), ``ServiceUnavailable`` (no healthy target)."""

        tries = [time.time_ns() if p.rec is not None else 0, 0, 0]  # admission began, last try began, tries
        self._check_objective(p)
        new = await self._new_prompt(p)

        def attempt() -> Decision | None:
            if p.rec is not None:
                tries[1] = time.time_ns()
                tries[2] += 1
            self.set_reserved(p)
            d = self._claimed(p, (), only)
            return None if d.reason == "at_capacity" else d

        def cost(d: Decision) -> float:
            return self._charge(p, d.predicted_cached_tokens)

        d = await self._wait(p, attempt, cost)
        logged = True  # the placement is in the claims log (when there is one)
        if new:
            for look in (True,) * CLAIM_LOOKS + (False,):
                again = await self._claim_elsewhere(p, d, look) if d.chosen is not None else False
                logged = logged and again is not None
                if not again:
                    break
                self.unclaim(p)  # decided again (its flow charged for one decision)
                d = await self._wait(p, attempt, lambda _: 0.0)
                if not self.router.new_prefix(p.inp):
                    break  # following a claim: the prompt is expected where it went
        self._placed_new(p, d, logged)
        self._record(d)
        self.metrics.decision_seconds.observe(time.perf_counter() - p.started, p.exemplar())
        if p.rec is not None:
            self._admitted(p.rec, d, tries)
        if d.chosen is None:
            if p.pinned is not None:
                raise self.rejected(
                    ServiceUnavailable(
                        f"instance {p.pinned!r}, which holds the response this request continues, is out of "
                        "rotation; retry later",
                        reason="response_holder_down",
                    )
                )
            raise self.rejected(ServiceUnavailable("no healthy instance serves this model", reason=d.reason))
        self.metrics.prompt_tokens.inc(p.inp.num_tokens)
        return d

    def _admitted(
        self, rec: RequestRecord, d: Decision, tries: list[int], plan: PDPlan | None = None
    ) -> None:
        """The decision's facts, and the time spent waiting in the gate for capacity (from admission to
        the try that got a target; 0 when the first try did)."""
        began, last, n = tries
        wait_ns = last - began if n > 1 else 0
        rec.facts.update(
            policy=d.policy,
            reason=d.reason,
            predicted_cached_tokens=d.predicted_cached_tokens,
            queue_wait_ms=round(wait_ns / 1e6, 3),
        )
        if plan is not None:
            rec.facts["pd"] = "split" if plan.split else "whole"
            if plan.split and plan.prefill is not None and plan.prefill.chosen is not None:
                rec.facts["prefill_instance"] = plan.prefill.chosen.target
                rec.facts["predicted_cached_tokens"] = plan.prefill.predicted_cached_tokens
        if wait_ns:
            rec.phase("kvrouter.queue_wait", began, last, {"kvrouter.queue_depth": self.gate.waiting})

    async def _new_prompt(self, p: Prepared) -> bool:
        """Whether ``p`` is a prompt no target holds and router replicas claim such placements; the other
        replicas' latest placements are taken in first (``peers_fresh``), which may answer no."""
        if self.claims is None or p.pinned is not None or not self.router.new_prefix(p.inp):
            return False
        if self.peers_fresh is not None:
            await self.peers_fresh()
        return self.router.new_prefix(p.inp)

    async def _claim_elsewhere(self, p: Prepared, d: Decision, look: bool) -> bool | None:
        """Claim ``d``'s target for the new prompt among the replicas.  True when the decision must be made
        again: another replica's claim names another target (the prompt is then expected there, as a
        peer's speculative entry would say, and weighed as any expected prefix, load bound included), or
        new prompts were placed since this process last asked (each is expected where it went).  None: no
        answer (the claim given up), so the local view stands and no claims log tells of the placement."""
        assert self.claims is not None and d.chosen is not None and p.inp.chains is not None
        got = await self.claims.claim(int(p.inp.chains[0]), d.chosen.target, p.inp.chains, look=look)
        if got is None:
            return None
        if got.owner == d.chosen.target:
            return False
        at = {c.target: c for c in d.ranked}
        now = time.monotonic()
        if got.owner is not None:
            c = at.get(got.owner)
            if c is not None:
                self.router.expect(p.inp.chains, c, now)
            return c is not None
        for placed in got.newer:
            c = at.get(placed.target)
            if c is not None:
                chains = placed.chain_array()
                self.router.expect(chains, c, now)
                self.router.placed_new(chains, c, now)
        return True

    def _placed_new(self, p: Prepared, d: Decision, logged: bool = True) -> None:
        """A prompt no target holds (nor is expected to: not following another replica's claim), placed
        by this router: its blocks count in the chosen target's share of new placements, here and in the
        host's other workers.  ``logged``: its claim was answered (not given up: Redis down, too slow)."""
        c, chains = d.chosen, p.inp.chains
        if c is not None and chains is not None and c.matched_blocks == 0 and self.router.new_prefix(p.inp):
            # with a placements log, the host's other workers read it there when they next place one
            share = self.claims is None or not self.claims.tells_placements or not logged
            self.router.placed_new(chains, c, time.monotonic(), share=share)

    def _placed(self, chosen: Candidate) -> None:
        """Sent where nothing of the prompt was expected: the other replicas are told at once."""
        if self.publish_now is not None and chosen.cached_tokens == 0:
            self.publish_now()

    def _check_objective(self, p: Prepared) -> None:
        """Before ``p`` waits: predict its TTFT and TPOT at its best target (``flows.slo``); one it would
        miss is refused (``Overloaded``, 429) or served at ``demote_priority``, the reason in
        ``x-kvrouter-slo`` (with ``by=``: the learned ``models`` or the configured ``rates``) and
        ``kvrouter_flow_slo_total``."""
        if p.objective is None:
            return
        cfg = self.cfg.flows.slo
        cands = self.router.candidates(p.inp, self.fleet.targets(p.inp.model), time.monotonic(), p.remote)
        lat = self.router.latency
        ttft: float | None
        tpot: float | None
        learned = cfg.learned and bool(cands) and all(lat.warm(c.target) for c in cands)
        by = "models" if learned else "rates"
        if learned:
            ttft, tpot = best(lat.predict(p.inp.num_tokens, c) for c in cands)
        else:
            views = [
                TargetView(c.pending_prefill_tokens, max(0, p.inp.num_tokens - c.cached_tokens), c.decoding)
                for c in cands
            ]
            ttft, tpot = predict(cfg, views)
        missed = miss(p.objective, ttft, tpot)
        tenant = self.flow_labels(p.flow)[0]
        if missed is None and ttft is None and tpot is None:
            p.slo = "not_predicted"
            self.metrics.flows.slo.labels(tenant, "not_predicted").inc()
            return
        if missed is None:
            p.slo = "met"
            self.metrics.flows.slo.labels(tenant, "met").inc()
            return
        predicted = (ttft if missed == "ttft" else tpot) or 0.0  # (a miss is always predicted)
        if cfg.on_miss == "reject":
            self.metrics.flows.slo.labels(tenant, f"rejected_{missed}").inc()
            err = Overloaded(
                f"the {missed.upper()} objective cannot be met: {predicted * 1e3:.0f} ms predicted",
                reason=f"slo_{missed}",
            )
            err.headers["x-kvrouter-slo"] = f"rejected; {missed}; predicted_ms={predicted * 1e3:.0f}; by={by}"
            raise self.rejected(err)
        self.metrics.flows.slo.labels(tenant, f"demoted_{missed}").inc()
        p.flow = Flow(p.flow.tenant, min(p.flow.priority, cfg.demote_priority))
        p.slo = f"demoted; {missed}; predicted_ms={predicted * 1e3:.0f}; by={by}"

    def set_reserved(self, p: Prepared, *, dry_run: bool = False) -> None:
        """Whether ``p`` may fill the capacity kept for high priority (``routing.saturation``), and whether
        its flow is heavy (``routing.isolation``), as its flow stands now; ``fifo`` knows no priorities:
        every request may fill the reserve.  The evaluator applies the same rules
        (``VirtualFleet._set_reserved``).  ``dry_run`` (explain): no flow's hold starts or ends."""
        sat = self.cfg.limits.saturation
        waiting = self.gate.queue.waiting(p.flow)
        p.inp.reserved = self.cfg.flows.fairness == "fifo" or sat.reserved(p.flow.priority, waiting)
        p.inp.heavy, p.inp.quiet_open = self.meter.lanes(
            self.cfg.limits.isolation,
            p.flow,
            time.monotonic(),
            waiting=waiting,
            weight=lambda t: self.cfg.flows.tenant(t).weight,
            dry_run=dry_run,
        )

    async def _wait(self, p: Prepared, attempt: Callable[[], _T | None], cost: Callable[[_T], float]) -> _T:
        labels = self.flow_labels(p.flow)
        t0 = time.monotonic()
        # A heavy flow's waiters make only heavy requests wait behind them: the quiet targets may still
        # have room for the others (``routing.isolation``).  Heavy is read as the request arrives.
        self.set_reserved(p)
        try:
            got = await self.gate.acquire(  # (the gate keeps the queue-depth gauges)
                attempt,
                p.flow,
                group=(p.inp.model, p.pinned, p.inp.heavy),
                cost=cost,
                undo=lambda _: self.unclaim(p),
            )
        except QueueFull as e:
            self.metrics.flows.shed.labels(*labels, e.reason).inc()
            raise self.rejected(
                Overloaded(f"all instances at capacity ({e.reason})", reason=e.reason)
            ) from None
        self.metrics.flows.admitted.labels(*labels).inc()
        if p.inp.heavy:
            self.metrics.flows.heavy.labels(*labels).inc()
        self.metrics.flows.wait.labels(*labels).observe(time.monotonic() - t0)
        return got

    # ------------------------------------------------------------------ disaggregated models
    def disaggregated(self, p: Prepared) -> bool:
        """Whether ``p`` is split by a disaggregated fleet (planned with ``admit_plan``): its model's
        instances have roles and its route is one vLLM splits (the others are served whole).  A request
        pinned to the instance holding the response it continues is served whole there: only that
        instance can read its ``previous_response_id``, a prefill instance would answer 404."""
        if p.pinned is not None or leg_kind(p.req.kind) is None:
            return False
        return self.planner.applies(self.fleet.targets(p.inp.model))

    def plan(self, p: Prepared, *, dry_run: bool = False, shadow: bool = True) -> PDPlan:
        rec = p.rec if p.rec is not None and p.rec.traced and not dry_run else None
        ns0 = time.time_ns() if rec is not None else 0
        plan = self.planner.plan(
            p.inp,
            self.fleet.targets(p.inp.model),
            time.monotonic(),
            remote=p.remote,
            dry_run=dry_run,
            shadow=shadow,
        )
        if rec is not None:
            trace_plan(rec, plan, ns0, time.time_ns())
        return plan

    async def admit_plan(self, p: Prepared) -> PDPlan:
        """``admit`` for a disaggregated model: a plan whose decode instance (and, when split, prefill
        instance) has capacity, waiting in the gate while every decode instance is at its cap."""

        tries = [time.time_ns() if p.rec is not None else 0, 0, 0]
        self._check_objective(p)

        def attempt() -> PDPlan | None:
            if p.rec is not None:
                tries[1] = time.time_ns()
                tries[2] += 1
            self.set_reserved(p)
            plan = self.plan(p, shadow=False)
            if plan.reason == "at_capacity":
                return None
            d = plan.decode.chosen
            if d is not None and not self.router.claim(p.inp.request_id, d, p.inp.reserved):
                return None  # another worker took its last slot: plan again when capacity frees
            return plan

        def cost(plan: PDPlan) -> float:
            leg = plan.prefill if plan.split and plan.prefill is not None else plan.decode
            return self._charge(p, leg.predicted_cached_tokens)

        plan = await self._wait(p, attempt, cost)
        self.metrics.pd.plans.labels("disaggregated" if plan.split else "aggregated", plan.reason).inc()
        self.metrics.decisions.labels("pd-decode", plan.decode.reason).inc()
        if plan.prefill is not None and plan.split:
            self._record(plan.prefill)
        self.metrics.decision_seconds.observe(time.perf_counter() - p.started, p.exemplar())
        if p.rec is not None:
            self._admitted(p.rec, plan.decode, tries, plan)
        if plan.decode.chosen is None:
            raise self.rejected(
                ServiceUnavailable("no healthy instance serves this model", reason=plan.reason)
            )
        self.metrics.prompt_tokens.inc(p.inp.num_tokens)
        return plan

    def reroute_prefill(self, p: Prepared, plan: PDPlan, tried: set[str]) -> Candidate | None:
        """The next prefill instance after failed prefill legs on ``tried`` (None: none is left)."""
        assert plan.decode.chosen is not None
        return self.planner.reroute_prefill(
            p.inp,
            self.fleet.targets(p.inp.model),
            plan.decode.chosen.target,
            tried,
            time.monotonic(),
            p.remote,
        )

    def prefill_dispatched(self, p: Prepared, chosen: Candidate) -> None:
        """A split request's prefill leg is on its way to ``chosen`` (its own load, under ``leg_id``)."""
        self.router.dispatched(p.inp, chosen, time.monotonic(), request_id=leg_id(p.inp.request_id))
        self._predicted(chosen)
        self._placed(chosen)
        self.metrics.pd.legs.labels("prefill", chosen.target).inc()
        self._upstream(p, "prefill", chosen)

    def prefill_finished(self, p: Prepared, chosen: Candidate, usage: UsageReport | None = None) -> None:
        """The prefill leg on ``chosen`` is over (answered or failed): its load is released; ``usage``:
        what the prefill instance reported (its cache hit is the request's; with it, the leg answered and
        its time is the prefill instance's TTFT to learn)."""
        leg = leg_id(p.inp.request_id)
        if usage is not None:
            self._observed(self.router.first_token(leg, time.monotonic()))
        self.router.finished(leg)
        self.gate.release()  # (the gate keeps the queue-depth gauge)
        self._reported(p, chosen, usage)
        if p.rec is not None:
            p.rec.upstream_ended(**usage_attrs(usage))

    def reroute(self, p: Prepared, tried: Collection[str]) -> Candidate | None:
        """The next-best target after failed attempts on ``tried`` (None: no other, or all at their cap)."""
        return self._claimed(p, tried, None, shadow=True).chosen

    def _claimed(
        self, p: Prepared, exclude: Collection[str], only: Collection[str] | None, *, shadow: bool = False
    ) -> Decision:
        """``decide``, with a slot claimed on the chosen target for the dispatch that follows.  A target
        whose last slot another worker process took meanwhile is left out and the decision made again."""
        lost: set[str] = set(exclude)
        while True:
            d = self.decide(p, lost, only=only, shadow=shadow)
            if d.chosen is None and len(lost) > len(exclude):
                return Decision(None, d.policy, "at_capacity", d.ranked)  # the rest are at their caps
            if d.chosen is None or self.router.claim(p.inp.request_id, d.chosen, p.inp.reserved):
                return d
            lost.add(d.chosen.target)

    def unclaim(self, p: Prepared) -> None:
        """Give back a slot claimed for ``p`` and not taken by a dispatch (a request that ended before)."""
        self.router.load.unclaim(p.inp.request_id)

    def _record(self, d: Decision) -> None:
        self.metrics.decisions.labels(d.policy, d.reason).inc()
        if d.reason == "spill":
            self.metrics.spills.inc()
        if d.chosen is None:
            return
        self._decisions += 1
        if self._decisions % self.cfg.routing.shadow_every:
            d.shadow_basis = None  # not in the sample (``routing.shadow_every``)
        elif d.shadow_basis is not None:
            # Deferred: scored when this task next yields (its upstream request is being sent by then).
            asyncio.get_running_loop().call_soon(self._record_shadow, d)
        else:
            self._record_shadow(d)

    def _record_shadow(self, d: Decision) -> None:
        assert d.chosen is not None
        self.metrics.shadow_scored.inc()
        self.metrics.shadow_cached.labels(d.policy).inc(d.chosen.hit_tokens)
        for name, sh in self.router.shadow(d).items():
            self.metrics.shadow_cached.labels(name).inc(sh.cached_tokens)
            if sh.target == d.chosen.target:
                self.metrics.shadow_agree.labels(name).inc()

    # ------------------------------------------------------------------ account
    def dispatched(self, p: Prepared, chosen: Candidate, *, received: bool = False) -> None:
        """The request is on its way to ``chosen``.  ``received``: a split request's decode leg, whose
        prompt arrives from its prefill instance (it computes none of it)."""
        self.router.dispatched(p.inp, chosen, time.monotonic(), prefill_tokens=0 if received else None)
        if received:
            self.metrics.pd.legs.labels("decode", chosen.target).inc()
        else:
            self._predicted(chosen)
            self._placed(chosen)
        self.parity.routed(p.req, p.tokens, chosen.instance)
        self._upstream(p, "decode" if received else "whole", chosen)

    def _upstream(self, p: Prepared, leg: str, chosen: Candidate) -> None:
        p.attempts += 1
        rec = p.rec
        if rec is not None:
            rec.facts.update(instance=chosen.target, attempts=p.attempts)
            rec.upstream_started(leg, chosen.target, p.attempts)

    def answered(self, p: Prepared, status: int) -> None:
        """The attempt on its way got its response headers (``status``)."""
        if p.rec is not None:
            p.rec.upstream_answered(status)

    def _predicted(self, chosen: Candidate) -> None:
        """What the target computing the prompt is predicted to serve from cache, in all and by tier."""
        self.metrics.predicted_cached.labels(chosen.target).inc(chosen.hit_tokens)
        for tier, n in chosen.tiers.items():
            self.metrics.routed_blocks.labels(tier).inc(n)
            self.metrics.routed_credit.labels(tier).inc(n * self.router.tier_values.of(tier))

    def first_token(self, p: Prepared, *, streamed: bool = True) -> None:
        """The answer's first byte came back: its prefill load ends.  Only a stream's first chunk is its first
        token: a unary answer (``streamed`` False) comes whole once generated, so its time is neither a TTFT
        nor, at its end, a pace; the latency models do not learn from it."""
        self._observed(self.router.first_token(p.inp.request_id, time.monotonic(), streamed=streamed))
        if self.cfg.limits.saturation.max_prefill_tokens:
            self.gate.release()  # its prompt is computed: a target full of prefill may take another
        if p.rec is not None:
            p.rec.first_token()

    def _observed(self, o: Observation | None) -> None:
        """An observed TTFT or TPOT: its error counted, and the models trained once this task yields (the
        decision of no request waits for it)."""
        if o is None:
            return
        if o.outcome in NOT_LEARNED:
            self.metrics.latency_observations.labels(o.kind, o.outcome).inc()
            return
        if o.warm and o.predicted_s > 0:
            self.metrics.latency_error.labels(o.kind).observe(
                abs(o.predicted_s - o.observed_s) / o.observed_s
            )
        if not self._training:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a caller without a loop: trained now
                self._train()
                return
            self._training = True
            loop.call_soon(self._train)

    def _train(self) -> None:
        self._training = False
        for kind, outcome in self.router.latency.train():
            self.metrics.latency_observations.labels(kind, outcome).inc()

    def finished(
        self,
        p: Prepared,
        chosen: Candidate,
        usage: UsageReport | None = None,
        *,
        output_tokens: int | None = None,
    ) -> None:
        """The attempt on ``chosen`` is over (answered, failed or abandoned): its load is released and a
        waiting request may take the freed capacity.  ``usage``: what vLLM reported, if it did (a split
        request's decode leg reports its prefill instance's cache hit: pass None, and what it generated
        as ``output_tokens``, its pace to learn)."""
        out = output_tokens if usage is None else usage.completion_tokens
        self._observed(self.router.finished(p.inp.request_id, time.monotonic(), out))
        self._output_known(p, out)  # a split request's too: its decode leg's tokens
        self.gate.release()  # (the gate keeps the queue-depth gauge)
        self._reported(p, chosen, usage)
        if p.rec is not None:
            p.rec.upstream_ended(**usage_attrs(usage))

    def _reported(self, p: Prepared, chosen: Candidate, usage: UsageReport | None) -> None:
        if usage is not None:
            src = SourceKey(chosen.instance, chosen.dp_rank)
            self.event_watch.served(src, usage.prompt_tokens, usage.cached_tokens, time.monotonic())
        if usage is not None and usage.cached_tokens is not None:
            if p.rec is not None:
                p.rec.facts["reported_cached_tokens"] = usage.cached_tokens
            self.metrics.reported_cached.labels(chosen.target).inc(usage.cached_tokens)
            self.metrics.cached_error.observe(chosen.hit_tokens - usage.cached_tokens)
            self.parity.shortfall(
                p.req,
                p.tokens,
                chosen.instance,
                chosen.hit_tokens,
                usage.cached_tokens,
                self.cfg.block_size,
            )
            if p.req.kind in self.parity.render_unavailable:
                verdict = self.parity.cached_tokens_check(
                    p.req, p.tokens, chosen.hit_tokens, usage.cached_tokens, self.cfg.block_size
                )
                if verdict is not None:
                    labels = (str(p.req.model), p.req.kind, "cached_tokens", verdict)
                    self.metrics.parity_checks.labels(*labels).inc()

    def released(self) -> None:
        """Capacity was freed outside a request (an instance became healthy): hand it to waiting requests."""
        self.gate.pump()


def _expected_output(body: dict[str, Any], default: int) -> int:
    """Decode tokens a request is expected to cost: ``default``, at most the ``max_tokens`` it asks."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return min(v, default)
    return default


def explain(
    p: Prepared,
    d: Decision,
    elapsed_s: float,
    plan: PDPlan | None = None,
    values: TierValues = DEFAULT_TIER_VALUES,
    quiet: Collection[str] = (),
) -> dict[str, Any]:
    """``/v1/route/explain``: every candidate's cache, tiers, load, trust and score (and, for a
    disaggregated model, the plan: split or whole, why, and both pools' rankings).

    Per candidate, ``tiers`` holds the credited blocks by tier (GPU and speculative always, CPU, STORAGE
    and shared stores when it has some), ``tier_value`` each listed tier's worth per block, and
    ``cached_tokens`` their sum in tokens (what kv-aware subtracts); ``hit_tokens`` counts every tier in
    full (what vLLM is expected to report).  ``tier_costs``: the load and recompute times behind the
    worths.  ``quiet_targets`` (with ``limits.isolation``): the targets kept from heavy flows; the flow's
    ``heavy`` says whether this request's is one, ``quiet_open`` whether they take anyone now."""
    out: dict[str, Any] = {
        "policy": d.policy,
        "reason": d.reason,
        "choice": None if d.chosen is None else d.chosen.target,
        "predicted_cached_tokens": d.predicted_cached_tokens,
        "num_tokens": p.inp.num_tokens,
        "tokenized": p.inp.chains is not None,
        "candidates": [
            {
                "target": c.target,
                "instance": c.instance,
                "dp_rank": c.dp_rank,
                "cached_tokens": c.cached_tokens,
                "hit_tokens": c.hit_tokens,
                "tiers": {"GPU": c.gpu_blocks, "speculative": c.speculative_blocks, **c.tiers},
                "tier_value": {t: round(values.of(t), 4) for t in ("GPU", "speculative", *c.tiers)},
                "matched_blocks": c.matched_blocks,
                "trust": c.trust,
                "in_flight": c.in_flight,
                "pending_prefill_tokens": c.pending_prefill_tokens,
                "decoding": c.decoding,
                "kv_usage": c.kv_usage,
                "saturated": c.saturated,
                "score": c.score,
                "predicted_ttft_s": c.predicted_ttft_s,
                "predicted_tpot_s": c.predicted_tpot_s,
            }
            for c in d.ranked
        ],
        "shadow": {k: {"target": v.target, "cached_tokens": v.cached_tokens} for k, v in d.shadow.items()},
        "tier_costs": {
            "recompute_ms_per_1k_tokens": round(values.recompute_ms_per_1k_tokens, 3),
            "load_ms_per_1k_tokens": {t: round(v, 3) for t, v in values.load_ms_per_1k_tokens.items()},
            "value": {"GPU": 1.0, "CPU": values.cpu, "STORAGE": values.storage, **values.shared},
        },
        "decision_ms": round(elapsed_s * 1e3, 3),
        "flow": {
            "tenant": p.flow.tenant,
            "priority": p.flow.priority,
            "ignored_headers": p.flow_notes,
            "may_fill_reserve": p.inp.reserved,
            "heavy": p.inp.heavy,
            "quiet_open": p.inp.quiet_open,
            "objective": None if p.objective is None else msgspec.to_builtins(p.objective),
        },
    }
    if quiet:
        out["quiet_targets"] = sorted(quiet)
    if plan is not None:
        out["disaggregation"] = explain_plan(plan)
    return out
