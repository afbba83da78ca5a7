"""The HTTP server of a simulated vLLM instance (aiohttp), and its process-level faults.

::

    POST /v1/completions  /v1/chat/completions    OpenAI, as vLLM serves it (SSE streaming per engine step)
    GET  /v1/models  /health  /metrics  /version
    POST /tokenize  /detokenize  /reset_prefix_cache
    GET|POST /sim/faults   GET /sim/state          the simulator's admin (fault knobs, engine truth)

``SimServer`` owns the listening port, so it owns the crash: the port closes, every in-flight request's
connection is cut (a stream ends without its last chunk or ``[DONE]``), engines and publishers lose
everything, and after ``down_s`` the same port answers again with an empty cache and event sequences
from 0.  Handlers never answer 500 to a bad request: every refusal is an ``ApiError`` with vLLM's status
and body.  A client that disconnects cancels its handler (``handler_cancellation``), which aborts its
request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tokenizer_cache import TokenizerCacheError

from .errors import SimConfigError
from .faults import FaultUpdate
from .instance import EngineCrashed, InFlight, SimInstance
from .openai_api import (
    SSE_DONE,
    ApiError,
    BadRequest,
    ChatArgs,
    CompletionArgs,
    EngineUnavailable,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    parse_chat,
    parse_completion,
    usage,
    usage_chunk,
)
from .prom import SimCollector

log = logging.getLogger("kvrouter.sim.server")

INSTANCE = web.AppKey("instance", SimInstance)
REGISTRY = web.AppKey("registry", CollectorRegistry)


class CrashHook(Protocol):
    def __call__(self, down_s: float) -> None: ...


CRASH = web.AppKey("crash", CrashHook)
"""Schedules a crash of the instance (set by ``SimServer``: the server owns the port)."""

SHUTDOWN_TIMEOUT_S = 1.0
"""Bound on waiting for handlers at shutdown (their requests were already failed)."""

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


# ---------------------------------------------------------------------------------------------- helpers
def _json(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


async def _body(request: web.Request) -> object:
    raw = await request.read()
    if not raw:
        raise BadRequest("the request body is empty")
    try:
        return _decode.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


def _alive(inst: SimInstance) -> None:
    if inst.faults.dead:
        raise EngineUnavailable("The engine is dead (simulated fault).")


def _drop_connection(request: web.Request, resp: web.StreamResponse | None = None) -> web.StreamResponse:
    """What a crashed vLLM does to a client: the TCP connection goes away mid-answer.  The response
    returned (the stream already started, if any) never reaches the client: aiohttp finds the transport
    gone and drops it quietly."""
    if request.transport is not None:
        request.transport.abort()
    return resp if resp is not None else web.Response()


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _json(e.body(), e.status)
    except TokenizerCacheError as e:  # a chat template error, a token id out of the vocabulary
        return _json(BadRequest(str(e)).body(), 400)
    except SimConfigError as e:  # an invalid admin update
        return _json(BadRequest(str(e)).body(), 400)


# ---------------------------------------------------------------------------------------------- OpenAI
async def completions(request: web.Request) -> web.StreamResponse:
    inst = request.app[INSTANCE]
    _alive(inst)
    args = parse_completion(await _body(request))
    lora = inst.lora_for(args.model)
    tokens = await inst.tokenizer.aencode_prompt(args.prompt)
    return await _generate(request, inst, "cmpl", tokens, args, lora)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    inst = request.app[INSTANCE]
    _alive(inst)
    args = parse_chat(await _body(request))
    lora = inst.lora_for(args.model)
    tokens = await inst.tokenizer.aencode_chat(
        args.messages,
        args.tools,
        args.chat_template_kwargs,
        add_generation_prompt=args.add_generation_prompt,
        continue_final_message=args.continue_final_message,
    )
    return await _generate(request, inst, "chatcmpl", tokens, args, lora)


async def _generate(
    request: web.Request,
    inst: SimInstance,
    prefix: str,
    tokens: list[int],
    args: CompletionArgs | ChatArgs,
    lora: str | None,
) -> web.StreamResponse:
    if inst.faults.latency_s:
        await asyncio.sleep(inst.faults.latency_s)
    if inst.faults.crashed:
        return _drop_connection(request)
    req = inst.submit(
        prefix,
        tokens,
        args.max_tokens,
        rank_header=request.headers.get("X-data-parallel-rank"),
        cache_salt=args.cache_salt,
        lora_name=lora,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    model = args.model or inst.config.model
    chat = isinstance(args, ChatArgs)
    resp: web.StreamResponse | None = None
    try:
        if not args.stream:
            return await _collect(inst, req, model, chat)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await _stream(resp, inst, req, args, model, chat)
        return resp
    except EngineCrashed:
        return _drop_connection(request, resp)
    except ConnectionResetError:  # the client left between two chunks; aiohttp drops the rest quietly
        return resp or web.Response()
    finally:
        req.close()  # a request still in the engine (its client gone) is aborted there


async def _collect(inst: SimInstance, req: InFlight, model: str, chat: bool) -> web.Response:
    ids: list[int] = []
    while True:
        out = await req.next()
        ids.extend(out.new_token_ids)
        if out.finished:
            break
    use = usage(req.num_prompt, out.num_output_tokens, out.cached_tokens)
    build = chat_body if chat else completion_body
    return _json(build(req.request_id, int(time.time()), model, inst.vocab.text(ids), req.finish_reason, use))


async def _stream(
    resp: web.StreamResponse,
    inst: SimInstance,
    req: InFlight,
    args: CompletionArgs | ChatArgs,
    model: str,
    chat: bool,
) -> None:
    """SSE: one chunk per engine step that produced a token, as vLLM streams."""
    rid, created, piece = req.request_id, int(time.time()), inst.vocab.piece
    first = True
    while True:
        out = await req.next()
        finish = req.finish_reason if out.finished else None
        use = (
            usage(req.num_prompt, out.num_output_tokens, out.cached_tokens) if args.continuous_usage else None
        )
        text = "".join(piece(t) for t in out.new_token_ids)
        if chat:
            if first:  # vLLM sends the role with the first engine output
                await resp.write(
                    chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None, use)
                )
                first = False
            chunk = chat_chunk(rid, created, model, {"content": text}, finish, use)
        else:
            chunk = completion_chunk(rid, created, model, text, finish, use)
        await resp.write(chunk)
        if out.finished:
            break
    if args.include_usage:
        kind = "chat.completion.chunk" if chat else "text_completion"
        total = usage(req.num_prompt, out.num_output_tokens, out.cached_tokens)
        await resp.write(usage_chunk(rid, created, model, kind, total))
    await resp.write(SSE_DONE)
    await resp.write_eof()


# ---------------------------------------------------------------------------------------------- vLLM extras
async def models(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    cfg = inst.config

    def card(name: str, parent: str | None) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": inst.created,
            "owned_by": "vllm",
            "root": name,
            "parent": parent,
            "max_model_len": inst.max_model_len,
            "permission": [],
        }

    data = [card(cfg.model, None), *(card(n, cfg.model) for n in cfg.lora_names)]
    return _json(_encode({"object": "list", "data": data}))


async def health(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    return web.Response(status=503 if inst.faults.dead or inst.faults.crashed else 200)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def version(request: web.Request) -> web.Response:
    return _json(_encode({"version": request.app[INSTANCE].config.release}))


async def tokenize(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    body = await _body(request)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "messages" in body:
        args = parse_chat(body)
        special = body.get("add_special_tokens", False)
        if not isinstance(special, bool):
            raise BadRequest("'add_special_tokens' must be a bool", param="add_special_tokens")
        tokens = await inst.tokenizer.aencode_chat(
            args.messages,
            args.tools,
            args.chat_template_kwargs,
            add_generation_prompt=args.add_generation_prompt,
            continue_final_message=args.continue_final_message,
            add_special_tokens=special,
        )
    else:
        prompt = body.get("prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string", param="prompt")
        if not isinstance(special, bool):
            raise BadRequest("'add_special_tokens' must be a bool", param="add_special_tokens")
        tokens = await inst.tokenizer.aencode_prompt(prompt, add_special_tokens=special)
    out = {"count": len(tokens), "max_model_len": inst.max_model_len, "tokens": tokens, "token_strs": None}
    return _json(_encode(out))


async def detokenize(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    body = await _body(request)
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("'tokens' must be a list of token ids", param="tokens")
    if any(not 0 <= t < inst.tokenizer.vocab_size for t in ids):
        raise BadRequest("a token id is out of the vocabulary", param="tokens")
    return _json(_encode({"prompt": inst.tokenizer.hf_tokenizer.decode(ids)}))


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
    return _json(_encode(request.app[INSTANCE].faults.status()))


async def post_faults(request: web.Request) -> web.StreamResponse:
    inst = request.app[INSTANCE]
    raw = await request.read()
    try:
        update = msgspec.json.decode(raw or b"{}", type=FaultUpdate)
    except msgspec.DecodeError as e:  # ValidationError included
        raise BadRequest(f"bad fault update: {e}") from None
    status = inst.apply_faults(update)
    if not update.crash:
        return _json(_encode(status))
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
                "next_seq": None if pub is None else pub.next_seq,
                "publisher": None if pub is None else pub.stats,
            }
        )
    return _json(_encode({"name": inst.config.name, "faults": inst.faults.status(), "ranks": ranks}))


# ---------------------------------------------------------------------------------------------- app
def build_app(inst: SimInstance, crash: CrashHook) -> web.Application:
    """The aiohttp app of one instance.  Its lifecycle starts and stops the instance's ranks."""
    app = web.Application(middlewares=[_errors], client_max_size=64 << 20)
    app[INSTANCE] = inst
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        SimCollector(inst.config.model, lambda: list(zip((r.engine for r in inst.ranks), inst.stats)))
    )
    app[REGISTRY] = registry
    app[CRASH] = crash

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        await inst.start()
        yield
        await inst.stop()

    async def fail_in_flight(app: web.Application) -> None:
        # Before aiohttp waits for handlers: fail every request so streams end now, not when done.
        for rank in inst.ranks:
            await rank.stop()

    app.cleanup_ctx.append(lifespan)
    app.on_shutdown.append(fail_in_flight)
    r = app.router
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_get("/v1/models", models)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/version", version)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_post("/reset_prefix_cache", reset_prefix_cache)
    r.add_get("/sim/faults", get_faults)
    r.add_post("/sim/faults", post_faults)
    r.add_get("/sim/state", state)
    return app


