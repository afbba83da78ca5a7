"""The request path, once, for every front door (the HTTP proxy, the endpoint picker).

::

    prepare   body + headers ──parse──▶ tenant salt ──▶ model served? ──tokenize (tokenizer cache)──▶
              request_chains ──▶ route_input ──▶ [remote indexer lookup]             = Prepared
    admit     Prepared ──Router.route (limits)──▶ Decision; every target at its cap: wait in the
              CapacityGate (FIFO, bounded) or Overloaded; no target: ServiceUnavailable
    dispatch  the front door sends it to ``chosen``: load accounted, speculative entries, predicted tokens
    first_token / finished(usage)
              load released (and the gate woken), vLLM's reported cached tokens against the prediction

The front door owns the bytes (reading the body, sending it upstream, streaming back) and calls these in
that order; ``reroute`` gives the next-best target after a failed attempt.  Decisions, shadow scoring,
predicted-vs-reported metrics and rejections are recorded here, so every front door reports the same.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import msgspec

from indexer import LookupResult
from indexer.hashing import TokenIds, request_chains

from ..api.errors import NotFound, Overloaded, ServiceUnavailable, Unauthorized
from ..api.requests import Kind, ParsedRequest, parse_body
from ..api.usage import UsageReport
from ..config import RouterFleetConfig
from ..routing import Candidate, Decision, RouteInput, Router, Target, route_input
from ..types import RequestId
from .gate import CapacityGate, QueueFull
from .metrics import PipelineMetrics
from .parity import ParityTracker
from .tokens import TokenSource

SAGEMAKER_AFFINITY = "X-Amzn-SageMaker-Prefix-Aware-Id"


class Fleet(Protocol):
    """What the request path needs to know about the fleet right now."""

    def targets(self, model: str | None) -> list[Target]:
        """Every routable (instance, rank) serving ``model``, with its health."""

    def known_model(self, model: str | None) -> bool: ...


class HeldCount(Protocol):
    """Requests held by every worker process of the host (``kvrouter.host.QueueBoard``)."""

    def held_total(self) -> int: ...

    def add_held(self, d: int) -> None: ...


RemoteLookup = Callable[[ParsedRequest, TokenIds], Awaitable[LookupResult | None]]
"""A remote indexer's answer for a request (None when it cannot be had: route on load alone)."""


