"""Forwarding a request of a disaggregated model: its prefill leg, then its decode leg (vLLM 0.33, NIXL).

A plan (``pipeline.admit_plan``) is whole (``Proxy.forward`` to the decode instance) or split: the
prefill leg (``api.kv_transfer.prefill_leg_body``) goes to P, retried on the next prefill instance after
a 5xx, a connection error or a timeout (up to ``max_retries``); with none left, or P without a KV
connector, the request is served whole on D.  The decode leg (the client's body with P's
``kv_transfer_params`` verbatim, one X-Request-Id for both legs) goes to D; its first chunk is read
before the client's answer begins, so a decode instance that fails before it costs nothing.  After the
first byte, a failure ends the stream with an error event, as for any request.

Invariants: the client's answer is D's (vLLM reports P's cache hit as the decode leg's
``cached_tokens``, so usage covers the request once); each leg's load is released exactly once, in a
``finally`` (``pipeline.prefill_finished`` / ``pipeline.finished``); a prefill instance's blocks that no
decode leg reads are freed by its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, NamedTuple

import aiohttp
import msgspec

from ..api.errors import BadGateway
from ..api.kv_transfer import answer_params, decode_leg_body, leg_kind, prefill_leg_body
from ..api.usage import UsageReport, UsageWatcher
from ..pipeline import Prepared
from ..routing import Candidate, PDPlan
from .downstream import Downstream
from .errors import ClientGone, UpstreamFailed
from .proxy import _HOP, Answer, Proxy

log = logging.getLogger("kvrouter.gateway.disagg")


class Refused(NamedTuple):
    """A prefill leg's 4xx: the request is refused (the decode instance would refuse it too)."""

    status: int
    body: bytes


