"""The lean core: the gateway's routed routes on a hand-built HTTP/1.1 server, aiohttp for the rest.

::

    port ──▶ LeanProtocol (every connection) ──POST to a lean route──▶ LeanCore.handle ──▶ route_and_forward
                       └── any other request ──▶ aiohttp's protocol takes the connection (admin, metrics,
                                                 explain, pass-through, uploads: ``handlers``, ``surface``)

One port, one process: aiohttp's app runs in the same event loop (its start-up and clean-up run the
gateway's), its protocol built by the same runner; a connection whose request is not the lean core's is
handed to it whole, bytes and transport, and stays aiohttp's (``protocol``).

``LeanCore.handle`` is ``errors_mw`` for the lean routes: the same error answers (``error_answer``), the
same counts (``kvrouter_requests_total`` by route and status, internal errors by type).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections.abc import Callable

from aiohttp import web

from ...api.errors import ApiError
from ..app import Gateway
from ..downstream import error_answer, internal_error
from ..forwarding import route_and_forward
from .exchange import Exchange
from .protocol import LeanProtocol
from .routes import lean_routes

log = logging.getLogger("kvrouter.gateway.lean")

DRAIN_S = 60.0
"""What requests under way are given to finish once a stop begins (``LeanSite.shutdown_timeout_s``)."""
STOP_GRACE_S = 15.0
"""What the rest of a stop may take beyond that."""

KEEPALIVE_S = 75.0
"""An idle client connection is closed after this long (aiohttp's default)."""
_TICK_S = 1.0


class LeanCore:
    def __init__(
        self,
        gw: Gateway,
        aiohttp_protocol: Callable[[], asyncio.Protocol],
        *,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.gw = gw
        self.aiohttp_protocol = aiohttp_protocol
        """Builds aiohttp's protocol for a connection handed over (the runner's ``web.Server``)."""
        self.loop = asyncio.get_running_loop()
        self.routes = lean_routes()
        self.max_body = gw.cfg.limits.max_body_bytes
        self.retry_after_s = gw.cfg.limits.retry_after_s
        self.keepalive_s = keepalive_s
        self.conns: set[LeanProtocol] = set()
        self.date = email.utils.formatdate(usegmt=True)
        self._timer: asyncio.TimerHandle | None = None

    def protocol(self) -> LeanProtocol:
        return LeanProtocol(self)

    # ------------------------------------------------------------------ one request
    async def handle(self, ex: Exchange) -> None:
        """Route and forward one request; errors answered as ``handlers.errors_mw`` answers them."""
        gw = self.gw
        route = ex.route
        try:
            await route_and_forward(gw, ex, route.kind, lambda r: route.upstream(ex.path_qs, r))
            if not ex.status:
                raise RuntimeError("the proxy answered nothing")
        except ApiError as e:
            self._fail(ex, *error_answer(e, self.retry_after_s, ex.path_qs))
        except ConnectionResetError:
            ex.keep_alive = False  # the client went away: nothing to answer
        except Exception as e:
            gw.metrics.internal_errors.labels(type(e).__name__).inc()
            self._fail(ex, *error_answer(internal_error(e, route.label), None, ex.path_qs))
        finally:
            ex.conn.done(ex)
        if ex.status:
            gw.metrics.requests.labels(route.label, str(ex.status)).inc()

    def _fail(self, ex: Exchange, status: int, headers: dict[str, str], body: bytes) -> None:
        if ex.status:  # the answer began: the error cannot be told; the connection is closed
            ex.keep_alive = False
            return
        headers["Date"] = self.date
        ex.answer(status, headers, body)

    # ------------------------------------------------------------------ connections
    def start(self) -> None:
        self._timer = self.loop.call_later(_TICK_S, self._tick)

    def _tick(self) -> None:
        """Every second: the Date of the core's own answers, and idle connections past keep-alive closed."""
        self.date = email.utils.formatdate(usegmt=True)
        limit = time.monotonic() - self.keepalive_s
        for c in [c for c in self.conns if c.idle() and c.idle_since < limit]:
            c.close()
        self._timer = self.loop.call_later(_TICK_S, self._tick)

    async def close(self, timeout_s: float) -> None:
        """Stop: idle connections closed at once, requests under way given ``timeout_s`` to finish (then
        cancelled), every connection closed."""
        if self._timer is not None:
            self._timer.cancel()
        deadline = self.loop.time() + timeout_s
        while True:
            for c in [c for c in self.conns if c.idle()]:
                c.close()
            busy = [c for c in self.conns if not c.idle()]
            if not busy or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            c.close()


class LeanSite(web.BaseSite):
    """An aiohttp site whose connections the lean core serves (handing aiohttp what is not its own)."""

    def __init__(
        self,
        runner: web.AppRunner,
        gw: Gateway,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        backlog: int = 128,
        shutdown_timeout_s: float = DRAIN_S,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self.gw = gw
        self.host = host
        self.requested_port = port
        self.reuse_port = reuse_port
        self.shutdown_timeout_s = shutdown_timeout_s
        self.core: LeanCore | None = None

    @property
    def port(self) -> int:
        sockets = getattr(self._server, "sockets", None)
        return int(sockets[0].getsockname()[1]) if sockets else self.requested_port

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        server = self._runner.server
        assert server is not None
        core = LeanCore(self.gw, server)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            core.protocol,
            self.host,
            self.requested_port,
            backlog=self._backlog,
            reuse_port=self.reuse_port or None,
        )
        await super().start()  # registered with the runner once listening (a failed start may be retried)
        self.core = core
        core.start()

    async def stop(self) -> None:
        await super().stop()
        self.gw.closing()  # before waiting for the requests in flight: the waiting ones would wait on
        if self.core is not None:
            await self.core.close(self.shutdown_timeout_s)


def run(app: web.Application, gw: Gateway, *, host: str, port: int, reuse_port: bool = False) -> None:
    """Serve until SIGINT or SIGTERM (``web.run_app`` for the lean core), then stop gracefully."""
    loop = asyncio.new_event_loop()  # the policy's: uvloop's when it is installed
    asyncio.set_event_loop(loop)

    async def serve() -> None:
        runner = web.AppRunner(app, handle_signals=True, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await LeanSite(runner, gw, host, port, reuse_port=reuse_port).start()
            await asyncio.Event().wait()  # until a signal (GracefulExit)
        finally:
            await runner.cleanup()

    main = loop.create_task(serve())
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        finish(loop, main, DRAIN_S + STOP_GRACE_S)
        loop.close()


def finish(
    loop: asyncio.AbstractEventLoop, main: asyncio.Task[None], within_s: float, rest_s: float = 5.0
) -> bool:
    """Stop ``main`` (cancelled: its cleanup runs) and then every other task, in at most ``within_s``
    and ``rest_s`` more: a task that does not end (a cancellation swallowed, a cleanup that waits on
    something gone) is logged with where it stands and left behind, so a stopping process always exits
    (a second SIGTERM also ends the wait).  Returns whether everything ended."""
    main.cancel()
    ended = _wait(loop, [main], within_s)
    rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in rest:
        t.cancel()
    ended = _wait(loop, rest, rest_s) and ended
    if ended:
        loop.run_until_complete(loop.shutdown_asyncgens())
    return ended


def _wait(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Task[None]], within_s: float) -> bool:
    if not tasks:
        return True
    _, pending = loop.run_until_complete(asyncio.wait(tasks, timeout=within_s))
    for t in tasks:
        if t.done() and not t.cancelled():
            exc = t.exception()
            if exc is not None and not isinstance(exc, web.GracefulExit):
                log.error("a task failed while stopping", extra={"task": t.get_name()}, exc_info=exc)
    if pending:
        where = {
            t.get_name(): [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in t.get_stack()]
            for t in pending
        }
        log.error("tasks still running after a stop's deadline; exiting anyway", extra={"tasks": where})
    return not pending
