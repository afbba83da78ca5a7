"""Routing one request and forwarding it: the step every proxied route shares, whatever the front door.

::

    held ──▶ read body ──▶ RequestPipeline.prepare ──▶ [pinned instance] ──▶ adapter loaded on demand
         ──▶ admit ──▶ Proxy.forward (x-kvrouter-policy / -reason / -decision-ms on the answer)
    (a disaggregated model: admit_plan ──▶ DisaggProxy, its prefill and decode legs)

``route_and_forward`` answers through a ``Downstream``: the aiohttp handlers here and the lean core
(``gateway.lean``) call the same function, so both route and forward one way.
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
from .downstream import AiohttpDownstream, Downstream
from .proxy import BodySource

log = logging.getLogger("kvrouter.gateway")

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


async def route_and_forward(
    gw: Gateway,
    down: Downstream,
    kind: Kind | None,
    path_of: Callable[[ParsedRequest], str],
    *,
    raw: bytes | None = None,
    body: BodySource | None = None,
    stored: str | None = None,
) -> None:
    """Prepare, admit and forward one request, answering ``down`` (the body read here unless ``raw`` is
    given; ``body``: what to send instead of the parsed body; ``stored``: a stored response id, the
    request goes where it is).  A traced or logged request (``RequestPipeline.begin``) is ended with the
    status its client got, whatever happened."""
    pl = gw.pipeline
    rec = pl.begin(down.path_qs.split("?", 1)[0], down.headers)
    if rec is None:
        await _route_and_forward(gw, down, kind, path_of, raw, body, stored, None)
        return
    status = 500
    try:
        await _route_and_forward(gw, down, kind, path_of, raw, body, stored, rec)
        status = down.status or 500
    except ApiError as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away before its answer
        raise
    finally:
        pl.end(rec, status)


async def _route_and_forward(
    gw: Gateway,
    down: Downstream,
    kind: Kind | None,
    path_of: Callable[[ParsedRequest], str],
    raw: bytes | None,
    body: BodySource | None,
    stored: str | None,
    rec: RequestRecord | None,
) -> None:
    pl = gw.pipeline
    with pl.held():
        p = await pl.prepare(await down.read() if raw is None else raw, kind, down.headers, rec=rec)
        if stored is not None:
            p.pinned = (await pl.holder(stored)).instance
        await gw.adapters.ensure(p)
        if stored is None and pl.disaggregated(p):  # prefill/decode roles: two legs, or one
            assert gw.disagg is not None
            await gw.disagg.route(down, p, path_of(p.req))
            return
        d = await pl.admit(p)
        assert d.chosen is not None and gw.proxy is not None
        extra = {
            "x-kvrouter-policy": d.policy,
            "x-kvrouter-reason": d.reason,
            "x-kvrouter-decision-ms": f"{(time.perf_counter() - p.started) * 1e3:.3f}",
        }
        if p.slo is not None:
            extra["x-kvrouter-slo"] = p.slo
        log.debug(
            "routed", extra={"request": p.inp.request_id, "target": d.chosen.target, "reason": d.reason}
        )
        await gw.proxy.forward(down, p, d.chosen, path_of(p.req), extra, method=down.method, body=body)


async def forward_request(
    request: web.Request,
    kind: Kind | None,
    path_of: Callable[[ParsedRequest], str],
    *,
    raw: bytes | None = None,
    body: BodySource | None = None,
    stored: str | None = None,
) -> web.StreamResponse:
    """``route_and_forward`` for an aiohttp handler: its answer as the response to return."""
    down = AiohttpDownstream(request)
    await route_and_forward(request.app[GATEWAY], down, kind, path_of, raw=raw, body=body, stored=stored)
    assert down.response is not None, "the proxy answered nothing"
    return down.response


def routed(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A route whose request is routed as ``kind`` and forwarded to the same path."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await forward_request(request, kind, lambda r: request.path_qs)

    return handler
