"""Routing one request and forwarding it: the step every proxied route shares.

::

    read body ──▶ RequestPipeline.prepare ──▶ [pinned instance] ──▶ adapter loaded on demand ──▶ admit
              ──▶ Proxy.forward (x-kvrouter-policy / -reason / -decision-ms on the answer)
    (a disaggregated model: admit_plan ──▶ DisaggProxy, its prefill and decode legs)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..api.errors import ApiError
from ..api.requests import Kind, ParsedRequest
from ..telemetry import RequestRecord
from .app import Gateway
from .proxy import BodySource

log = logging.getLogger("kvrouter.gateway")

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


async def route_and_forward(
    request: web.Request,
    kind: Kind | None,
    path_of: Callable[[ParsedRequest], str],
    *,
    raw: bytes | None = None,
    body: BodySource | None = None,
    stored: str | None = None,
) -> web.StreamResponse:
    """Prepare, admit and forward one request (the body read here unless ``raw`` is given; ``body``: what
    to send instead of the parsed body; ``stored``: a stored response id, the request goes where it is)."""
    gw = request.app[GATEWAY]
    pl = gw.pipeline
    rec = pl.begin(request.path, request.headers)
    if rec is None:
        return await _route_and_forward(request, gw, kind, path_of, raw, body, stored, None)
    status = 500
    try:
        resp = await _route_and_forward(request, gw, kind, path_of, raw, body, stored, rec)
        status = resp.status
        return resp
    except ApiError as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away before its answer
        raise
    finally:
        pl.end(rec, status)


async def _route_and_forward(
    request: web.Request,
    gw: Gateway,
    kind: Kind | None,
    path_of: Callable[[ParsedRequest], str],
    raw: bytes | None,
    body: BodySource | None,
    stored: str | None,
    rec: RequestRecord | None,
) -> web.StreamResponse:
    pl = gw.pipeline
    with pl.held():
        p = await pl.prepare(await request.read() if raw is None else raw, kind, request.headers, rec=rec)
        if stored is not None:
            p.pinned = (await pl.holder(stored)).instance
        await gw.adapters.ensure(p)
        if stored is None and pl.disaggregated(p):  # prefill/decode roles: two legs, or one
            assert gw.disagg is not None
            return await gw.disagg.route(request, p, path_of(p.req))
        d = await pl.admit(p)
        assert d.chosen is not None and gw.proxy is not None
        extra = {
            "x-kvrouter-policy": d.policy,
            "x-kvrouter-reason": d.reason,
            "x-kvrouter-decision-ms": f"{(time.perf_counter() - p.started) * 1e3:.3f}",
        }
        log.debug(
            "routed", extra={"request": p.inp.request_id, "target": d.chosen.target, "reason": d.reason}
        )
        return await gw.proxy.forward(
            request, p, d.chosen, path_of(p.req), extra, method=request.method, body=body
        )


def routed(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A route whose request is routed as ``kind`` and forwarded to the same path."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await route_and_forward(request, kind, lambda r: request.path_qs)

    return handler
