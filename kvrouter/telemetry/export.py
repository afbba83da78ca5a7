"""Spans out over OTLP: a traced request's phases, encoded when it ends, batched, and sent by the
OpenTelemetry SDK's exporter (http/protobuf or gRPC) from a thread of their own.

::

    request ends ──SpanSink.emit──▶ OtlpEncoder.spans ──▶ queue (bounded: full ─▶ dropped, counted)
    export thread: every schedule delay, or at a full batch ──▶ request bytes ──▶ SDK exporter ──▶ receiver

The SDK supplies what an operator configures: the resource (``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_SERVICE_NAME``), the exporters with their endpoint, headers, TLS, compression and timeout
(``OTEL_EXPORTER_OTLP_*``); batching follows the batch processor's variables (``OTEL_BSP_*``, read in
``config``).  The encoding is ``otlp_wire``'s (the SDK's costs several times more per span).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from opentelemetry.sdk.resources import Resource

from .config import TracingConfig
from .otlp_wire import OtlpEncoder
from .record import RequestRecord

log = logging.getLogger("kvrouter.telemetry")


class SpanSender(Protocol):
    """Sends one encoded ``ExportTraceServiceRequest``; True when the receiver took it."""

    def send(self, payload: bytes) -> bool: ...

    def shutdown(self) -> None: ...


class _HttpSender:
    def __init__(self, cfg: TracingConfig) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self.exporter = OTLPSpanExporter(endpoint=cfg.traces_endpoint, timeout=cfg.export_timeout_s)

    def send(self, payload: bytes) -> bool:
        return bool(self.exporter._client.export(payload).success)

    def shutdown(self) -> None:
        self.exporter.shutdown()


class _GrpcSender:
    def __init__(self, cfg: TracingConfig) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.sdk.trace.export import SpanExportResult

        class Exporter(OTLPSpanExporter):
            def _translate_data(self, data: Any) -> ExportTraceServiceRequest:
                return ExportTraceServiceRequest.FromString(data)  # already encoded (upb parses in C)

        e = cfg.endpoint
        insecure = None if e is None else e.startswith("http://") or "://" not in e
        self.exporter = Exporter(endpoint=e, insecure=insecure, timeout=cfg.export_timeout_s)
        self._ok = SpanExportResult.SUCCESS

    def send(self, payload: bytes) -> bool:
        return bool(self.exporter.export(payload) == self._ok)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self.exporter.shutdown()


def otlp_sender(cfg: TracingConfig) -> SpanSender:
    return _GrpcSender(cfg) if cfg.protocol == "grpc" else _HttpSender(cfg)


class SpanSink:
    def __init__(self, cfg: TracingConfig, sender: SpanSender | None = None) -> None:
        self.cfg = cfg
        resource = Resource.create({"service.name": cfg.service_name})
        self.encoder = OtlpEncoder(dict(resource.attributes))
        self.sender = sender or otlp_sender(cfg)
        self._pending: list[bytes] = []
        self._cv = threading.Condition()
        self._flushing = 0
        self._busy = False
        self._stop = False
        self.emitted = 0
        self.dropped = 0
        self.sent = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="kvrouter-otlp", daemon=True)
        self._thread.start()

    def emit(self, rec: RequestRecord) -> None:
        spans = self.encoder.spans(rec)
        with self._cv:
            if len(self._pending) + len(spans) > self.cfg.max_queue_size:
                self.dropped += len(spans)
                return
            self._pending.extend(spans)
            if len(self._pending) >= self.cfg.max_export_batch_size:
                self._cv.notify()
        self.emitted += 1

    def _run(self) -> None:
        batch = self.cfg.max_export_batch_size
        while True:
            with self._cv:
                if not self._stop and not self._flushing and len(self._pending) < batch:
                    self._cv.wait(self.cfg.schedule_delay_s)
                take, self._pending = self._pending[:batch], self._pending[batch:]
                stop = self._stop and not self._pending
                self._busy = bool(take)
            if take:
                try:
                    ok = self.sender.send(self.encoder.request(take))
                except Exception:  # the exporter's failure is never the request path's
                    log.exception("span export failed")
                    ok = False
                if ok:
                    self.sent += len(take)
                else:
                    self.failed += len(take)
            with self._cv:
                self._busy = False
                if not self._pending and self._flushing:
                    self._cv.notify_all()
            if stop:
                return

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Send what is queued now (blocking: call off the event loop)."""
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout_s)
            finally:
                self._flushing -= 1

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(self.cfg.export_timeout_s + 5)
        self.sender.shutdown()