class DisaggProxy:
    """The two legs of split requests, on top of the proxy's connections, pool and metrics."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.pipeline = proxy.pipeline
        self.pool = proxy.pool
        self.metrics = proxy.metrics
        self.pd = proxy.pipeline.metrics.pd

    def _timeout(self) -> aiohttp.ClientTimeout:
        return self.proxy.timeout

    async def route(self, down: Downstream, p: Prepared, path: str) -> None:
        """Plan a prepared request of a disaggregated model (waiting for capacity), then forward it."""
        plan = await self.pipeline.admit_plan(p)
        decision = plan.prefill if plan.split and plan.prefill is not None else plan.decode
        extra = {
            "x-kvrouter-policy": decision.policy,
            "x-kvrouter-reason": decision.reason,
            "x-kvrouter-decision-ms": f"{(time.perf_counter() - p.started) * 1e3:.3f}",
        }
        try:
            await self.forward(down, p, plan, path, extra)
        finally:
            self.pipeline.unclaim(p)  # the decode slot held through the prefill leg, if never taken

    async def forward(
        self, down: Downstream, p: Prepared, plan: PDPlan, path: str, extra_headers: dict[str, str]
    ) -> None:
        d = plan.decode.chosen
        assert d is not None
        extra = {**extra_headers, "x-kvrouter-pd": "split" if plan.split else "whole"}
        extra["x-kvrouter-pd-reason"] = plan.reason
        if not plan.split:
            await self.proxy.forward(down, p, d, path, extra)
            return
        rid = down.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
        got = await self._prefill(down, p, plan, path, rid)
        if isinstance(got, Refused):
            down.answer(got.status, {"Content-Type": "application/json"}, got.body)
            return
        if got is None:
            self.pd.fallbacks.labels("prefill_failed").inc()
            extra["x-kvrouter-pd"], extra["x-kvrouter-pd-reason"] = "whole", "prefill_failed"
            await self.proxy.forward(down, p, d, path, extra)
            return
        params, pc = got
        extra["x-kvrouter-prefill-instance"] = pc.target
        try:
            await self._decode(down, p, d, pc, params, path, extra, rid)
        except UpstreamFailed as e:
            self.pool.record_failure(d.instance, connection=e.connection)
            self.pd.leg_failures.labels("decode", e.reason).inc()
            log.warning(
                "decode leg failed before its first byte: serving the request whole",
                extra={"instance": d.target, "reason": e.reason, "request": rid},
            )
            nxt = self.pipeline.reroute(p, {d.target})
            if nxt is None:
                self.metrics.pipeline.rejections.labels("upstream_failed").inc()
                raise BadGateway(f"decode leg failed: {e.reason}, and no other instance is up") from None
            self.pd.fallbacks.labels("decode_failed").inc()
            extra["x-kvrouter-pd"], extra["x-kvrouter-pd-reason"] = "whole", "decode_failed"
            del extra["x-kvrouter-prefill-instance"]
            await self.proxy.forward(down, p, nxt, path, extra)

    # ------------------------------------------------------------------ prefill leg
    async def _prefill(
        self, down: Downstream, p: Prepared, plan: PDPlan, path: str, rid: str
    ) -> tuple[dict[str, Any], Candidate] | Refused | None:
        """The prefill leg (to the route the client called), retried on other prefill instances: the
        params and the instance that holds the prompt; a 4xx answer (the request is refused: the decode
        instance would refuse it too); or None (no prefill instance could compute it)."""
        cur = plan.prefill_target
        assert cur is not None
        kind = leg_kind(p.req.kind)
        assert kind is not None  # RequestPipeline.disaggregated: only splittable routes come here
        body = msgspec.json.encode(prefill_leg_body(p.req.body, kind))
        tried: set[str] = set()
        for attempt in range(self.proxy.max_retries + 1):
            tried.add(cur.target)
            self.pipeline.prefill_dispatched(p, cur)
            usage: UsageReport | None = None
            try:  # the leg's load is released in every path, exactly once (the finally)
                status, data = await self._prefill_once(down, p, cur, body, path, rid)
                if status != 200:
                    return Refused(status, data)
                watcher = UsageWatcher()
                watcher.feed_body(data)
                usage = watcher.report
                params = answer_params(data)
                if params is None:
                    # An instance without a KV connector computed the prompt and cannot hand it over.
                    self.pd.leg_failures.labels("prefill", "no_kv_transfer_params").inc()
                    return None
                return params, cur
            except UpstreamFailed as e:
                self.pool.record_failure(cur.instance, connection=e.connection)
                self.pd.leg_failures.labels("prefill", e.reason).inc()
                log.warning(
                    "prefill leg failed",
                    extra={"instance": cur.target, "reason": e.reason, "attempt": attempt, "request": rid},
                )
                reason = e.reason
            finally:
                self.pipeline.prefill_finished(p, cur, usage)
            nxt = self.pipeline.reroute_prefill(p, plan, tried) if attempt < self.proxy.max_retries else None
            if nxt is None:
                return None
            self.metrics.retries.labels(reason).inc()
            cur = nxt
        return None

    async def _prefill_once(
        self, down: Downstream, p: Prepared, cur: Candidate, body: bytes, path: str, rid: str
    ) -> tuple[int, bytes]:
        """One prefill leg: its status and body; ``UpstreamFailed`` for what another instance may fix."""
        headers = self.proxy.upstream_headers(down, p, cur)
        headers["x-request-id"] = rid
        t0 = time.monotonic()
        resp = await self.proxy._post(self.pool.url(cur.instance) + path, body, headers, self._timeout())
        self.pipeline.answered(p, resp.status)
        try:
            data = await self.proxy._read_all(resp)
        finally:
            resp.release()
        if resp.status >= 500:
            raise UpstreamFailed(f"status_{resp.status}", connection=False)
        self.pool.record_success(cur.instance)
        if resp.status == 200:
            self.pd.prefill_seconds.observe(time.monotonic() - t0)
        return resp.status, data

    # ------------------------------------------------------------------ decode leg
    async def _decode(
        self,
        down: Downstream,
        p: Prepared,
        d: Candidate,
        pc: Candidate,
        params: dict[str, Any],
        path: str,
        extra: dict[str, str],
        rid: str,
    ) -> None:
        """The decode leg; ``UpstreamFailed`` if it fails before its first byte."""
        body = msgspec.json.encode(decode_leg_body(p.req.body, params))
        self.pipeline.dispatched(p, d, received=True)
        headers = self.proxy.upstream_headers(down, p, d)  # (after: the decode leg's trace context)
        headers["x-request-id"] = rid
        t0 = time.monotonic()
        on_id = on_output = None
        if p.req.kind == "responses":  # the decode instance stores the response: follow-ups go there

            def on_id(response_id: str) -> None:
                self.pipeline.response_seen(p, response_id, d)

            def on_output(response_id: str, output: list[dict[str, Any]]) -> None:
                self.pipeline.response_done(p, response_id, output)

        watcher = UsageWatcher(on_id, on_output)
        resp: Answer | None = None
        done = False
        try:  # the leg's load is released in every path, exactly once (the finally)
            resp = await self.proxy._post(self.pool.url(d.instance) + path, body, headers, self._timeout())
            self.pipeline.answered(p, resp.status)
            if resp.status >= 500:
                raise UpstreamFailed(f"status_{resp.status}", connection=False)
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            out_headers.update(extra)
            out_headers["x-kvrouter-instance"] = d.target
            out_headers["x-kvrouter-cached-tokens"] = str(pc.hit_tokens)
            if not (p.req.stream and resp.status == 200):
                data = await self.proxy._read_all(resp)
                self.pool.record_success(d.instance)
                self.pipeline.first_token(p, streamed=False)
                self.metrics.upstream_ttft.labels(d.target).observe(time.monotonic() - t0, p.exemplar())
                watcher.feed_body(data)
                done = True
                down.answer(resp.status, out_headers, data)
                return
            head = await self._first_chunk(resp)
            self.pool.record_success(d.instance)
            await down.start(resp.status, out_headers)
            try:
                await self.proxy._pump(resp, down, p, d, watcher, t0, head)
            except ClientGone:
                return  # not done: the finally closes the upstream request
            done = True
        finally:
            if resp is not None:
                if done:
                    resp.release()
                else:
                    resp.close()
            # The decode leg reports the prefill instance's cache hit, not its own: nothing to compare;
            # what it generated is its pace to learn.
            report = watcher.report if done else None
            self.pipeline.finished(
                p, d, None, output_tokens=None if report is None else report.completion_tokens
            )

    async def _first_chunk(self, resp: Answer) -> bytes:
        """The stream's first bytes; ``UpstreamFailed`` if it fails or ends before any."""
        try:
            chunk = await asyncio.wait_for(resp.content.readany(), self.proxy.first_byte_timeout_s)
        except TimeoutError:
            raise UpstreamFailed("timeout", connection=False) from None
        except aiohttp.ClientConnectionError as e:
            raise UpstreamFailed("disconnected", connection=True) from e
        except aiohttp.ClientPayloadError as e:
            raise UpstreamFailed("body", connection=False) from e
        if not chunk:
            raise UpstreamFailed("empty", connection=False)
        return chunk
