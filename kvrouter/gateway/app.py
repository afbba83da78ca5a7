"""The gateway app: OpenAI routes, SageMaker's container contract, observability, and its lifecycle.

POST /v1/completions  /v1/chat/completions     routed and proxied (streaming passed through)
POST /invocations  GET /ping                   Amazon SageMaker's contract (OpenAI-shaped bodies)
GET  /v1/models                                aggregated over the fleet
GET  /health  /metrics                         liveness with fleet state; Prometheus text
POST /v1/route/explain                         every candidate's cache, tier, load, trust, score
POST /v1/cache/lookup  GET /v1/fleet           the embedded indexer's API
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from indexer import Indexer, LookupResult
from indexer import service as ixs
from indexer.config import InstanceConfig
from indexer.hashing import TokenIds, id_list
from indexer.metrics import IndexerCollector
from indexer.subscriber import EventSubscriber

from ..config import RouterFleetConfig
from ..membership import MembershipRuntime
from ..membership.metrics import MembershipCollector
from ..replicas import SharedState, WarmRestart, mark_restored, store_for
from ..routing import RouteInput, Router
from ..routing.policies import Candidate
from ..routing.router import Decision
from ..types import RequestId
from .gate import CapacityGate, QueueFull
from .metrics import GatewayMetrics
from .proxy import Proxy
from .requests import BadRequest, Kind, ParsedRequest, parse_body
from .tokens import PassThroughTokens, TokenSource, block_chains
from .upstream import UpstreamPool

log = logging.getLogger("kvrouter.gateway")

SAGEMAKER_AFFINITY = "X-Amzn-SageMaker-Prefix-Aware-Id"
_ADMIN_PATHS = ("/v1/route/explain", "/v1/cache/lookup", "/v1/fleet")


def _same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison: how long a wrong token takes to refuse says nothing about the right one."""
    return hmac.compare_digest(given.encode(), expected.encode())


