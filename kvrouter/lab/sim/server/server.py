"""The HTTP server of a simulated vLLM instance (aiohttp), and its process-level faults.

::

    SimServer ── AppRunner (handler_cancellation) ── TCPSite (host, port)
        app:  openai_routes   POST /v1/completions  /v1/chat/completions
              agent_routes    POST /v1/responses (+ GET /v1/responses/{id}, POST .../cancel),
                              POST /v1/messages  /v1/messages/count_tokens
              extra_routes    POST /v1/load_lora_adapter /v1/unload_lora_adapter, pooling, scoring, audio
              routes          GET /v1/models /health /ping /metrics /version, POST /tokenize /detokenize
                              /reset_prefix_cache, GET|POST /sim/faults, GET /sim/state
        lifecycle (cleanup_ctx): the instance's publishers and rank loops

``SimServer`` owns the listening port, so it owns the crash: the port closes, every in-flight request's
connection is cut (a stream ends without its last chunk or ``[DONE]``), engines and publishers lose
everything, and after ``down_s`` the same port answers again with an empty cache and event sequences
from 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvrouter.lab.sim.server.agent_routes import (
    anthropic_errors,
    cancel_response,
    count_tokens,
    create_response,
    get_response,
    messages,
)
from kvrouter.lab.sim.server.extra_routes import (
    load_lora_adapter,
    pooling,
    score,
    transcription,
    unload_lora_adapter,
)
from kvrouter.lab.sim.server.instance import SimInstance
from kvrouter.lab.sim.server.openai_routes import chat_completions, completions
from kvrouter.lab.sim.server.prom import SimCollector
from kvrouter.lab.sim.server.routes import (
    CRASH,
    INSTANCE,
    REGISTRY,
    CrashHook,
    api_errors,
    detokenize,
    get_faults,
    health,
    kv_event_sources,
    kv_read,
    metrics,
    models,
    post_faults,
    reset_prefix_cache,
    state,
    tokenize,
    version,
)

log = logging.getLogger("kvrouter.lab.sim.server.server")

_GENERATION = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})
"""The routes whose trace context an instance keeps (``SimInstance.trace_contexts``)."""

SHUTDOWN_TIMEOUT_S = 1.0
"""Bound on waiting for handlers at shutdown (their requests were already failed)."""


# ---------------------------------------------------------------------------------------------- app
def build_app(inst: SimInstance, crash: CrashHook) -> web.Application:
    """The aiohttp app of one instance.  Its lifecycle starts and stops the instance's ranks."""

    @web.middleware
    async def trace_context(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.method == "POST" and request.path in _GENERATION:
            inst.trace_contexts.append(request.headers.get("traceparent"))
        return await handler(request)

    app = web.Application(middlewares=[trace_context, api_errors, anthropic_errors], client_max_size=64 << 20)
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
    r.add_post("/v1/responses", create_response)
    r.add_get("/v1/responses/{response_id}", get_response)
    r.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    r.add_post("/v1/messages", messages)
    r.add_post("/v1/messages/count_tokens", count_tokens)
    r.add_post("/v1/load_lora_adapter", load_lora_adapter)
    r.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    for path in ("/v1/embeddings", "/pooling", "/classify"):
        r.add_post(path, pooling)
    for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        r.add_post(path, score)
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        r.add_post(path, transcription)
    r.add_get("/v1/models", models)
    r.add_get("/health", health)
    r.add_get("/ping", health)  # vLLM's SageMaker liveness route: /health's answer
    r.add_post("/ping", health)
    r.add_get("/metrics", metrics)
    r.add_get("/version", version)
    r.add_get("/kv_event_sources", kv_event_sources)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_post("/reset_prefix_cache", reset_prefix_cache)
    r.add_get("/sim/faults", get_faults)
    r.add_post("/sim/faults", post_faults)
    r.add_get("/sim/state", state)
    r.add_post("/sim/kv/read", kv_read)
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
        self.last_down_s = 0.0
        """How long the port stayed closed in the last crash (the server's own clock)."""

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
        self.instance.transfers.port = self._port  # the KV connector's side channel

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
            closed = time.monotonic()
            if self._site is not None:
                await self._site.stop()  # the port refuses connections from now on
                self._site = None
            lost = await self.instance.crash()  # in-flight handlers get EngineCrashed and cut their links
            if self._runner is not None and self._runner.server is not None:
                # Every connection goes, idle keep-alive ones included, as the kernel closes a dead
                # process's sockets.  (``Server.pre_shutdown()`` is not enough: it ends an idle
                # connection's handler but leaves its socket open, and a client reusing it would wait
                # forever.)  Pending writes are flushed first, so the admin's answer still arrives.
                for conn in self._runner.server.connections:
                    conn.force_close()
            log.warning("instance crashed", extra={"instance": self.name, "lost": lost, "down_s": down_s})
            if down_s:
                await asyncio.sleep(down_s)
            await self.instance.recover()
            if self._runner is not None:
                await self._open()
            # No await between the port opening and this: no request can see a half-restarted instance.
            self.instance.resume()
            self.last_down_s = time.monotonic() - closed
            log.warning("instance restarted", extra={"instance": self.name})
            return lost
