"""The picker's servers, started and stopped with its components:

::

    gRPC (grpc_host:grpc_port)   envoy.service.ext_proc.v3.ExternalProcessor/Process  one stream a request
                                 grpc.health.v1.Health: liveness, readiness, the ext_proc service
    HTTP (admin)                 /metrics /health /livez /v1/fleet /v1/route/explain  (the gateway's own)

Readiness and the ext_proc service report SERVING once the components have started and, with Kubernetes
discovery, its first list has been applied; liveness as soon as the server answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..api.errors import InternalError
from ..gateway import handlers
from . import protocol
from .exchange import Exchange
from .picker import Picker

log = logging.getLogger("kvrouter.epp")

LIVENESS, READINESS = "liveness", "readiness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_GRACE_S = 5.0


class ExtProc(ext_proc_grpc.ExternalProcessorServicer):
    """One ext_proc stream per HTTP request; each message answered in order by its ``Exchange``."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        m = self.picker.metrics
        m.streams.inc()
        m.open_streams.inc()
        ex = Exchange(self.picker)
        try:
            async for msg in requests:
                try:
                    out = await ex.handle(msg)
                except Exception as e:
                    # A bug, never the client's: a well-formed 500 now (the gateway would otherwise
                    # apply its failure mode to a request that reached us), logged without its contents.
                    log.exception("ext_proc exchange failed", extra={"error": type(e).__name__})
                    m.stream_errors.labels(type(e).__name__).inc()
                    yield protocol.immediate(
                        500, InternalError(f"internal error ({type(e).__name__})").body()
                    )
                    return
                for resp in out:
                    yield resp
        finally:
            ex.close()
            m.open_streams.dec()


class PickerServer:
    """The gRPC server and its health service (``start`` / ``stop``), inside the admin app's lifecycle."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._ready: asyncio.Task[None] | None = None

    async def start(self) -> None:
        o = self.picker.options
        # No SO_REUSEPORT: a second picker on a taken port must fail, not share it.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExtProc(self.picker), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{o.grpc_host}:{o.grpc_port}")
        if not self.port:
            raise OSError(f"cannot listen on {o.grpc_host}:{o.grpc_port}")
        await self.health.set(LIVENESS, _SERVING)
        for name in (READINESS, protocol.SERVICE_NAME):
            await self.health.set(name, _NOT_SERVING)
        await self.server.start()
        self._ready = asyncio.create_task(self._when_ready(), name="epp-readiness")
        log.info("endpoint picker listening", extra={"host": o.grpc_host, "port": self.port})

    async def _when_ready(self) -> None:
        disc = self.picker.gw.membership.discovery
        if disc is not None:
            await disc.synced.wait()
        for name in (READINESS, protocol.SERVICE_NAME):
            await self.health.set(name, _SERVING)

    async def stop(self) -> None:
        if self._ready is not None:
            self._ready.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ready
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(_GRACE_S)


def build_admin(picker: Picker) -> tuple[web.Application, PickerServer]:
    """The picker's process: its components and gRPC server in the lifecycle of an aiohttp app serving
    the gateway's operational routes (``/metrics`` shows the decisions)."""
    gw = picker.gw
    server = PickerServer(picker)
    app = web.Application(middlewares=[handlers.errors_mw])
    app[handlers.GATEWAY] = gw

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await gw.start()
        try:
            await server.start()
        except BaseException:
            await gw.stop()
            raise
        yield
        with contextlib.suppress(asyncio.CancelledError):
            await server.stop()
            await gw.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/livez", handlers.livez)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/v1/fleet", handlers.fleet)
    app.router.add_post("/v1/route/explain", handlers.explain)
    return app, server
