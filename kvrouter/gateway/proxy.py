"""Forwarding one routed request upstream, streaming or not, with retries before the first byte.

::

    dispatch ──METHOD path──▶ instance ── connection error / 5xx / no headers in time ──▶ next-best
                           │                                                 instance (max_retries)
                           ├─ an event stream (text/event-stream): every chunk written to the client as it
                           │          arrives (no buffering); an upstream failure after the first byte
                           │          ends it with the route's own error event (chat/completions: an error
                           │          body and [DONE]; Responses: an "error" event; Messages: Anthropic's)
                           └─ otherwise: the body passed through unchanged
    the client goes away ──▶ the upstream request is closed (vLLM aborts it), its slot freed
    a streamed request body (multipart audio) ──▶ sent on as it arrives; retried only if not begun
    404 for a LoRA adapter (unloaded meanwhile) ──▶ forgotten there, sent to the next instance holding it
    a Responses answer's id ──▶ remembered with its instance (``RequestPipeline.response_seen``)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from ..api import messages as anthropic
from ..api import responses as responses_api
from ..api.errors import ApiError, BadGateway, sse_error
from ..api.usage import UsageWatcher
from ..loop_lag import LoopLag
from ..pipeline import Prepared, RequestPipeline
from ..routing import Candidate
from .downstream import Downstream
from .errors import AdapterMissing, ClientGone, UpstreamFailed
from .metrics import GatewayMetrics
from .upstream import UpstreamPool
from .upstream_http import UpstreamAnswer, UpstreamHttp

Answer = aiohttp.ClientResponse | UpstreamAnswer

log = logging.getLogger("kvrouter.gateway.proxy")

_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}
_PASS_REQ = {
    "authorization",
    "content-type",
    "accept",
    "user-agent",
    "x-request-id",
    "openai-organization",
    "x-session-id",
    "anthropic-version",
    "anthropic-beta",
    "x-api-key",
    "traceparent",  # W3C trace context: vLLM joins the client's trace (replaced when this request is traced)
    "tracestate",
}

BodySource = bytes | Callable[[], AsyncIterator[bytes]]
"""A request body: bytes (re-sent on a retry), or a factory of its one stream (sent as it arrives)."""


def _is_connect_timeout(e: BaseException) -> bool:
    """A connect timeout (aiohttp >= 3.10 names it; older releases say so in the message)."""
    cls = getattr(aiohttp, "ConnectionTimeoutError", None)
    return isinstance(e, cls) if cls is not None else "connect" in str(e).lower()


def _failed(e: BaseException, timeout: aiohttp.ClientTimeout) -> UpstreamFailed:
    """A client error as an attempt's failure.  aiohttp's read timeout is a connection error too: an
    instance that accepted the request and never started its answer is a hang (a failure towards
    ejection), not an unreachable host."""
    if isinstance(e, TimeoutError):
        if _is_connect_timeout(e):
            return UpstreamFailed("connect", connection=True, limit_s=timeout.connect)
        return UpstreamFailed("timeout", connection=False, limit_s=timeout.sock_read)
    return UpstreamFailed("connect", connection=True)


class Proxy:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: UpstreamPool,
        pipeline: RequestPipeline,
        metrics: GatewayMetrics,
        *,
        first_byte_timeout_s: float,
        chunk_timeout_s: float,
        connect_timeout_s: float,
        max_retries: int,
        upstream_api_key: str | None = None,
        http: UpstreamHttp | None = None,
        lag: LoopLag | None = None,
    ) -> None:
        self.lag = lag
        """This process's event-loop delay: a timeout that ran out while the loop stood still is not
        held against the instance (it is retried all the same)."""
        self.http = http
        """The lean client for http:// upstreams (None: every request through ``session``)."""
        self.session = session
        self.pool = pool
        self.pipeline = pipeline
        self.metrics = metrics
        self.first_byte_timeout_s = first_byte_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.upstream_api_key = upstream_api_key
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=first_byte_timeout_s
        )
        """Every attempt's: a connection in ``connect_timeout_s``, the answer's head in
        ``first_byte_timeout_s`` (built once: an attrs object per attempt costs CPU on every request)."""

    def upstream_headers(self, down: Downstream, p: Prepared, chosen: Candidate) -> dict[str, str]:
        """What is sent upstream with a request to ``chosen`` (the disaggregated proxy's legs too)."""
        return self._headers(down, p, chosen)

    def _headers(self, down: Downstream, p: Prepared, chosen: Candidate) -> dict[str, str]:
        # Names lowercased: a header the gateway sets replaces the client's whatever case either used.
        h = {low: v for k, v in down.headers.items() if (low := k.lower()) in _PASS_REQ}
        if self.upstream_api_key:
            h["authorization"] = f"Bearer {self.upstream_api_key}"
        if p.req.kind != "other" or "Content-Type" not in down.headers:
            h["content-type"] = "application/json"
        if self.pool.upstreams[chosen.instance].cfg.dp_size > 1:
            h["x-data-parallel-rank"] = str(chosen.dp_rank)  # vLLM pins the request to this rank
        if p.rec is not None:
            h.update(p.trace_headers())  # the attempt's own span as vLLM's parent
        return h

    async def forward(
        self,
        down: Downstream,
        p: Prepared,
        chosen: Candidate,
        path: str,
        extra_headers: dict[str, str],
        *,
        method: str = "POST",
        body: BodySource | None = None,
    ) -> None:
        """Send ``p`` to ``chosen`` and answer ``down``; before the first byte, a failure moves it to the
        next-best target (up to ``max_retries`` times); ``BadGateway`` when no attempt succeeded.
        ``body``: what to send (default: the request's JSON body as parsed; a streamed body is retried
        only before it began)."""
        source: BodySource = p.req.encoded_body() if body is None else body
        tried: set[str] = set()
        started = [False]
        for attempt in range(self.max_retries + 1):
            tried.add(chosen.target)
            self.pipeline.dispatched(p, chosen)
            mark = self.lag.mark() if self.lag is not None else 0.0
            try:
                send = source if isinstance(source, bytes) else _once(source, started)
                await self._attempt(down, p, chosen, method, send, path, extra_headers, time.monotonic())
                return
            except AdapterMissing as e:
                # loaded when routed, gone when it arrived: forget it there, try an instance that has it
                self.pool.adapter_unloaded(chosen.instance, e.adapter)
                nxt = self.pipeline.reroute(p, tried) if not started[0] else None
                if nxt is None:
                    down.answer(404, {"Content-Type": "application/json"}, e.body)
                    return
                self.metrics.retries.labels("adapter_missing").inc()
                chosen = nxt
            except UpstreamFailed as e:
                # the time ran out while this process stood still: the instance is not to blame
                stalled = e.limit_s is not None and self.lag is not None and self.lag.stalled(mark, e.limit_s)
                if not stalled:
                    self.pool.record_failure(chosen.instance, connection=e.connection)
                else:
                    self.metrics.failures_excused.labels(chosen.instance).inc()
                log.warning(
                    "upstream failed before the first byte",
                    extra={
                        "instance": chosen.target,
                        "reason": e.reason,
                        "attempt": attempt,
                        "error": repr(e.__cause__) if e.__cause__ is not None else None,
                        "router_stalled": stalled,
                    },
                )
                retry = attempt < self.max_retries and not started[0]
                # No connection in time while this process stood still: the instance may well have
                # accepted it, and the prompt was placed there (its speculative entries, claim and
                # placement say so to every router): tried there again, not moved.
                again = retry and stalled and e.connection
                nxt = chosen if again else self.pipeline.reroute(p, tried) if retry else None
                if nxt is None:
                    self.metrics.pipeline.rejections.labels("upstream_failed").inc()
                    raise BadGateway(f"upstream failed: {e.reason}") from None
                self.metrics.retries.labels("stalled" if again else e.reason).inc()
                chosen = nxt
        raise BadGateway("upstream failed: no instance holds the adapter any more")

    async def _attempt(
        self,
        down: Downstream,
        p: Prepared,
        chosen: Candidate,
        method: str,
        body: bytes | AsyncIterator[bytes],
        path: str,
        extra_headers: dict[str, str],
        t0: float,
    ) -> None:
        url = self.pool.url(chosen.instance) + path
        timeout = self.timeout
        on_id = on_output = None
        if p.req.kind == "responses":

            def on_id(rid: str) -> None:
                self.pipeline.response_seen(p, rid, chosen)

            def on_output(rid: str, output: list[dict[str, Any]]) -> None:
                self.pipeline.response_done(p, rid, output)

        watcher = UsageWatcher(on_id, on_output)
        resp: Answer | None = None
        done = False
        try:  # the attempt's load is released in every path, exactly once (the finally)
            resp = await self._send(method, url, body, self._headers(down, p, chosen), timeout)
            self.pipeline.answered(p, resp.status)
            if resp.status >= 500:
                raise UpstreamFailed(f"status_{resp.status}", connection=False)
            if resp.status == 404 and p.req.lora_name is not None and p.pinned is None:
                raise AdapterMissing(p.req.lora_name, await self._read_all(resp))
            self.pool.record_success(chosen.instance)
            headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            headers.update(extra_headers)
            headers["x-kvrouter-instance"] = chosen.target
            headers["x-kvrouter-cached-tokens"] = str(chosen.hit_tokens)
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                data = await self._read_all(resp)
                self.pipeline.first_token(p, streamed=False)
                self.metrics.upstream_ttft.labels(chosen.target).observe(time.monotonic() - t0, p.exemplar())
                if p.req.generates or p.req.kind == "responses":
                    watcher.feed_body(data)
                done = True
                down.answer(resp.status, headers, data)
                return
            await down.start(resp.status, headers)
            try:
                await self._pump(resp, down, p, chosen, watcher, t0)
            except ClientGone:
                return  # not done: the finally closes the upstream request
            done = True
        finally:
            if resp is not None:
                if done:
                    resp.release()
                else:
                    resp.close()  # client gone or error: abort the upstream request so vLLM stops it
            self.pipeline.finished(p, chosen, watcher.report if done else None)

    async def _send(
        self,
        method: str,
        url: str,
        body: bytes | AsyncIterator[bytes],
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
    ) -> Answer:
        if method == "POST":
            return await self._post(url, body, headers, timeout)
        try:
            data = body if body else None
            return await self.session.request(
                method, url, data=data, headers=headers, timeout=timeout, auto_decompress=False
            )
        except (aiohttp.ClientConnectionError, aiohttp.ClientOSError) as e:
            raise _failed(e, timeout) from e
        except TimeoutError as e:
            raise UpstreamFailed("timeout", connection=False, limit_s=timeout.sock_read) from e

    async def _post(
        self,
        url: str,
        body: bytes | AsyncIterator[bytes],
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
    ) -> Answer:
        try:
            # the lean client sends whole bodies; a streamed request body (uploads) goes through aiohttp
            if self.http is not None and isinstance(body, bytes) and url.startswith("http://"):
                return await self.http.post(
                    url, body, headers, connect_timeout=timeout.connect, read_timeout=timeout.sock_read
                )
            return await self.session.post(
                url, data=body, headers=headers, timeout=timeout, auto_decompress=False
            )
        except (aiohttp.ClientConnectionError, aiohttp.ClientOSError) as e:
            raise _failed(e, timeout) from e
        except TimeoutError as e:
            raise UpstreamFailed("timeout", connection=False, limit_s=timeout.sock_read) from e

    async def _read_all(self, resp: Answer) -> bytes:
        try:
            return await resp.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            raise UpstreamFailed("body", connection=False) from e
        except TimeoutError as e:
            raise UpstreamFailed("timeout", connection=False) from e

    async def _pump(
        self,
        resp: Answer,
        down: Downstream,
        p: Prepared,
        chosen: Candidate,
        watcher: UsageWatcher,
        t0: float,
        head: bytes = b"",
    ) -> None:
        """Stream ``resp`` to ``down``, starting with ``head`` (a first chunk the caller already read)."""
        first = True
        try:
            while True:
                if head:
                    chunk, head = head, b""
                else:
                    try:
                        chunk = await asyncio.wait_for(resp.content.readany(), self.chunk_timeout_s)
                    except TimeoutError:
                        raise aiohttp.ClientPayloadError("upstream stalled") from None
                if not chunk:
                    break
                if first:
                    first = False
                    self.pipeline.first_token(p)
                    self.metrics.upstream_ttft.labels(chosen.target).observe(
                        time.monotonic() - t0, p.exemplar()
                    )
                watcher.feed_stream(chunk)
                await self._to_client(down, chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            # The stream already began: tell the client in-band, then end it cleanly.
            self.metrics.stream_errors.inc()
            self.pool.record_failure(chosen.instance, connection=isinstance(e, aiohttp.ClientConnectionError))
            log.warning("upstream failed mid-stream", extra={"instance": chosen.target, "error": str(e)})
            err = BadGateway(f"upstream {chosen.target} failed mid-stream")
            await self._to_client(down, stream_error(p.req.kind, err))
        await down.finish()

    async def _to_client(self, down: Downstream, data: bytes) -> None:
        try:
            await down.send(data)
        except ClientGone:
            self.metrics.client_disconnects.inc()
            raise


def stream_error(kind: str, err: ApiError) -> bytes:
    """The error event that ends a stream already begun, in the route's own stream format."""
    if kind in ("messages", "count_tokens"):
        return anthropic.sse_error(err)
    if kind == "responses":
        return responses_api.sse_error(err)
    return sse_error(err)


async def _once(source: Callable[[], AsyncIterator[bytes]], started: list[bool]) -> AsyncIterator[bytes]:
    """The body stream, noting once its first chunk has been taken (it cannot be sent twice)."""
    async for chunk in source():
        started[0] = True
        yield chunk