class Gateway:
    """Everything one gateway process holds.  Built by ``build_gateway``; lives as long as the app."""

    def __init__(
        self,
        cfg: RouterFleetConfig,
        *,
        tokens: TokenSource | None = None,
        policy: str | None = None,
        subscribe: bool = True,
        fleet_path: str | None = None,
    ) -> None:
        self.cfg = cfg
        o = cfg.indexer
        self.indexer = Indexer(
            cfg.block_size, max_blocks_per_source=o.max_blocks_per_source, speculative_ttl=o.speculative_ttl_s
        )
        # With a remote indexer, events are indexed there; this router keeps only its speculative entries.
        remote_index = cfg.gateway.indexer_url is not None
        self.subscriber = EventSubscriber(self.indexer, cfg) if subscribe and not remote_index else None
        self.router = Router(self.indexer, cfg.router_config(policy))
        self.metrics = GatewayMetrics()
        self.metrics.registry.register(IndexerCollector(self.indexer, self.subscriber))
        g = cfg.gateway
        self.pool = UpstreamPool(
            cfg.instances,
            self.router.load,
            health_interval_s=g.health_interval_s,
            metrics_interval_s=g.metrics_interval_s,
            failure_threshold=g.failure_threshold,
            ejection_s=g.ejection_s,
            ejection_max_s=g.ejection_max_s,
            on_change=self._health_changed,
            on_eject=lambda name, _span: self.metrics.ejections.labels(name).inc(),
        )
        self.tokens = tokens or PassThroughTokens()
        rep = cfg.replicas
        self.shared = SharedState(self.router, rep, registry=self.metrics.registry) if rep.redis_url else None
        store = store_for(cfg.snapshot, rep.redis_url)
        self.warm = (
            WarmRestart(
                self.indexer, store, interval_s=cfg.snapshot.interval_s, registry=self.metrics.registry
            )
            if store is not None and self.subscriber is not None
            else None
        )
        self.gate = CapacityGate(cfg.limits.queue_size, cfg.limits.queue_timeout_s)
        self.membership = MembershipRuntime(
            self.pool,
            self.indexer,
            self.subscriber,
            cfg,
            fleet_path=fleet_path,
            options=cfg.membership,
            discovery=cfg.discovery,
            on_added=self._instance_added,
            on_removed=self._instance_removed,
        )
        self.metrics.registry.register(MembershipCollector(self.membership))
        self._ids = itertools.count()
        self.active = 0
        """OpenAI requests held right now (reading, routing, queued or proxied)."""
        self.session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None

    def _health_changed(self, name: str, healthy: bool) -> None:
        for t in self.pool.upstreams[name].targets():
            self.metrics.healthy.labels(t.key).set(1 if healthy else 0)
        if healthy:
            self.gate.release()

    def _instance_added(self, inst: InstanceConfig) -> None:
        u = self.pool.upstreams.get(inst.name)
        if u is not None:
            self._health_changed(inst.name, u.healthy)

    def _instance_removed(self, inst: InstanceConfig) -> None:
        keys = [inst.name] if inst.dp_size == 1 else [f"{inst.name}/{r}" for r in range(inst.dp_size)]
        for key in keys:
            for gauge in (self.metrics.healthy, self.metrics.in_flight):
                with contextlib.suppress(KeyError):
                    gauge.remove(key)

    def _finished(self) -> None:
        self.gate.release()
        self.metrics.queue_depth.set(self.gate.waiting)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=10, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        g = self.cfg.gateway
        self.proxy = Proxy(
            self.session,
            self.pool,
            self.router,
            self.metrics,
            first_byte_timeout_s=g.first_byte_timeout_s,
            chunk_timeout_s=g.chunk_timeout_s,
            connect_timeout_s=g.connect_timeout_s,
            max_retries=g.max_retries,
            upstream_api_key=g.upstream_api_key,
            on_finish=self._finished,
        )
        restored = []
        if self.warm is not None:
            only = None if self.cfg.bind else [s for i in self.cfg.instances for s in i.sources()]
            restored = await self.warm.restore(only=only)
        if self.subscriber:
            await self.subscriber.start()
            if restored:
                mark_restored(self.subscriber, restored, time.monotonic())
        if self.warm is not None:
            await self.warm.start()
        if self.shared is not None:
            await self.shared.start()
        await self.tokens.warm(self.cfg.served_models())
        await self.pool.start(self.session)
        for u in self.pool.upstreams.values():
            self._health_changed(u.name, u.healthy)
        await self.membership.start(self.session)

    async def stop(self) -> None:
        await self.membership.stop()
        if self.shared is not None:
            await self.shared.stop()
        await self.pool.stop()
        if self.subscriber:
            await self.subscriber.stop()
        if self.warm is not None:
            await self.warm.stop()
        if self.session:
            await self.session.close()

    # ------------------------------------------------------------------ the request path
    def tenant_salt(self, request: web.Request) -> str | None:
        """The salt of the caller's API key (401 if keys are required and this one is unknown)."""
        t = self.cfg.tenants
        if not t.api_keys and not t.require_api_key:
            return None
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        tenant = t.api_keys.get(key)
        admin = self.cfg.gateway.admin_token
        if tenant is None and admin and _same_secret(key, admin) and request.path in _ADMIN_PATHS:
            return None  # an operator on an admin route (explain): no tenant of its own
        if tenant is None:
            if t.require_api_key:
                raise BadRequest("missing or unknown API key", status=401)
            return None
        return tenant.salt

    async def prepare(
        self, request: web.Request, kind: Kind | None
    ) -> tuple[ParsedRequest, RouteInput, TokenIds | None]:
        raw = await request.read()
        req = parse_body(raw, kind, request.headers.get(SAGEMAKER_AFFINITY))
        salt = self.tenant_salt(request)
        if salt is not None and req.cache_salt != salt:
            # A tenant's salt is enforced, never chosen by the client: its cache stays its own.
            req.body["cache_salt"] = req.cache_salt = salt
            req.modified = True
        if not self.pool.known_model(req.model):
            raise BadRequest(f"model {req.model!r} is not served by this fleet", status=404)
        tokens = await self.tokens.tokens(req)
        chains = None
        if tokens is not None:
            chains = block_chains(
                tokens, self.cfg.block_size, cache_salt=req.cache_salt, lora_name=req.lora_name
            )
        text = req.prefix_text()[: self.cfg.routing.prefix_hash.prefix_length]
        key = ((req.affinity or "") + "\x00" + text).encode()
        n = len(tokens) if tokens is not None else max(1, len(text) // 4)
        inp = RouteInput(RequestId(f"r{next(self._ids)}"), n, chains, key, req.model)
        return req, inp, tokens

    def decide(
        self,
        inp: RouteInput,
        exclude: set[str] | None = None,
        *,
        dry_run: bool = False,
        remote: LookupResult | None = None,
        shadow: bool = True,
    ) -> Decision:
        targets = [t for t in self.pool.targets(inp.model) if not exclude or t.key not in exclude]
        return self.router.route(
            inp, targets, time.monotonic(), dry_run=dry_run, remote=remote, shadow=shadow
        )

    async def remote_lookup(self, req: ParsedRequest, tokens: TokenIds | None) -> LookupResult | None:
        """With ``gateway.indexer_url``: the remote indexer's answer (None if it cannot be had: the router
        then routes this request on load alone, and says so in its metrics)."""
        url = self.cfg.gateway.indexer_url
        if not url or tokens is None or self.session is None:
            return None
        body = {"token_ids": id_list(tokens), "cache_salt": req.cache_salt, "lora_name": req.lora_name}
        try:
            async with self.session.post(
                f"{url.rstrip('/')}/v1/cache/lookup", json=body, timeout=aiohttp.ClientTimeout(total=0.5)
            ) as r:
                if r.status != 200:
                    raise ValueError(f"status {r.status}")
                return msgspec.json.decode(await r.read(), type=LookupResult)
        except (aiohttp.ClientError, TimeoutError, ValueError, msgspec.DecodeError) as e:
            self.metrics.rejections.labels("remote_index_unavailable").inc()
            log.warning("remote indexer lookup failed", extra={"error": str(e)})
            return None

    def record_decision(self, d: Decision) -> None:
        self.metrics.decisions.labels(d.policy, d.reason).inc()
        if d.reason == "spill":
            self.metrics.spills.inc()
        if d.chosen is None:
            return
        if d.shadow_basis is not None:
            # Deferred: scored when this task next yields (its upstream request is being sent by then).
            asyncio.get_running_loop().call_soon(self.record_shadow, d)
        else:
            self.record_shadow(d)

    def record_shadow(self, d: Decision) -> None:
        assert d.chosen is not None
        self.metrics.shadow_cached.labels(d.policy).inc(d.chosen.cached_tokens)
        for name, sh in self.router.shadow(d).items():
            self.metrics.shadow_cached.labels(name).inc(sh.cached_tokens)
            if sh.target == d.chosen.target:
                self.metrics.shadow_agree.labels(name).inc()

    def overloaded(self, reason: str, message: str) -> web.Response:
        """A 429 with Retry-After: the client should come back, not wait here."""
        self.metrics.rejections.labels(reason).inc()
        return web.json_response(
            {"error": {"message": message, "type": "overloaded", "code": 429}},
            status=429,
            headers={"Retry-After": str(self.cfg.limits.retry_after_s)},
        )

    async def route_and_forward(
        self, request: web.Request, kind: Kind | None, path_of: Callable[[ParsedRequest], str]
    ) -> web.StreamResponse:
        """Admission first: past ``limits.max_requests`` held at once, a 429 before the body is even read.
        When the gateway's own CPU is the bottleneck nothing else bounds its backlog, and a rejection costs
        a fraction of a routed request, so the requests it keeps are served at a bounded latency."""
        cap = self.cfg.limits.max_requests
        if cap and self.active >= cap:
            return self.overloaded("gateway_full", f"the gateway holds {cap} requests already")
        self.active += 1
        try:
            return await self._route_and_forward(request, kind, path_of)
        finally:
            self.active -= 1

    async def _route_and_forward(
        self, request: web.Request, kind: Kind | None, path_of: Callable[[ParsedRequest], str]
    ) -> web.StreamResponse:
        t0 = time.perf_counter()
        req, inp, tokens = await self.prepare(request, kind)
        remote = await self.remote_lookup(req, tokens)

        def attempt() -> Decision | None:
            d = self.decide(inp, remote=remote, shadow=False)
            return None if d.reason == "at_capacity" else d

        self.metrics.queue_depth.set(self.gate.waiting + 1)
        try:
            d = await self.gate.acquire(attempt)
        except QueueFull as e:
            return self.overloaded(e.reason, f"all instances at capacity ({e.reason})")
        finally:
            self.metrics.queue_depth.set(self.gate.waiting)
        self.record_decision(d)
        decision_s = time.perf_counter() - t0
        self.metrics.decision_seconds.observe(decision_s)
        if d.chosen is None:
            self.metrics.rejections.labels(d.reason).inc()
            return web.json_response(
                {
                    "error": {
                        "message": "no healthy instance serves this model",
                        "type": "unavailable",
                        "code": 503,
                    }
                },
                status=503,
                headers={"Retry-After": str(self.cfg.limits.retry_after_s)},
            )
        self.metrics.prompt_tokens.inc(inp.num_tokens)

        async def reroute(tried: set[str]) -> Candidate | None:
            nd = self.decide(inp, tried)
            return nd.chosen

        assert self.proxy is not None
        extra = {
            "x-kvrouter-policy": d.policy,
            "x-kvrouter-reason": d.reason,
            "x-kvrouter-decision-ms": f"{decision_s * 1e3:.3f}",
        }
        log.debug("routed", extra={"request": inp.request_id, "target": d.chosen.target, "reason": d.reason})
        return await self.proxy.forward(request, req, inp, d.chosen, reroute, path_of(req), extra)


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


def _err(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status
    )


@web.middleware
async def errors_mw(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    token = gw.cfg.gateway.admin_token
    if (
        token
        and request.path in _ADMIN_PATHS
        and not _same_secret(request.headers.get("Authorization", ""), f"Bearer {token}")
    ):
        gw.metrics.requests.labels(route, "401").inc()
        return _err(401, "admin token required")
    try:
        resp = await handler(request)
    except BadRequest as e:
        resp = _err(e.status, e.reason)
    except web.HTTPException as e:
        if e.status >= 400 and not e.text:
            e.text = f'{{"error": {{"message": "{e.reason}", "code": {e.status}}}}}'
            e.content_type = "application/json"
        gw.metrics.requests.labels(route, str(e.status)).inc()
        raise
    except ConnectionResetError:
        raise  # the client went away: nothing to answer (cancellation is a BaseException, never caught here)
    except Exception as e:
        # A bug, not the client's fault: answered as a well-formed JSON 500 (never aiohttp's bare page),
        # logged with its traceback but without the request's contents, and counted.
        log.exception("internal error", extra={"route": route, "error": type(e).__name__})
        gw.metrics.internal_errors.labels(type(e).__name__).inc()
        resp = web.json_response(
            {
                "error": {
                    "message": f"internal error ({type(e).__name__})",
                    "type": "internal_error",
                    "code": 500,
                }
            },
            status=500,
        )
    gw.metrics.requests.labels(route, str(resp.status)).inc()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].route_and_forward(request, "completions", lambda r: "/v1/completions")


async def chat(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].route_and_forward(request, "chat", lambda r: "/v1/chat/completions")


async def invocations(request: web.Request) -> web.StreamResponse:
    paths = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
    return await request.app[GATEWAY].route_and_forward(request, None, lambda r: paths[r.kind])


async def livez(request: web.Request) -> web.Response:
    """Liveness: the event loop answers (unlike /health, not tied to the fleet's state)."""
    return web.Response(text="ok")


async def ping(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    up = any(u.healthy and not u.draining for u in gw.pool.upstreams.values())
    return web.Response(status=200 if up else 503)


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    ups = {
        u.name: {"healthy": u.healthy, "failures": u.failures, "models": u.cfg.models or u.served_models}
        for u in gw.pool.upstreams.values()
    }
    healthy = sum(1 for u in gw.pool.upstreams.values() if u.healthy)
    body = {
        "status": "ok" if healthy else "no_healthy_instance",
        "instances": ups,
        "index": ixs.source_state(gw.indexer, gw.subscriber),
        "block_size_mismatch": {k.label(): v for k, v in gw.indexer.block_size_mismatch.items()},
        "membership": gw.membership.state(),
    }
    return web.json_response(body, status=200 if healthy else 503)


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    data = [{"id": m, "object": "model", "owned_by": "kvrouter"} for m in gw.pool.models()]
    return web.json_response({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    for key, load in gw.router.load.loads.items():
        gw.metrics.in_flight.labels(key).set(load.effective_in_flight())
    gw.metrics.loop_tasks.set(len(asyncio.all_tasks()))
    return web.Response(
        body=generate_latest(gw.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def explain(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    t0 = time.perf_counter()
    req, inp, tokens = await gw.prepare(request, None)
    d = gw.decide(inp, dry_run=True, remote=await gw.remote_lookup(req, tokens))
    out: dict[str, Any] = {
        "policy": d.policy,
        "reason": d.reason,
        "choice": None if d.chosen is None else d.chosen.target,
        "predicted_cached_tokens": d.predicted_cached_tokens,
        "num_tokens": inp.num_tokens,
        "tokenized": inp.chains is not None,
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
        "decision_ms": round((time.perf_counter() - t0) * 1e3, 3),
    }
    return web.json_response(out)


def build_gateway(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.cfg.limits.max_body_bytes, middlewares=[errors_mw])
    app[GATEWAY] = gw
    # the indexer's own handlers, on this gateway's indexer
    app[ixs.INDEXER] = gw.indexer
    app[ixs.SUBSCRIBER] = gw.subscriber
    encoder = gw.tokens if isinstance(gw.tokens, ixs.PromptEncoder) else None
    app[ixs.ENCODER] = encoder
    app[ixs.REGISTRY] = gw.metrics.registry

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await gw.start()
        yield
        with contextlib.suppress(asyncio.CancelledError):
            await gw.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/invocations", invocations)
    app.router.add_get("/ping", ping)
    app.router.add_get("/livez", livez)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/route/explain", explain)
    app.router.add_post("/v1/cache/lookup", ixs.lookup)
    app.router.add_get("/v1/fleet", ixs.fleet)
    return app
