"""A real OTLP/HTTP trace receiver on 127.0.0.1: what an OpenTelemetry collector's ``otlphttp`` receiver
does with ``POST /v1/traces`` (a protobuf ``ExportTraceServiceRequest``, answered with an
``ExportTraceServiceResponse``), decoded with the opentelemetry-proto messages."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


class Span:
    """One received span, its ids as hex."""

    def __init__(self, raw: Any, service: str) -> None:
        self.raw = raw
        self.service = service
        self.name: str = raw.name
        self.trace_id = raw.trace_id.hex()
        self.span_id = raw.span_id.hex()
        self.parent_id = raw.parent_span_id.hex()
        self.kind: int = raw.kind
        self.attrs = {a.key: value(a.value) for a in raw.attributes}
        self.start_ns: int = raw.start_time_unix_nano
        self.end_ns: int = raw.end_time_unix_nano


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.bodies: list[bytes] = []
        self.requests = 0

    async def traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415)
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        self.requests += 1
        self.bodies.append(body)
        for rs in msg.resource_spans:
            attrs = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(Span(s, attrs.get("service.name", "")))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[OtlpReceiver, str]]:
    """A receiver and its base URL (``http://127.0.0.1:PORT``)."""
    rx = OtlpReceiver()
    app = web.Application()
    app.router.add_post("/v1/traces", rx.traces)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield rx, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@asynccontextmanager
async def otlp_grpc_receiver() -> AsyncIterator[tuple[OtlpReceiver, str]]:
    """The same receiver over OTLP/gRPC (``TraceService/Export``); yields it and ``127.0.0.1:PORT``."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    rx = OtlpReceiver()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        async def Export(
            self, request: ExportTraceServiceRequest, context: Any
        ) -> ExportTraceServiceResponse:
            rx.requests += 1
            rx.bodies.append(request.SerializeToString())
            for rs in request.resource_spans:
                attrs = {a.key: value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        rx.spans.append(Span(s, attrs.get("service.name", "")))
            return ExportTraceServiceResponse()

    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield rx, f"127.0.0.1:{port}"
    finally:
        await server.stop(1)