class Prepared(msgspec.Struct):
    """A request ready to decide on: what the client sent and what the router reads of it."""

    req: ParsedRequest
    inp: RouteInput
    tokens: TokenIds | None
    remote: LookupResult | None
    started: float
    """``time.perf_counter()`` when preparation began (the decision's time runs from here)."""


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison: how long a wrong token takes to refuse says nothing about the right one."""
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer(authorization: str | None) -> str:
    a = authorization or ""
    return a[7:].strip() if a.lower().startswith("bearer ") else ""


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
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.fleet = fleet
        self.tokens = tokens
        self.m = metrics
        self.remote = remote
        self.parity = parity or ParityTracker(cfg.parity)
        self.gate = CapacityGate(
            cfg.limits.queue_size, cfg.limits.queue_timeout_s, on_depth=self.m.queue_depth.set
        )
        self.active = 0
        """Requests held right now (reading, routing, queued or proxied)."""
        self.held_host: HeldCount | None = None
        """The host's count of held requests (several workers: ``limits.max_requests`` bounds them all)."""
        self._ids = itertools.count()
        self.id_prefix = "r"
        """Request ids are ``<prefix><n>``: unique in this process (each worker of a host has its own)."""

    # ------------------------------------------------------------------ admission
    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold one request for its whole life.  Past ``limits.max_requests`` held at once, ``Overloaded``
        before the body is even read: when the router's own CPU is the bottleneck nothing else bounds its
        backlog, and a rejection costs a fraction of a routed request, so the requests it keeps are served
        at a bounded latency."""
        cap = self.cfg.limits.max_requests
        host = self.held_host
        if cap and (self.active if host is None else host.held_total()) >= cap:
            raise self.rejected(
                Overloaded(f"the gateway holds {cap} requests already", reason="gateway_full")
            )
        self.active += 1
        if host is not None:
            host.add_held(1)
        try:
            yield
        finally:
            self.active -= 1
            if host is not None:
                host.add_held(-1)

    def rejected(self, err: Overloaded | ServiceUnavailable) -> Overloaded | ServiceUnavailable:
        """Count a rejection by its reason; returns it for the caller to raise."""
        self.m.rejections.labels(err.reason).inc()
        return err

    # ------------------------------------------------------------------ prepare
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
        self, raw: bytes, kind: Kind | None, headers: Mapping[str, str], *, operator: bool = False
    ) -> Prepared:
        """Everything the decision reads, from the body and headers as the client sent them."""
        t0 = time.perf_counter()
        req = parse_body(raw, kind, headers.get(SAGEMAKER_AFFINITY))
        salt = self.tenant_salt(headers.get("Authorization"), operator=operator)
        if salt is not None and req.cache_salt != salt:
            # A tenant's salt is enforced, never chosen by the client: its cache stays its own.
            req.set_salt(salt)
        if not self.fleet.known_model(req.model):
            raise NotFound(f"model {req.model!r} is not served by this fleet", param="model")
        tokens = await self.tokens.tokens(req)
        chains = None
        # While the fleet renders this model differently, its token ids predict nothing: route it by
        # prefix text and load until the parity checks pass again.
        if tokens is not None and self.parity.trusted(req.model):
            chains = request_chains(
                tokens, self.cfg.block_size, lora_name=req.lora_name, cache_salt=req.cache_salt
            )
        inp = route_input(
            RequestId(f"{self.id_prefix}{next(self._ids)}"),
            chains=chains,
            num_tokens=len(tokens) if tokens is not None else None,
            prefix_text=req.prefix_text(),
            affinity=req.affinity,
            model=req.model,
            prefix_length=self.cfg.routing.prefix_hash.prefix_length,
        )
        remote = await self.remote(req, tokens) if self.remote is not None and tokens is not None else None
        return Prepared(req, inp, tokens, remote, t0)

    def prepare_bodyless(self) -> Prepared:
        """A request without a body (a GET through a gateway that sends every request to its picker):
        no model, no prompt, so the policy decides by load among every target."""
        t0 = time.perf_counter()
        req = ParsedRequest("completions", {}, b"")
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
    ) -> Decision:
        """The router's decision among the model's targets, without ``exclude`` and (if given) only among
        ``only`` (a front door's candidate subset)."""
        targets = [
            t
            for t in self.fleet.targets(p.inp.model)
            if t.key not in exclude and (only is None or t.key in only)
        ]
        return self.router.route(
            p.inp, targets, time.monotonic(), dry_run=dry_run, remote=p.remote, shadow=shadow
        )

    async def admit(self, p: Prepared, *, only: Collection[str] | None = None) -> Decision:
        """A decision with a target, waiting for capacity in the gate if every target is at its cap.
        ``Overloaded`` (queue full or timed out), ``ServiceUnavailable`` (no healthy target)."""

        def attempt() -> Decision | None:
            d = self.decide(p, only=only, shadow=False)
            return None if d.reason == "at_capacity" else d

        try:
            d = await self.gate.acquire(attempt)  # (the gate keeps the queue-depth gauge)
        except QueueFull as e:
            raise self.rejected(
                Overloaded(f"all instances at capacity ({e.reason})", reason=e.reason)
            ) from None
        self._record(d)
        self.m.decision_seconds.observe(time.perf_counter() - p.started)
        if d.chosen is None:
            raise self.rejected(ServiceUnavailable("no healthy instance serves this model", reason=d.reason))
        self.m.prompt_tokens.inc(p.inp.num_tokens)
        return d

    def reroute(self, p: Prepared, tried: Collection[str]) -> Candidate | None:
        """The next-best target after failed attempts on ``tried`` (None: no other)."""
        return self.decide(p, tried).chosen

    def _record(self, d: Decision) -> None:
        self.m.decisions.labels(d.policy, d.reason).inc()
        if d.reason == "spill":
            self.m.spills.inc()
        if d.chosen is None:
            return
        if d.shadow_basis is not None:
            # Deferred: scored when this task next yields (its upstream request is being sent by then).
            asyncio.get_running_loop().call_soon(self._record_shadow, d)
        else:
            self._record_shadow(d)

    def _record_shadow(self, d: Decision) -> None:
        assert d.chosen is not None
        self.m.shadow_cached.labels(d.policy).inc(d.chosen.cached_tokens)
        for name, sh in self.router.shadow(d).items():
            self.m.shadow_cached.labels(name).inc(sh.cached_tokens)
            if sh.target == d.chosen.target:
                self.m.shadow_agree.labels(name).inc()

    # ------------------------------------------------------------------ account
    def dispatched(self, p: Prepared, chosen: Candidate) -> None:
        """The request is on its way to ``chosen``."""
        self.router.dispatched(p.inp, chosen, time.monotonic())
        self.m.predicted_cached.labels(chosen.target).inc(chosen.cached_tokens)
        self.parity.routed(p.req, p.tokens, chosen.instance)

    def first_token(self, p: Prepared) -> None:
        self.router.first_token(p.inp.request_id)

    def finished(self, p: Prepared, chosen: Candidate, usage: UsageReport | None = None) -> None:
        """The attempt on ``chosen`` is over (answered, failed or abandoned): its load is released and a
        waiting request may take the freed capacity.  ``usage``: what vLLM reported, if it did."""
        self.router.finished(p.inp.request_id)
        self.gate.release()
        if usage is not None and usage.cached_tokens is not None:
            self.m.reported_cached.labels(chosen.target).inc(usage.cached_tokens)
            self.m.cached_error.observe(chosen.cached_tokens - usage.cached_tokens)
            self.parity.shortfall(
                p.req,
                p.tokens,
                chosen.instance,
                chosen.cached_tokens,
                usage.cached_tokens,
                self.cfg.block_size,
            )

    def released(self) -> None:
        """Capacity was freed outside a request (an instance became healthy): wake a waiting request."""
        self.gate.release()


def explain(p: Prepared, d: Decision, elapsed_s: float) -> dict[str, Any]:
    """``/v1/route/explain``: every candidate's cache, tiers, load, trust and score."""
    return {
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
                "tiers": {
                    "GPU": c.gpu_blocks,
                    "offload": c.offload_blocks,
                    "speculative": c.speculative_blocks,
                },
                "matched_blocks": c.matched_blocks,
                "trust": c.trust,
                "in_flight": c.in_flight,
                "pending_prefill_tokens": c.pending_prefill_tokens,
                "decoding": c.decoding,
                "saturated": c.saturated,
                "score": c.score,
            }
            for c in d.ranked
        ],
        "shadow": {k: {"target": v.target, "cached_tokens": v.cached_tokens} for k, v in d.shadow.items()},
        "decision_ms": round(elapsed_s * 1e3, 3),
    }
