"""Which requests are traced and logged, and what happens to them when they end.

::

    begin(route, headers) ─▶ traced?  the client's traceparent decides when it sent a valid one (and
                             tracing.parent_based), else sample_rate
                             logged?  traced, or access_log.sample_rate
                             neither ─▶ None: the request path records nothing (its hooks test for None)
    end(record, status)   ─▶ traced: spans to the SpanSink; logged: one line on ``kvrouter.access``

Tracing off and the access log off, ``begin`` reads one header and returns None: the cost of a request
that is not traced is a header lookup (the client's ``traceparent`` is still passed on to vLLM, by the
front door's header copy).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping

from .config import AccessLogConfig, TracingConfig
from .export import SpanSink
from .record import TRACEPARENT, TRACESTATE, RequestRecord, parse_traceparent

access_log = logging.getLogger("kvrouter.access")

_LOGGED = (
    "route",
    "model",
    "tenant",
    "request_id",
    "instance",
    "prefill_instance",
    "policy",
    "reason",
    "predicted_cached_tokens",
    "reported_cached_tokens",
    "prompt_tokens",
    "queue_wait_ms",
    "ttft_ms",
    "duration_ms",
    "attempts",
    "status",
)
"""The access log's fields, in order (plus ``trace_id`` and ``traced``)."""


class Telemetry:
    def __init__(
        self,
        tracing: TracingConfig | None = None,
        access: AccessLogConfig | None = None,
        *,
        sink: SpanSink | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.tracing = tracing = tracing or TracingConfig()
        self.access = access = access or AccessLogConfig()
        self.sink = sink if sink is not None else (SpanSink(tracing) if tracing.enabled else None)
        self.rng = rng or random.Random()
        self._rate = tracing.sample_rate if self.sink is not None else 0.0
        self._log_rate = access.sample_rate if access.enabled else 0.0
        self.on = self.sink is not None or access.enabled
        """False: ``begin`` always returns None."""
        self.logged = 0

    def begin(self, route: str, headers: Mapping[str, str]) -> RequestRecord | None:
        if not self.on:
            return None
        parent = parse_traceparent(headers.get(TRACEPARENT))
        rnd = self.rng.random
        if self.sink is None:
            traced = False
        elif parent is not None and self.tracing.parent_based:
            traced = parent[2]
        else:
            traced = self._rate >= 1.0 or (self._rate > 0.0 and rnd() < self._rate)
        logged = traced or self._log_rate >= 1.0 or (self._log_rate > 0.0 and rnd() < self._log_rate)
        if not logged:
            return None
        bits = self.rng.getrandbits
        return RequestRecord(
            route,
            traced=traced,
            trace_id=parent[0] if parent is not None else (bits(128) or 1),
            root_id=bits(64) or 1,
            parent=parent,
            tracestate=headers.get(TRACESTATE) if parent is not None else None,
            ids=bits,
        )

    def end(self, rec: RequestRecord | None, status: int) -> None:
        if rec is None or rec.root.end_ns:
            return
        rec.ended(status)
        if rec.traced and self.sink is not None:
            try:
                self.sink.emit(rec)
            except Exception:  # an exporter's bug must never fail a request that was answered
                logging.getLogger("kvrouter.telemetry").exception("span export failed")
        if self.access.enabled:
            f = rec.facts
            line = {k: f.get(k) for k in _LOGGED}
            line["trace_id"] = rec.trace_hex if rec.traced or rec.parent is not None else None
            line["traced"] = rec.traced
            access_log.info("request", extra=line)
            self.logged += 1

    def shutdown(self) -> None:
        if self.sink is not None:
            self.sink.shutdown()