class SimServer:
    """One instance behind its HTTP port: start, stop, crash and come back."""

    def __init__(self, instance: SimInstance) -> None:
        self.instance = instance
        self.app = build_app(instance, self.crash_soon)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._port = instance.config.port
        self._tasks: set[asyncio.Task[int]] = set()
        self._crash_lock = asyncio.Lock()

    @property
    def name(self) -> str:
        return self.instance.config.name

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.instance.config.host}:{self._port}"

    async def start(self) -> None:
        runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        await runner.setup()
        self._runner = runner
        try:
            await self._open()
        except OSError:
            await runner.cleanup()
            self._runner = None
            raise

    async def _open(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, self.instance.config.host, self._port)
        await site.start()
        self._site = site
        self._port = site.port  # the bound port when 0 was asked

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._site = None

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def crash_soon(self, down_s: float) -> None:
        """Crash from inside a handler (the admin endpoint): runs as a task owned by the server."""
        task = asyncio.create_task(self.crash(down_s), name=f"crash:{self.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def crash(self, down_s: float = 0.5) -> int:
        """Crash now and come back after ``down_s`` seconds.  Returns the number of requests lost."""
        async with self._crash_lock:
            if self._site is not None:
                await self._site.stop()  # the port refuses connections from now on
                self._site = None
            lost = await self.instance.crash()  # in-flight handlers get EngineCrashed and cut their links
            if self._runner is not None and self._runner.server is not None:
                self._runner.server.pre_shutdown()  # idle keep-alive connections close too
            log.warning("instance crashed", extra={"instance": self.name, "lost": lost, "down_s": down_s})
            if down_s:
                await asyncio.sleep(down_s)
            await self.instance.recover()
            if self._runner is not None:
                await self._open()
            # No await between the port opening and this: no request can see a half-restarted instance.
            self.instance.resume()
            log.warning("instance restarted", extra={"instance": self.name})
            return lost
