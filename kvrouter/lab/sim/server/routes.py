"""The simulated instance's HTTP plumbing and its non-generating routes (vLLM's extras, the admin).

::

    GET  /v1/models  /health  /metrics  /version           as vLLM answers them
    POST /tokenize  /detokenize  /reset_prefix_cache
    GET|POST /sim/faults   GET /sim/state                  the simulator's admin (fault knobs, engine truth)
    POST /sim/kv/read                                      the KV connector's side channel (kv_transfer)

Also here: the app keys, request-body decoding, and the middleware that turns every refusal into vLLM's
error body (``ApiError``; tokenizer errors such as a chat template failure become 400), so a bad request
is never a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvrouter.api.errors import ApiError, BadRequest, NotFound, ServiceUnavailable
from kvrouter.api.requests import decode_object, parse_chat
from kvrouter.lab.sim.errors import SimConfigError
from kvrouter.lab.sim.server.faults import FaultUpdate
from kvrouter.lab.sim.server.instance import SimInstance
from kvrouter.lab.sim.server.kv_transfer import ReadRequest
from tokenizer_cache import TokenizerCacheError

log = logging.getLogger("kvrouter.lab.sim.server.routes")

INSTANCE = web.AppKey("instance", SimInstance)
REGISTRY = web.AppKey("registry", CollectorRegistry)


class CrashHook(Protocol):
    def __call__(self, down_s: float) -> None: ...


CRASH = web.AppKey("crash", CrashHook)
"""Schedules a crash of the instance (set by ``SimServer``: the server owns the port)."""

_encode = msgspec.json.Encoder().encode


# ---------------------------------------------------------------------------------------------- helpers
def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


async def read_json(request: web.Request) -> dict[str, Any]:
    return decode_object(await request.read())


def check_alive(inst: SimInstance) -> None:
    if inst.faults.dead:
        raise ServiceUnavailable("The engine is dead (simulated fault).")


def drop_connection(request: web.Request, resp: web.StreamResponse | None = None) -> web.StreamResponse:
    """What a crashed vLLM does to a client: the TCP connection goes away mid-answer.  The response
    returned (the stream already started, if any) never reaches the client: aiohttp finds the transport
    gone and drops it quietly."""
    if request.transport is not None:
        request.transport.abort()
    return resp if resp is not None else web.Response()


@web.middleware
async def api_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return json_response(e.body(), e.status)
    except TokenizerCacheError as e:  # a chat template error, a token id out of the vocabulary
        return json_response(BadRequest(str(e)).body(), 400)
    except SimConfigError as e:  # an invalid admin update
        return json_response(BadRequest(str(e)).body(), 400)


# ---------------------------------------------------------------------------------------------- vLLM extras
async def models(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    cfg = inst.config

    def card(name: str, root: str, parent: str | None) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": inst.created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": inst.max_model_len if parent is None else None,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": inst.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    # vLLM lists the base model, then every adapter loaded (root: its path; no max_model_len of its own)
    data = [card(cfg.model, cfg.model, None), *(card(n, p, cfg.model) for n, p in inst.adapters.items())]
    return json_response(_encode({"object": "list", "data": data}))


async def health(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    return web.Response(status=503 if inst.faults.dead or inst.faults.crashed else 200)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def version(request: web.Request) -> web.Response:
    return json_response(_encode({"version": request.app[INSTANCE].config.release}))


async def kv_event_sources(request: web.Request) -> web.Response:
    """vLLM 0.33's publisher config per data-parallel rank, ports offset by the rank, as it answers when
    started with ``--kv-events-config '{"endpoint": "tcp://*:P", "replay_endpoint": "tcp://*:R", ...}'``
    (``*``: this host); in bind mode the endpoint it connects to.  Empty without events."""
    cfg = request.app[INSTANCE].config
    out: dict[str, dict[str, object]] = {}
    for rank in range(cfg.dp_size):
        pub = cfg.publisher_config(rank)
        if pub is None:
            continue
        port = int(pub.endpoint.rpartition(":")[2]) + rank
        endpoint = pub.endpoint if pub.connect else f"tcp://*:{port}"
        replay = None if cfg.replay_port is None else f"tcp://*:{cfg.replay_port + rank}"
        out[str(rank)] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "buffer_steps": pub.buffer_steps,
            "hwm": pub.hwm,
            "max_queue_size": 100000,
            "topic": pub.topic,
        }
    return json_response(_encode(out))


async def tokenize(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "messages" in body:
        parse_chat(body, sampling=False)
        tokens = await inst.encode_chat(body)
    else:
        prompt = body.get("prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string", param="prompt")
        if not isinstance(special, bool):
            raise BadRequest("'add_special_tokens' must be a bool", param="add_special_tokens")
        tokens = (await inst.tokenizer.aencode_prompt(prompt, add_special_tokens=special)).tokens
    out = {"count": len(tokens), "max_model_len": inst.max_model_len, "tokens": tokens, "token_strs": None}
    return json_response(_encode(out))


async def detokenize(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    body = await read_json(request)
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("'tokens' must be a list of token ids", param="tokens")
    if any(not 0 <= t < inst.tokenizer.vocab_size for t in ids):
        raise BadRequest("a token id is out of the vocabulary", param="tokens")
    return json_response(_encode({"prompt": inst.tokenizer.hf_tokenizer.decode(ids)}))


async def reset_prefix_cache(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    running = request.query.get("reset_running_requests", "false").lower() in ("1", "true")
    ok = inst.reset_prefix_cache(reset_running_requests=running)
    if not ok:  # vLLM logs this and still answers 200
        log.warning(
            "prefix cache not reset: running requests hold blocks", extra={"instance": inst.config.name}
        )
    return web.Response(headers={"X-Sim-Prefix-Cache-Reset": "true" if ok else "false"})


# ---------------------------------------------------------------------------------------------- admin
async def get_faults(request: web.Request) -> web.Response:
    return json_response(_encode(request.app[INSTANCE].faults.status()))


async def post_faults(request: web.Request) -> web.StreamResponse:
    inst = request.app[INSTANCE]
    raw = await request.read()
    try:
        update = msgspec.json.decode(raw or b"{}", type=FaultUpdate)
    except msgspec.DecodeError as e:  # ValidationError included
        raise BadRequest(f"bad fault update: {e}") from None
    status = inst.apply_faults(update)
    if not update.crash:
        return json_response(_encode(status))
    # Answer first, then die: the answer is flushed before the crash closes the connection.
    resp = web.Response(body=_encode(status), content_type="application/json")
    await resp.prepare(request)
    await resp.write_eof()
    request.app[CRASH](update.down_s)
    return resp


async def state(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    ranks = []
    for rank in inst.ranks:
        pub = rank.publisher
        ranks.append(
            {
                "rank": rank.rank,
                "steps": rank.steps,
                "in_flight": rank.in_flight,
                "engine": rank.engine.metrics(),
                "kv_loading": rank.engine.num_loading,
                "kv_held": rank.engine.num_held,
                "next_seq": None if pub is None else pub.next_seq,
                "publisher": None if pub is None else pub.stats,
            }
        )
    body = {
        "name": inst.config.name,
        "role": inst.config.role,
        "faults": inst.faults.status(),
        "ranks": ranks,
        "kv_transfer": inst.transfers.state(),
    }
    return json_response(_encode(body))


async def kv_read(request: web.Request) -> web.Response:
    """A decode instance read a prefill leg's held blocks: they are freed.  404 when they are not held
    (expired, read already, or computed by an engine that has since restarted); 503 while dead."""
    inst = request.app[INSTANCE]
    check_alive(inst)
    try:
        req = msgspec.json.decode(await request.read(), type=ReadRequest)
    except msgspec.DecodeError as e:
        raise BadRequest(f"bad read request: {e}") from None
    if not inst.transfers.read(req):
        raise NotFound(f"no blocks held for {req.remote_request_id!r} on {req.remote_engine_id!r}")
    return json_response(_encode({"released": True}))
