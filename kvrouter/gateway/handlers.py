"""The gateway's HTTP routes: thin shells around the request pipeline and the gateway's state.

POST every path of ``api.routes.ROUTED``       routed by the prompt and proxied (streaming passed through)
GET  /v1/responses/{id}  POST .../cancel       to the instance holding it (``surface``)
POST /v1/load_lora_adapter /v1/unload_lora_adapter   to the instances concerned (``adapters``)
POST /v1/audio/transcriptions /v1/audio/translations multipart, streamed through (``surface``)
*    anything else (/tokenize, /version, ...)  by model and load (``surface``)
POST /invocations  GET /ping                   Amazon SageMaker's contract (OpenAI-shaped bodies)
GET  /v1/models  /health  /livez  /metrics     the fleet's models; fleet state and parity; liveness; metrics
POST /v1/route/explain                         every candidate's cache, tier, load, trust, score
POST /v1/cache/lookup  GET /v1/fleet           the embedded indexer's API (+ token parity per model)

``api.routes.ADMIN_PATHS`` need ``gateway.admin_token`` when one is set.  Every error is answered by
``errors_mw`` with the one error body (``api.errors``): a client's mistake is a 4xx with a reason, a bug
a counted, logged 500 that carries no request contents.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from indexer import service as index_service

from ..api.errors import ApiError, Unauthorized, error_body
from ..api.routes import INVOCATION_PATHS, ROUTED
from ..pipeline import explain as explain_body
from .app import Gateway
from .downstream import error_answer, internal_error
from .forwarding import GATEWAY, forward_request, routed
from .surface import add_surface_routes

log = logging.getLogger("kvrouter.gateway")


def error_response(e: ApiError, retry_after_s: float | None = None, *, path: str = "") -> web.Response:
    """The error answer, in the route's own shape (``downstream.error_answer``)."""
    status, headers, body = error_answer(e, retry_after_s, path)
    return web.Response(body=body, status=status, headers=headers)


@web.middleware
async def errors_mw(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    if not gw.pipeline.admin_allowed(request.path, request.headers.get("Authorization")):
        gw.metrics.requests.labels(route, "401").inc()
        return error_response(Unauthorized("admin token required"))
    try:
        resp = await handler(request)
    except ApiError as e:
        # Overloaded, unavailable: the client should come back (Retry-After), not wait here.
        resp = error_response(e, gw.cfg.limits.retry_after_s, path=request.path)
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
        gw.metrics.internal_errors.labels(type(e).__name__).inc()
        resp = error_response(internal_error(e, route), path=request.path)
    gw.metrics.requests.labels(route, str(resp.status)).inc()
    return resp


async def invocations(request: web.Request) -> web.StreamResponse:
    return await forward_request(request, None, lambda r: INVOCATION_PATHS[r.kind])


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
    events = gw.events_state()
    # Deaf or refused event sources leave the gateway serving (200), but never quietly: "events_degraded".
    degraded = bool(events["deaf"] or events["refused"])
    body = {
        "status": ("events_degraded" if degraded else "ok") if healthy else "no_healthy_instance",
        "instances": ups,
        "events": events,
        "index": index_service.source_state(gw.indexer, gw.subscriber),
        "block_size_mismatch": {k.label(): v for k, v in gw.indexer.block_size_mismatch.items()},
        "membership": gw.membership.state(),
        "token_parity": gw.pipeline.parity.state(),
    }
    if gw.host_state is not None:
        # This worker's own answers (its /metrics shows the host's): how the kernel spread connections.
        answered = {
            f"{s.labels['route']} {s.labels['status']}": int(s.value)
            for fam in gw.metrics.requests.collect()
            for s in fam.samples
            if s.name.endswith("_total")
        }
        body["worker"] = {**gw.host_state(), "answered": answered}
    replicas = gw.replicas_state()
    if replicas is not None:
        body["replicas"] = replicas
    return web.json_response(body, status=200 if healthy else 503)


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    data = [{"id": m, "object": "model", "owned_by": "kvrouter"} for m in gw.pool.models()]
    return web.json_response({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus: one process's registry, or the host's (every worker's, merged: ``kvrouter.host``)."""
    body, content_type = await request.app[GATEWAY].exposition(request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def fleet(request: web.Request) -> web.Response:
    """The indexer's view of every source, the token parity of every model, and the latency models (with
    several workers, the host's: every worker trains and reads the same ones)."""
    gw = request.app[GATEWAY]
    body = {
        "block_size": gw.indexer.block_size,
        "sources": index_service.source_state(gw.indexer, gw.subscriber),
        "token_parity": gw.pipeline.parity.state(),
        "latency": gw.router.latency.state(),
    }
    if gw.host_state is not None:
        body["worker"] = gw.host_state()["worker"]
    return web.json_response(body)


async def explain(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    p = await gw.pipeline.prepare(await request.read(), None, request.headers, operator=True)
    gw.pipeline.set_reserved(p, dry_run=True)
    d = gw.pipeline.decide(p, dry_run=True)
    gw.router.predict(p.inp.num_tokens, d.ranked)  # whatever the policy, its latency models' view
    plan = gw.pipeline.plan(p, dry_run=True) if gw.pipeline.disaggregated(p) else None
    elapsed = time.perf_counter() - p.started
    keys = frozenset(t.key for t in gw.pipeline.fleet.targets(p.inp.model) or ())
    quiet = gw.router.quiet.of(keys) if gw.router.config.isolation.on else ()
    return web.json_response(explain_body(p, d, elapsed, plan, gw.router.tier_values, quiet))


def build_gateway(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.cfg.limits.max_body_bytes, middlewares=[errors_mw])
    app[GATEWAY] = gw
    # the indexer's own handlers, on this gateway's indexer
    app[index_service.INDEXER] = gw.indexer
    app[index_service.SUBSCRIBER] = gw.subscriber
    encoder = gw.tokens if isinstance(gw.tokens, index_service.PromptEncoder) else None
    app[index_service.ENCODER] = encoder
    app[index_service.REGISTRY] = gw.metrics.registry

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await gw.start()
        yield
        with contextlib.suppress(asyncio.CancelledError):
            await gw.stop()

    app.cleanup_ctx.append(lifecycle)

    async def closing(app: web.Application) -> None:
        gw.closing()

    app.on_shutdown.append(closing)
    for path, kind in ROUTED.items():
        app.router.add_post(path, routed(kind))
    app.router.add_post("/invocations", invocations)
    app.router.add_get("/ping", ping)
    app.router.add_get("/livez", livez)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/route/explain", explain)
    app.router.add_post("/v1/cache/lookup", index_service.lookup)
    app.router.add_get("/v1/fleet", fleet)
    add_surface_routes(app)  # last: it ends with the catch-all
    return app
