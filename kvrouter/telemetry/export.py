"""Spans out through the OpenTelemetry SDK: a ``TracerProvider`` with a batching processor and an OTLP
exporter (http/protobuf or gRPC), fed the phases a finished ``RequestRecord`` holds.

::

    RequestRecord (ended) ──emit──▶ tracer.start_span(start_time=..., ids preset) ... span.end(end_time)
                                      └── BatchSpanProcessor ──(its own thread)──▶ OTLP receiver

The span ids were drawn while the request ran (vLLM was told its parent's id in ``traceparent`` before
the span existed), so the provider's id generator hands out the ids of the span being made.  One
provider per process (a worker of ``serve --workers N`` makes its own after the fork).
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState

from .config import TracingConfig
from .record import RequestRecord

log = logging.getLogger("kvrouter.telemetry")

_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}


class _PresetIds(IdGenerator):
    """The ids of the span being made (set just before ``start_span``; one thread emits)."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def generate_span_id(self) -> int:
        return self.span_id

    def generate_trace_id(self) -> int:
        return self.trace_id


def otlp_exporter(cfg: TracingConfig) -> SpanExporter:
    """The OTLP exporter the configuration names (the SDK reads the other ``OTEL_EXPORTER_OTLP_*``)."""
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=cfg.endpoint, insecure=_insecure(cfg.endpoint), timeout=cfg.export_timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=cfg.traces_endpoint, timeout=cfg.export_timeout_s)


def _insecure(endpoint: str | None) -> bool | None:
    if endpoint is None:
        return None
    return endpoint.startswith("http://") or "://" not in endpoint


class SpanSink:
    """Turns finished records into SDK spans and exports them."""

    def __init__(self, cfg: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self._ids = _PresetIds()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            id_generator=self._ids,
            sampler=ALWAYS_ON,  # the request path already decided: only traced records come here
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter or otlp_exporter(cfg)))
        self.tracer = self.provider.get_tracer("kvrouter")
        self.emitted = 0

    def emit(self, rec: RequestRecord) -> None:
        ids, tracer = self._ids, self.tracer
        ids.trace_id = rec.trace_id
        ctx: Any = None
        if rec.parent is not None:
            t, s, sampled = rec.parent
            state = TraceState.from_header([rec.tracestate]) if rec.tracestate else None
            remote = SpanContext(t, s, True, TraceFlags(TraceFlags.SAMPLED if sampled else 0), state)
            ctx = otel.set_span_in_context(NonRecordingSpan(remote))
        root = rec.root
        ids.span_id = root.span_id
        made = {
            root.span_id: tracer.start_span(
                root.name, ctx, _KINDS[root.kind], root.attrs, start_time=root.start_ns
            )
        }
        for ph in rec.phases:
            parent = made.get(ph.parent if ph.parent is not None else root.span_id, made[root.span_id])
            ids.span_id = ph.span_id
            made[ph.span_id] = span = tracer.start_span(
                ph.name, otel.set_span_in_context(parent), _KINDS[ph.kind], ph.attrs, start_time=ph.start_ns
            )
            span.end(ph.end_ns or root.end_ns)
        made[root.span_id].end(root.end_ns)
        self.emitted += 1

    def shutdown(self) -> None:
        self.provider.shutdown()
