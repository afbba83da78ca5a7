"""The rest of vLLM's surface through the gateway: stored responses, adapters, audio uploads, any route.

::

    GET  /v1/responses/{id}, POST /v1/responses/{id}/cancel
         ──▶ the instance holding the id (remembered, or asked of the fleet), whatever the cache says;
             404 when no instance holds it (or the one that did left the fleet), 503 while it is out of
             rotation
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter ──▶ ``adapters.AdapterManager``
    POST /v1/audio/transcriptions, /v1/audio/translations
         ──▶ the multipart body is read only up to its ``model`` field (at most ``PEEK_BYTES``), routed by
             model and load, and sent on as it arrives: an upload is never held whole
    *    any other path ──▶ by model (a JSON body's ``model``) and load, to an instance serving it (or any
             healthy one); the method, query and body passed through unchanged (vLLM's operator routes,
             such as /reset_prefix_cache or /sleep, need the admin token when one is set: ``handlers``)
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from .forwarding import GATEWAY, forward_request

PEEK_BYTES = 64 << 10
"""How much of a multipart upload is read before it is routed, looking for its ``model`` field."""

_MODEL_PART = re.compile(rb'name="model"\r\n(?:[^\r\n]+\r\n)*\r\n(.*?)\r\n--', re.DOTALL)


async def stored_response(request: web.Request) -> web.StreamResponse:
    rid = request.match_info["response_id"]
    return await forward_request(request, "other", lambda r: request.path_qs, raw=b"", stored=rid)


async def load_adapter(request: web.Request) -> web.Response:
    return await request.app[GATEWAY].adapters.passed_on(request, unload=False)


async def unload_adapter(request: web.Request) -> web.Response:
    return await request.app[GATEWAY].adapters.passed_on(request, unload=True)


async def peek_model(request: web.Request, limit: int = PEEK_BYTES) -> tuple[bytes, str | None]:
    """The first bytes of a multipart body, read until its ``model`` field is complete or ``limit``."""
    head = b""
    while len(head) < limit:
        chunk = await request.content.readany()
        if not chunk:
            break
        head += chunk
        m = _MODEL_PART.search(head)
        if m is not None:
            return head, m.group(1).decode("utf-8", "replace").strip() or None
    return head, None


async def upload(request: web.Request) -> web.StreamResponse:
    """An audio upload: routed on its model as soon as that is read, then streamed through."""
    head, model = await peek_model(request)

    async def body() -> AsyncIterator[bytes]:
        if head:
            yield head
        async for chunk in request.content.iter_any():
            yield chunk

    raw = msgspec.json.encode({"model": model}) if model else b""
    return await forward_request(request, "other", lambda r: request.path_qs, raw=raw, body=body)


async def any_route(request: web.Request) -> web.StreamResponse:
    """Any other route vLLM has: by model and load, passed through unchanged."""
    raw = await request.read()
    return await forward_request(request, "other", lambda r: request.path_qs, raw=raw, body=raw)


def add_surface_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/responses/{response_id}", stored_response)
    r.add_post("/v1/responses/{response_id}/cancel", stored_response)
    r.add_post("/v1/load_lora_adapter", load_adapter)
    r.add_post("/v1/unload_lora_adapter", unload_adapter)
    r.add_post("/v1/audio/transcriptions", upload)
    r.add_post("/v1/audio/translations", upload)
    r.add_route("*", "/{tail:.*}", any_route)
