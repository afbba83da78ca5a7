"""The fleet file's ``tracing:`` and ``access_log:`` sections, and the standard OpenTelemetry variables.

``tracing``: ``enabled`` (or ``OTEL_TRACES_EXPORTER=otlp``; ``OTEL_SDK_DISABLED=true`` turns it off),
``sample_rate`` (parent-based ratio), ``endpoint`` and ``protocol`` (else the ``OTEL_EXPORTER_OTLP_*``
variables), ``service_name`` (``OTEL_SERVICE_NAME`` wins).  ``access_log``: ``enabled`` and
``sample_rate`` of the requests not traced (a traced request is always logged).

Where both say something, the variable wins, as OpenTelemetry's configuration rules have it; the
sampler variables (``OTEL_TRACES_SAMPLER`` ``always_on`` / ``always_off`` / ``traceidratio`` /
``parentbased_*`` with ``OTEL_TRACES_SAMPLER_ARG``) set ``sample_rate`` and whether a sampled parent is
followed.  The exporter's other variables (headers, timeouts, batching, resource attributes) are read by
the SDK itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from indexer.errors import ConfigError

PROTOCOLS = ("http/protobuf", "grpc")


class TracingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = False
    """Export spans of the requests sampled (OTLP).  Off: no span is made and nothing is exported."""
    sample_rate: float = 0.01
    """Fraction of requests traced when the client sent no sampled ``traceparent`` (0..1)."""
    parent_based: bool = True
    """Follow the client's decision: a request whose ``traceparent`` is sampled is traced, one whose
    ``traceparent`` is not sampled is not."""
    endpoint: str | None = None
    """The OTLP receiver (``http://collector:4318`` for http/protobuf, ``collector:4317`` for grpc)."""
    protocol: str | None = None
    """``http/protobuf`` (default) or ``grpc``."""
    service_name: str = "kvrouter"
    export_timeout_s: float = 10.0
    schedule_delay_s: float = 5.0
    """Spans wait this long at most before they are sent (``OTEL_BSP_SCHEDULE_DELAY``, in ms there)."""
    max_queue_size: int = 2048
    """Spans queued at most; past it a request's spans are dropped (``OTEL_BSP_MAX_QUEUE_SIZE``)."""
    max_export_batch_size: int = 512
    """Spans per export request (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``)."""
    export_process: bool = True
    """Encode and send spans in a process of their own (fed over a pipe), off the router's CPU and GIL;
    False: on a thread of the router's process."""

    def validate(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ConfigError("tracing.sample_rate must be between 0 and 1")
        if self.protocol is not None and self.protocol not in PROTOCOLS:
            raise ConfigError(f"tracing.protocol must be one of {', '.join(PROTOCOLS)}")
        if self.schedule_delay_s <= 0 or self.max_export_batch_size < 1 or self.max_queue_size < 1:
            raise ConfigError(
                "tracing: schedule_delay_s, max_queue_size and max_export_batch_size must be > 0"
            )

    def with_env(self, environ: Mapping[str, str] = os.environ) -> TracingConfig:
        """The standard ``OTEL_*`` variables applied over the file's values."""
        out: dict[str, object] = {}
        if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "otlp":
            out["enabled"] = True
        if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
            out["enabled"] = False
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            out["enabled"] = False
        sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
        if sampler:
            parent = sampler.startswith("parentbased_")
            kind = sampler.removeprefix("parentbased_")
            rates = {"always_on": 1.0, "always_off": 0.0}
            if kind in rates:
                out["sample_rate"] = rates[kind]
            elif kind == "traceidratio":
                try:
                    arg = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1"))
                except ValueError:
                    raise ConfigError("OTEL_TRACES_SAMPLER_ARG must be a number") from None
                out["sample_rate"] = min(1.0, max(0.0, arg))
            else:
                raise ConfigError(f"OTEL_TRACES_SAMPLER={sampler!r} is not supported")
            out["parent_based"] = parent
        for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            if environ.get(var):
                out.setdefault("endpoint", environ[var])
        for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            if environ.get(var):
                out.setdefault("protocol", environ[var].strip().lower())
        if environ.get("OTEL_SERVICE_NAME"):
            out["service_name"] = environ["OTEL_SERVICE_NAME"]
        for var, key, scale in (
            ("OTEL_BSP_SCHEDULE_DELAY", "schedule_delay_s", 1e-3),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "max_queue_size", 1),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "max_export_batch_size", 1),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "export_timeout_s", 1e-3),
        ):
            if environ.get(var):
                try:
                    n = float(environ[var]) * scale
                except ValueError:
                    raise ConfigError(f"{var} must be a number") from None
                out[key] = n if scale != 1 else int(n)
        cfg = msgspec.structs.replace(self, **out) if out else self
        cfg.validate()
        return cfg

    @property
    def traces_endpoint(self) -> str | None:
        """Where spans go: over http/protobuf a base URL gets the signal path (``/v1/traces``), as the
        variables' rules say for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        e = self.endpoint
        if e is None or self.protocol == "grpc" or e.rstrip("/").endswith("/v1/traces"):
            return e
        return e.rstrip("/") + "/v1/traces"


class AccessLogConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = False
    """One structured line per request on the ``kvrouter.access`` logger (never a prompt or an answer)."""
    sample_rate: float = 1.0
    """Fraction of untraced requests logged; a traced request is always logged (its trace id with it)."""

    def validate(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ConfigError("access_log.sample_rate must be between 0 and 1")
