"""What one request did, as the request path records it: plain values, no exporter, no SDK.

``RequestRecord`` (made by ``Telemetry.begin`` when the request is traced or logged; None otherwise)
holds the access log's facts (route, model, tenant, instance, policy, reason, predicted and reported
cached tokens, queue wait, TTFT, status) and, when traced, its spans as ``Phase`` values: request (parse,
tokenize, index_lookup, decision, queue_wait) and one upstream per attempt or leg (ids known before it is
sent, for traceparent), with upstream_connect, first_token and completion below it.

Spans are recorded as the request goes and handed to the exporter once it is over, so the request path
pays for a few clock reads and list appends, never for the SDK.  Invariant: attributes are counts,
names and ids: never a prompt, a message or an answer.
"""

from __future__ import annotations

import time
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

Attrs = dict[str, Any]
SpanTuple = tuple[str, int, "int | None", str, int, int, Attrs]
"""One span as it crosses to the exporter: name, span id, parent span id (None: none), kind, start and
end (ns since the epoch), attributes."""
Compact = tuple[bytes, "str | None", bool, list[SpanTuple]]
"""A traced request's spans for the exporter, built of plain values only (msgpack carries them to the
exporter's process): trace id (16 bytes, big-endian), tracestate, whether the root's parent is the
client's (remote) span, and the spans, the root first."""
_ROOT_FACTS = tuple(
    (k, f"kvrouter.{k}")
    for k in ("model", "tenant", "request_id", "instance", "prefill_instance", "attempts")
)
"""The facts the root span carries, with their attribute names."""


class Phase:
    __slots__ = ("attrs", "end_ns", "kind", "name", "parent", "span_id", "start_ns")

    def __init__(self, name: str, start_ns: int, parent: int | None, span_id: int, kind: str = "internal"):
        self.name = name
        self.start_ns = start_ns
        self.end_ns = 0
        self.attrs: Attrs = {}
        self.parent = parent
        """The parent phase's span id (None: the request's root, whose parent is the client's span)."""
        self.span_id = span_id
        self.kind = kind


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """W3C trace context: (trace id, parent span id, sampled), or None when absent or malformed."""
    if not value or len(value) < 55:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(flags & 1)


def traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class RequestRecord:
    """One request's facts and (when traced) its spans.  Owned by the request's task."""

    def __init__(
        self,
        route: str,
        *,
        traced: bool,
        trace_id: int,
        root_id: int,
        parent: tuple[int, int, bool] | None,
        tracestate: str | None,
        ids: Any,
    ) -> None:
        self.route = route
        self.traced = traced
        self.trace_id = trace_id
        self.parent = parent
        """The client's (trace id, span id, sampled), when it sent a valid ``traceparent``."""
        self.tracestate = tracestate
        self._ids = ids
        """Draws span ids (``random.Random.getrandbits``)."""
        self.start_ns = time.time_ns()
        self.facts: Attrs = {"route": route}
        self.phases: list[Phase] = []
        self.root = Phase("kvrouter.request", self.start_ns, None, root_id, "server")
        self.upstream: Phase | None = None
        """The attempt or leg on its way now (its span is the parent vLLM is told of)."""
        self._upstream_mark = 0
        self._exemplar: dict[str, str] | None = None

    # ------------------------------------------------------------------ spans
    def phase(
        self, name: str, start_ns: int, end_ns: int, attrs: Attrs | None = None, parent: Phase | None = None
    ) -> Phase:
        """A finished step (recorded only when traced; the phase is returned either way)."""
        ph = Phase(name, start_ns, (parent or self.root).span_id, self._ids(64) or 1)
        ph.end_ns = end_ns
        ph.attrs = attrs or {}
        if self.traced:
            self.phases.append(ph)
        return ph

    def upstream_started(self, leg: str, target: str, attempt: int) -> None:
        """An attempt (or a disaggregated request's leg) is being sent: its span, open until it ends."""
        now = time.time_ns()
        self.upstream_ended()
        up = Phase(f"kvrouter.upstream.{leg}", now, self.root.span_id, self._ids(64) or 1, "client")
        up.attrs = {"kvrouter.leg": leg, "kvrouter.target": target, "kvrouter.attempt": attempt}
        self.upstream = up
        self._upstream_mark = now
        if self.traced:
            self.phases.append(up)

    def upstream_headers(self) -> dict[str, str]:
        """The trace context for the upstream request: the open attempt's span when traced; the client's
        own context passed on unchanged otherwise (the router took no part in its trace)."""
        if self.traced and self.upstream is not None:
            h = {TRACEPARENT: traceparent(self.trace_id, self.upstream.span_id)}
        elif self.parent is not None:
            t, s, sampled = self.parent
            h = {TRACEPARENT: traceparent(t, s, sampled)}
        else:
            return {}
        if self.tracestate:
            h[TRACESTATE] = self.tracestate
        return h

    def upstream_answered(self, status: int) -> None:
        up = self.upstream
        if up is None:
            return
        now = time.time_ns()
        up.attrs["http.response.status_code"] = status
        self.phase("kvrouter.upstream_connect", self._upstream_mark, now, parent=up)
        self._upstream_mark = now

    def first_token(self) -> None:
        up = self.upstream
        now = time.time_ns()
        if "ttft_ms" not in self.facts:
            self.facts["ttft_ms"] = round((now - self.start_ns) / 1e6, 3)
        if up is None:
            return
        self.phase("kvrouter.first_token", self._upstream_mark, now, parent=up)
        self._upstream_mark = now

    def upstream_ended(self, **attrs: Any) -> None:
        up = self.upstream
        if up is None:
            return
        now = time.time_ns()
        self.phase("kvrouter.completion", self._upstream_mark, now, parent=up)
        up.attrs.update(attrs)
        up.end_ns = now
        self.upstream = None

    # ------------------------------------------------------------------ the end
    def ended(self, status: int) -> None:
        self.upstream_ended()
        now = time.time_ns()
        self.root.end_ns = now
        self.facts["status"] = status
        self.facts["duration_ms"] = round((now - self.start_ns) / 1e6, 3)
        f = self.facts
        attrs = self.root.attrs
        attrs["http.route"] = self.route
        attrs["http.response.status_code"] = status
        for k, name in _ROOT_FACTS:  # the rest is on the steps' own spans
            v = f.get(k)
            if v is not None:
                attrs[name] = v

    def compact(self) -> Compact:
        """The spans as plain values, once ended (a phase still open ends with the request)."""
        end = self.root.end_ns
        root = self.root
        client = self.parent
        spans: list[SpanTuple] = [
            (
                root.name,
                root.span_id,
                None if client is None else client[1],
                root.kind,
                root.start_ns,
                end,
                root.attrs,
            )
        ]
        spans += [
            (p.name, p.span_id, p.parent, p.kind, p.start_ns, p.end_ns or end, p.attrs) for p in self.phases
        ]
        return (self.trace_id.to_bytes(16, "big"), self.tracestate, client is not None, spans)

    @property
    def trace_hex(self) -> str:
        return f"{self.trace_id:032x}"

    def exemplar(self) -> dict[str, str] | None:
        """The exemplar labels of a traced request's observations (None: not traced); made once."""
        if not self.traced:
            return None
        ex = self._exemplar
        if ex is None:
            ex = self._exemplar = {"trace_id": self.trace_hex}
        return ex
