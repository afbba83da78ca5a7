"""One HTTP exchange through the gateway, as the picker sees it on one ext_proc stream: a thin shell around
the request pipeline (``pipeline.RequestPipeline``), as the aiohttp proxy is.

::

    request_headers ── admin path without the admin token: 401; bodyless (GET): admit ─▶ destination;
                       a body on a path outside api.routes.ROUTED: 404
    request_body ... end_of_stream ──▶ prepare ─▶ admit(only=subset) ─▶ destination + body
                                        └─ ApiError ─▶ immediate response (429, 503, 400, 404 ...)
    response_headers ──▶ served endpoint (a fallback? the load moves to it); status to upstream health
    response_body ... ──▶ first_token; usage block watched; chunks passed back unchanged
        end_of_stream ──▶ finished(served, usage)            stream gone early ──▶ finished(served, None)

Invariants: a request admitted is finished exactly once (``close`` runs whatever happened to the stream);
the load of an answer is on the target that served it; nothing of a prompt is logged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from ..api.errors import ApiError, BadRequest, NotFound, Overloaded, ServiceUnavailable, Unauthorized
from ..api.requests import Kind
from ..api.routes import kind_of, stored_response_id
from ..api.usage import UsageWatcher
from ..pipeline import Prepared
from ..routing import Candidate, Decision
from ..telemetry import RequestRecord
from . import protocol

if TYPE_CHECKING:
    from .picker import Picker

log = logging.getLogger("kvrouter.epp")

_INTERNAL = (protocol.ENDPOINT_HEADER, protocol.SERVED_KEY)
"""Headers between the gateway and the picker that the client never sees."""


class Exchange:
    """The state of one request on one ext_proc stream.  ``handle`` answers each message in order."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.kind: Kind | None = None
        self._body: list[bytes] = []
        self._size = 0
        self.prepared: Prepared | None = None
        self.decision: Decision | None = None
        self.sent: list[Candidate] = []
        """The targets named to the gateway, best first (the load is on the first until one is served)."""
        self.serving: Candidate | None = None
        """The target whose load this request holds (None before admission or once finished)."""
        self._held = contextlib.ExitStack()
        self._stream = False
        self._unary: list[bytes] = []
        self._unary_size = 0
        self._first = True
        self._watcher = UsageWatcher(self._response_id, self._response_output)
        self._dispatched_at = 0.0
        self.status: int | None = None
        self.rec: RequestRecord | None = None
        """This request's trace and access-log facts (None: neither traced nor logged)."""
        self._refused: int | None = None
        self._body_ns = 0

    # ------------------------------------------------------------------ the stream
    async def handle(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        which = msg.WhichOneof("request")
        if which == "request_headers":
            return await self._request_headers(msg)
        if which == "request_body":
            return await self._request_body(msg)
        if which == "request_trailers":
            out = await self._request_end(msg) if self.decision is None and self.kind is not None else []
            return [*out, protocol.trailers(request=True)]
        if which == "response_headers":
            return [self._response_headers(msg)]
        if which == "response_body":
            return self._response_body(msg)
        if which == "response_trailers":
            self._end_of_response()
            return [protocol.trailers(request=False)]
        return []

    def close(self) -> None:
        """The stream is over (answered, reset, or the client went away): release what is held."""
        if self.serving is not None and self.prepared is not None:
            self.picker.pipeline.finished(self.prepared, self.serving, None)
            self.serving = None
        self._held.close()
        status = self._refused or self.status or 499  # no answer at all: the client or Envoy went away
        self.picker.pipeline.end(self.rec, status)

    # ------------------------------------------------------------------ request path
    async def _request_headers(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        self.headers = protocol.header_map(msg.request_headers.headers)
        path = self.headers.get(":path", "")
        if not self.picker.pipeline.admin_allowed(path, self.headers.get("authorization")):
            return [self._refuse(Unauthorized("admin token required"))]
        self.rec = self.picker.pipeline.begin(path.split("?", 1)[0], self.headers)
        if self.rec is not None:
            self._body_ns = time.time_ns()
        try:
            self._held.enter_context(self.picker.pipeline.held())
        except (Overloaded, ServiceUnavailable) as e:
            return [self._refuse(e)]
        if msg.request_headers.end_of_stream:
            return await self._bodyless(msg)
        self.kind = kind_of(path)
        if self.kind is None:
            return [self._refuse(NotFound(f"no such route: {path}"))]
        return []  # the answer waits for the whole body

    async def _request_body(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        if self.kind is None:
            return []
        b = msg.request_body
        self._size += len(b.body)
        if self._size > self.picker.cfg.limits.max_body_bytes:
            self.kind = None
            return [self._refuse(BadRequest("request body too large", reason="body_too_large"), status=413)]
        self._body.append(b.body)
        if b.end_of_stream or b.end_of_stream_without_message:
            return await self._request_end(msg)
        return []

    async def _request_end(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        pl = self.picker.pipeline
        raw = b"".join(self._body)
        self._body = []
        if self.rec is not None:
            # The picker's side of the exchange: Envoy streamed the body from its headers to its end.
            self.rec.phase(
                "kvrouter.epp.request_body", self._body_ns, time.time_ns(), {"kvrouter.body_bytes": len(raw)}
            )
        try:
            subset = protocol.subset_of(msg.metadata_context)
            p = self.prepared = await pl.prepare(raw, self.kind, self.headers, rec=self.rec)
            only = self.picker.endpoints().targets(subset) if subset is not None else None
            d = await pl.admit(p, only=only)
        except ApiError as e:
            return [self._refuse(e)]
        self.decision = d
        self._stream = p.req.stream
        return protocol.routed(
            self._dispatch(p, d), p.req.encoded_body(), self._route_headers(d), limit=self.picker.chunk_bytes
        )

    async def _bodyless(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        """A request without a body (GET /v1/models ...): routed by load among the candidates; a stored
        response's GET or cancel to the instance holding it."""
        pl = self.picker.pipeline
        try:
            subset = protocol.subset_of(msg.metadata_context)
            p = self.prepared = pl.prepare_bodyless()
            p.rec = self.rec
            stored = stored_response_id(self.headers.get(":path", ""))
            if stored is not None:
                p.pinned = (await pl.holder(stored)).instance
            only = self.picker.endpoints().targets(subset) if subset is not None else None
            d = await pl.admit(p, only=only)
        except ApiError as e:
            return [self._refuse(e)]
        self.decision = d
        return [protocol.bodyless_routed(self._dispatch(p, d), self._route_headers(d))]

    def _dispatch(self, p: Prepared, d: Decision) -> list[protocol.Endpoint]:
        assert d.chosen is not None
        emap = self.picker.endpoints()
        self.sent = emap.ordered(d.chosen, d.ranked, self.picker.fallbacks)
        self.serving = d.chosen
        self.picker.pipeline.dispatched(p, d.chosen)
        self._dispatched_at = time.monotonic()
        self.picker.metrics.picks.labels(d.policy, d.reason).inc()
        log.debug(
            "picked", extra={"request": p.inp.request_id, "target": d.chosen.target, "reason": d.reason}
        )
        return [emap.endpoint[c.instance] for c in self.sent]

    def _route_headers(self, d: Decision) -> dict[str, str]:
        """Request headers for the model server: the rank pin of a data-parallel instance."""
        assert d.chosen is not None
        out = {} if self.prepared is None else self.prepared.trace_headers()  # vLLM's parent span
        inst = self.picker.pool.upstreams.get(d.chosen.instance)
        if inst is not None and inst.cfg.dp_size > 1:
            out["x-data-parallel-rank"] = str(d.chosen.dp_rank)
        return out

    def _refuse(self, e: ApiError, status: int | None = None) -> ProcessingResponse:
        code = status or e.status
        self._refused = code
        self.picker.metrics.immediate.labels(str(code), e.reason).inc()
        retry = getattr(e, "retry_after_s", None) or self.picker.cfg.limits.retry_after_s
        headers = {"retry-after": str(retry)} if isinstance(e, (Overloaded, ServiceUnavailable)) else None
        return protocol.immediate(code, e.body(), headers)

    # ------------------------------------------------------------------ response path
    def _response_headers(self, msg: ProcessingRequest) -> ProcessingResponse:
        h = protocol.header_map(msg.response_headers.headers)
        try:
            self.status = int(h.get(":status", "0"))
        except ValueError:
            self.status = 0
        self._stream = self._stream or h.get("content-type", "").startswith("text/event-stream")
        served = self._served(protocol.served_of(msg.metadata_context))
        if self.prepared is not None and self.serving is not None:
            self.picker.pipeline.answered(self.prepared, self.status)
        pool = self.picker.pool
        if served is not None and served.instance in pool.upstreams:
            if self.status >= 500:
                pool.record_failure(served.instance, connection=False)
            else:
                pool.record_success(served.instance)
        out = self._decision_headers(served)
        if msg.response_headers.end_of_stream:
            self._end_of_response()
        return protocol.response_headers(out, remove=_INTERNAL)

    def _served(self, ep: protocol.Endpoint | None) -> Candidate | None:
        """The target that served the request.  When the gateway fell back past the first, the first
        failed: its load and failure are recorded, and the load moves to the one that served."""
        cur = self.serving
        if cur is None or ep is None or self.prepared is None:
            return cur
        emap = self.picker.endpoints()
        if emap.endpoint.get(cur.instance) == ep:
            return cur
        got = next((c for c in self.sent if emap.endpoint.get(c.instance) == ep), None)
        if got is None:
            self.picker.metrics.served_unknown.inc()
            return cur
        pl = self.picker.pipeline
        pl.finished(self.prepared, cur, None)
        self.picker.pool.record_failure(cur.instance, connection=True)
        self.picker.metrics.fallbacks.labels(got.target).inc()
        pl.dispatched(self.prepared, got)
        self.serving = got
        return got

    def _decision_headers(self, served: Candidate | None) -> dict[str, str]:
        d, p = self.decision, self.prepared
        if d is None or p is None or served is None:
            return {}
        out = {
            "x-kvrouter-instance": served.target,
            "x-kvrouter-cached-tokens": str(served.hit_tokens),
            "x-kvrouter-policy": d.policy,
            "x-kvrouter-reason": d.reason,
        }
        if p.slo is not None:
            out["x-kvrouter-slo"] = p.slo
        return out

    def _response_body(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        b = msg.response_body
        eos = b.end_of_stream or b.end_of_stream_without_message
        if self.serving is not None and self.prepared is not None:
            if self._stream:
                if self._first and b.body:
                    self._first_token()
                self._watcher.feed_stream(b.body)
            elif self._unary_size + len(b.body) <= self.picker.options.max_response_buffer:
                self._unary.append(b.body)
                self._unary_size += len(b.body)
            else:  # too large to keep: the answer passes, its usage goes unread
                self._unary, self._unary_size = [], self.picker.options.max_response_buffer + 1
        out = [
            protocol.body_response(piece, eos and last, request=False)
            for piece, last in protocol.chunks(b.body, self.picker.chunk_bytes)
        ]
        if eos:
            self._end_of_response()
        return out

    def _response_id(self, response_id: str) -> None:
        """A Responses answer's id went by: a request continuing it must go where it was made."""
        if self.prepared is not None and self.serving is not None and self.kind == "responses":
            self.picker.pipeline.response_seen(self.prepared, response_id, self.serving)

    def _response_output(self, response_id: str, output: list[dict[str, Any]]) -> None:
        """A stored response was answered: kept for a continuation's tokens (``pipeline.response_done``)."""
        if self.prepared is not None and self.kind == "responses":
            self.picker.pipeline.response_done(self.prepared, response_id, output)

    def _first_token(self, *, streamed: bool = True) -> None:
        assert self.prepared is not None and self.serving is not None
        self._first = False
        self.picker.pipeline.first_token(self.prepared, streamed=streamed)
        self.picker.metrics.upstream_ttft.labels(self.serving.target).observe(
            time.monotonic() - self._dispatched_at, self.prepared.exemplar()
        )

    def _end_of_response(self) -> None:
        """The answer is complete: the load is released with what vLLM reported (a 2xx answer only)."""
        if self.serving is None or self.prepared is None:
            return
        if not self._stream:
            if self._first:
                self._first_token(streamed=False)
            self._watcher.feed_body(b"".join(self._unary))
            self._unary = []
        ok = self.status is not None and 200 <= self.status < 300
        self.picker.pipeline.finished(self.prepared, self.serving, self._watcher.report if ok else None)
        self.serving = None
