"""The indexer's HTTP service (aiohttp): health, metrics, fleet state and the cache-hit API.

    GET  /health            200 once running, with per-source state
    GET  /metrics           Prometheus text
    GET  /v1/fleet          per source: seq, lag, trust, connection, cached blocks per tier
    POST /v1/cache/lookup   {"token_ids": [...]} | {"prompt": ...} | {"messages": [...], "model": ...}
                            (+ "cache_salt", "lora_name") -> matched leading blocks per instance

Bad requests get a 400 (or 413 for a body over the limit) with a reason, never a 5xx.  Prompts and chat
messages are tokenized by an injected ``PromptEncoder`` (the tokenizer cache), so this package does not
depend on any tokenizer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Protocol, runtime_checkable

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .config import FleetConfig
from .hashing import TokenEncodingError
from .indexer import Indexer
from .metrics import make_registry
from .subscriber import EventSubscriber
from .types import Medium

_json = msgspec.json.Encoder()


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class LookupRequest(msgspec.Struct):
    token_ids: list[TokenId] | None = None
    prompt: str | list[TokenId] | None = None
    messages: list[dict[str, Any]] | None = None
    model: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class PromptError(Exception):
    """A prompt or chat request that cannot be tokenized (bad template input, unknown model...)."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@runtime_checkable
class PromptEncoder(Protocol):
    """Turns a lookup's ``prompt`` or ``messages`` into the token ids vLLM would compute."""

    async def encode_lookup(self, req: LookupRequest) -> list[int]: ...


_DECODE_LOOKUP = msgspec.json.Decoder(LookupRequest)
INDEXER: web.AppKey[Indexer] = web.AppKey("indexer", Indexer)
SUBSCRIBER: web.AppKey[EventSubscriber | None] = web.AppKey("subscriber", EventSubscriber)
ENCODER: web.AppKey[PromptEncoder | None] = web.AppKey("encoder", object)  # type: ignore[arg-type]
STARTED: web.AppKey[float] = web.AppKey("started", float)
REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("registry", CollectorRegistry)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(obj), status=status, content_type="application/json")


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    413: "BadRequestError",
}


def error_body(status: int, reason: str) -> bytes:
    """vLLM's error shape, as every kvrouter HTTP API answers errors (``kvrouter.api.errors``)."""
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return _json.encode({"error": {"message": reason, "type": kind, "param": None, "code": status}})


def error(status: int, reason: str) -> web.Response:
    return web.Response(body=error_body(status, reason), status=status, content_type="application/json")


async def read_json(request: web.Request, decoder: msgspec.json.Decoder[Any]) -> Any:
    """Decode a JSON body with a typed decoder, or raise an HTTP 4xx with the reason."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise
    if not body:
        raise web.HTTPBadRequest(text=error_body(400, "empty body").decode(), content_type="application/json")
    try:
        return decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise web.HTTPBadRequest(
            text=error_body(400, f"invalid request: {e}").decode(), content_type="application/json"
        ) from None


def check_salt(salt: str | None) -> str | None:
    """vLLM rejects an empty or non-string ``cache_salt``; so do we (the same 400, before routing)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        return "cache_salt must be a non-empty string"
    return None


def source_state(ix: Indexer, sub: EventSubscriber | None) -> list[dict[str, Any]]:
    out = []
    now = time.time()
    for src in ix.sources():
        sync = ix.sync(src)
        st = sub.status.get(src) if sub else None
        ts = ix.last_event_ts.get(src)
        blocks = ix.index.blocks(src)
        out.append(
            {
                "instance": src.instance,
                "dp_rank": src.dp_rank,
                "trust": ix.trust(src).value,
                "phase": sync.phase.value,
                "seq": sync.last,
                "lag_s": None if ts is None else round(max(0.0, now - ts), 3),
                "connected": None if st is None else st.connected,
                "ever_connected": None if st is None else st.ever_connected,
                "endpoint": None if st is None else st.endpoint,
                "mode": None if st is None else st.mode,
                "live_batches": None if st is None else st.messages,
                "socket_error": None if st is None else st.error,
                "gaps": sync.gaps,
                "unfilled_gaps": sync.unfilled,
                "replays": sync.replays,
                "restarts": sync.restarts,
                "dropped_pending": sync.dropped_pending,
                "stale_live": sync.stale_live,
                "block_size_mismatch": ix.block_size_mismatch.get(src),
                "blocks": {Medium(m).name: n for m, n in blocks.items()},
            }
        )
    return out


async def health(request: web.Request) -> web.Response:
    ix = request.app[INDEXER]
    sources = source_state(ix, request.app[SUBSCRIBER])
    status = "block_size_mismatch" if ix.block_size_mismatch else "ok"
    return json_response({"status": status, "block_size": ix.block_size, "sources": sources})


async def fleet(request: web.Request) -> web.Response:
    ix = request.app[INDEXER]
    return json_response({"block_size": ix.block_size, "sources": source_state(ix, request.app[SUBSCRIBER])})


async def metrics(request: web.Request) -> web.Response:
    reg = request.app[REGISTRY]
    return web.Response(body=generate_latest(reg), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokens_for(request: web.Request, req: LookupRequest) -> list[int]:
    """The token ids a lookup asks about: given directly, or tokenized like vLLM would."""
    given = [x for x in (req.token_ids, req.prompt, req.messages) if x is not None]
    if len(given) != 1:
        raise PromptError("give exactly one of token_ids, prompt, messages")
    if req.token_ids is not None:
        return req.token_ids
    if isinstance(req.prompt, list):
        return req.prompt
    enc = request.app[ENCODER]
    if enc is None:
        raise PromptError("this indexer has no tokenizer configured: send token_ids")
    return await enc.encode_lookup(req)


async def lookup(request: web.Request) -> web.Response:
    req: LookupRequest = await read_json(request, _DECODE_LOOKUP)
    bad = check_salt(req.cache_salt)
    if bad:
        return error(400, bad)
    try:
        tokens = await tokens_for(request, req)
        res = request.app[INDEXER].lookup(
            tokens, lora_name=req.lora_name, cache_salt=req.cache_salt, now=time.monotonic()
        )
    except PromptError as e:
        return error(e.status, e.reason)
    except TokenEncodingError as e:
        return error(400, f"token_ids: {e}")
    return json_response(res)


def make_indexer_app(
    indexer: Indexer,
    subscriber: EventSubscriber | None = None,
    *,
    encoder: PromptEncoder | None = None,
    max_body_bytes: int = 8 << 20,
) -> web.Application:
    """The service app.  The subscriber (if any) starts and stops with the app."""
    app = web.Application(client_max_size=max_body_bytes)
    app[INDEXER] = indexer
    app[SUBSCRIBER] = subscriber
    app[ENCODER] = encoder
    app[REGISTRY] = make_registry(indexer, subscriber)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        app[STARTED] = time.time()
        if subscriber is not None:
            await subscriber.start()
        yield
        if subscriber is not None:
            await subscriber.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/fleet", fleet)
    app.router.add_post("/v1/cache/lookup", lookup)
    return app


def build(fleet_cfg: FleetConfig, *, encoder: PromptEncoder | None = None) -> web.Application:
    """Indexer + subscriber + app for a fleet file."""
    ix = Indexer.for_fleet(fleet_cfg)
    return make_indexer_app(ix, EventSubscriber(ix, fleet_cfg), encoder=encoder)
