"""The gateway's HTTP routes: thin shells around the request pipeline and the gateway's state.

POST /v1/completions  /v1/chat/completions     routed and proxied (streaming passed through)
POST /v1/responses  /v1/messages  /v1/messages/count_tokens   the same (their chat request is tokenized)
POST /v1/embeddings /pooling /classify /score /v1/score /rerank /v1/rerank /v2/rerank /v2/embed
                                               by model and load (kv-aware on a single text input)
GET  /v1/responses/{id}  POST .../cancel       to the instance holding it (``surface``)
POST /v1/load_lora_adapter /v1/unload_lora_adapter   to the instances concerned (``adapters``)
POST /v1/audio/transcriptions /v1/audio/translations multipart, streamed through (``surface``)
*    anything else (/tokenize, /version, ...)  by model and load (``surface``)
POST /invocations  GET /ping                   Amazon SageMaker's contract (OpenAI-shaped bodies)
GET  /v1/models                                aggregated over the fleet
GET  /health  /livez  /metrics                 fleet state and token parity; loop liveness; Prometheus
POST /v1/route/explain                         every candidate's cache, tier, load, trust, score
POST /v1/cache/lookup  GET /v1/fleet           the embedded indexer's API (+ token parity per model)

Every error is answered by ``errors_mw`` with the one error body (``api.errors``): a client's mistake is a
4xx with a reason, a bug a counted, logged 500 that carries no request contents.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from indexer import service as ixs

from ..api.errors import ApiError, InternalError, Overloaded, ServiceUnavailable, Unauthorized, error_body
from ..api.messages import anthropic_error_body
from ..pipeline import explain as explain_body
from ..pipeline.pipeline import same_secret
from .app import Gateway
from .forwarding import GATEWAY, route_and_forward, routed
from .surface import add_surface_routes

log = logging.getLogger("kvrouter.gateway")

ADMIN_PATHS = frozenset(
    {
        "/v1/route/explain",
        "/v1/cache/lookup",
        "/v1/fleet",
        # vLLM's operator routes, passed through to the instances: never a client's to call
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/sleep",
        "/wake_up",
        "/pause",
        "/resume",
        "/collective_rpc",
        "/scale_elastic_ep",
        "/start_profile",
        "/stop_profile",
    }
)
"""Routes that need ``gateway.admin_token`` when one is set."""


def error_response(e: ApiError, retry_after_s: float | None = None, *, path: str = "") -> web.Response:
    """The error answer, in the route's own shape (vLLM answers the Messages routes Anthropic's way)."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    body = anthropic_error_body(e.status, e.message) if path.startswith("/v1/messages") else e.body()
    return web.Response(body=body, status=e.status, content_type="application/json", headers=headers)


@web.middleware
async def errors_mw(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    token = gw.cfg.gateway.admin_token
    if (
        token
        and request.path in ADMIN_PATHS
        and not same_secret(request.headers.get("Authorization", ""), f"Bearer {token}")
    ):
        gw.metrics.requests.labels(route, "401").inc()
        return error_response(Unauthorized("admin token required"))
    try:
        resp = await handler(request)
    except (Overloaded, ServiceUnavailable) as e:
        # The client should come back, not wait here.
        resp = error_response(e, gw.cfg.limits.retry_after_s, path=request.path)
    except ApiError as e:
        resp = error_response(e, path=request.path)
    except web.HTTPException as e:
        if e.status >= 400 and not e.text:
            e.text = error_body(e.status, e.reason).decode()
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
        resp = error_response(InternalError(f"internal error ({type(e).__name__})"), path=request.path)
    gw.metrics.requests.labels(route, str(resp.status)).inc()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await route_and_forward(request, "completions", lambda r: "/v1/completions")


async def chat(request: web.Request) -> web.StreamResponse:
    return await route_and_forward(request, "chat", lambda r: "/v1/chat/completions")


POOLING_ROUTES = (
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v2/embed",
)


async def invocations(request: web.Request) -> web.StreamResponse:
    paths = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
    return await route_and_forward(request, None, lambda r: paths[r.kind])


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
        "token_parity": gw.pipeline.parity.state(),
    }
    if gw.host_state is not None:
        body["worker"] = gw.host_state()
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
    gw.metrics.loop_lag.set(gw.lag.standing_s)
    gw.metrics.loop_demand.set(gw.lag.demand)
    gw.metrics.loop_stall_max.set(gw.lag.max_s)
    return web.Response(
        body=generate_latest(gw.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def fleet(request: web.Request) -> web.Response:
    """The indexer's view of every source, and the token parity of every model."""
    gw = request.app[GATEWAY]
    body = {
        "block_size": gw.indexer.block_size,
        "sources": ixs.source_state(gw.indexer, gw.subscriber),
        "token_parity": gw.pipeline.parity.state(),
    }
    return web.json_response(body)


async def explain(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    p = await gw.pipeline.prepare(await request.read(), None, request.headers, operator=True)
    d = gw.pipeline.decide(p, dry_run=True)
    plan = gw.pipeline.plan(p, dry_run=True) if gw.pipeline.disaggregated(p) else None
    elapsed = time.perf_counter() - p.started
    return web.json_response(explain_body(p, d, elapsed, plan, gw.router.tier_values))


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
    app.router.add_post("/v1/responses", routed("responses"))
    app.router.add_post("/v1/messages", routed("messages"))
    app.router.add_post("/v1/messages/count_tokens", routed("count_tokens"))
    for path in POOLING_ROUTES:
        app.router.add_post(path, routed("pooling"))
    app.router.add_post("/invocations", invocations)
    app.router.add_get("/ping", ping)
    app.router.add_get("/livez", livez)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/route/explain", explain)
    app.router.add_post("/v1/cache/lookup", ixs.lookup)
    app.router.add_get("/v1/fleet", fleet)
    add_surface_routes(app)  # last: it ends with the catch-all
    return app
