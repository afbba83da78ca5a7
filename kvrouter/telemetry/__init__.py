"""Seeing one request end to end: OpenTelemetry traces and the access log.

::

    config.py     TracingConfig (fleet file ``tracing:`` + OTEL_* variables), AccessLogConfig
    record.py     RequestRecord: one request's facts and phases, recorded as it goes (no SDK)
    otlp_wire.py  OtlpEncoder: a request's spans written straight to OTLP protobuf
    export.py     SpanSink: traced requests' spans queued as plain values, batched, and shipped (encoded
                  and sent with the OpenTelemetry SDK's exporter) by the exporter's process or a thread
    exporter_proc.py  the exporter's own process (``python -m kvrouter.telemetry.exporter_proc``)
    telemetry.py  Telemetry: which requests are traced or logged; their end (spans out, one log line)

The request path (``pipeline``) holds the hooks; front doors only begin and end a record.
"""

from .config import AccessLogConfig, TracingConfig
from .record import RequestRecord, parse_traceparent, traceparent
from .telemetry import Telemetry

__all__ = [
    "AccessLogConfig",
    "RequestRecord",
    "Telemetry",
    "TracingConfig",
    "parse_traceparent",
    "traceparent",
]
