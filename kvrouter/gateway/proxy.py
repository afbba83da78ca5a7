"""Forwarding one routed request upstream, streaming or not, with retries before the first byte.

::

    dispatch ──POST──▶ instance ── connection error / 5xx / no headers in time ──▶ next-best instance
                           │                                                      (up to max_retries)
                           ├─ stream: every chunk written to the client as it arrives (no buffering);
                           │          an upstream failure after the first byte ends the stream with a
                           │          well-formed SSE error event and [DONE]
                           └─ unary:  the body passed through unchanged
    the client goes away ──▶ the upstream request is closed (vLLM aborts it), its slot freed
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import aiohttp
from aiohttp import web

from ..api.errors import BadGateway, sse_error
from ..api.usage import UsageWatcher
from ..pipeline import Prepared, RequestPipeline
from ..routing import Candidate
from .errors import ClientGone, UpstreamFailed
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
_PASS_REQ = {"authorization", "content-type", "accept", "user-agent", "x-request-id", "openai-organization"}


def _is_connect_timeout(e: BaseException) -> bool:
    """A connect timeout (aiohttp >= 3.10 names it; older releases say so in the message)."""
    cls = getattr(aiohttp, "ConnectionTimeoutError", None)
    return isinstance(e, cls) if cls is not None else "connect" in str(e).lower()


def set_nodelay(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


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
    ) -> None:
        self.http = http
        """The lean client for http:// upstreams (None: every request through ``session``)."""
        self.session = session
        self.pool = pool
        self.pipeline = pipeline
        self.m = metrics
        self.first_byte_timeout_s = first_byte_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.upstream_api_key = upstream_api_key

    def _headers(self, request: web.Request, chosen: Candidate) -> dict[str, str]:
        h = {k: v for k, v in request.headers.items() if k.lower() in _PASS_REQ}
        if self.upstream_api_key:
            h["Authorization"] = f"Bearer {self.upstream_api_key}"
        h["Content-Type"] = "application/json"
        if self.pool.upstreams[chosen.instance].cfg.dp_size > 1:
            h["X-data-parallel-rank"] = str(chosen.dp_rank)  # vLLM pins the request to this rank
        return h

    async def forward(
        self,
        request: web.Request,
        p: Prepared,
        chosen: Candidate,
        path: str,
        extra_headers: dict[str, str],
    ) -> web.StreamResponse:
        """Send ``p`` to ``chosen``; before the first byte, a failure moves it to the next-best target
        (up to ``max_retries`` times); ``BadGateway`` when no attempt succeeded."""
        body = p.req.encoded_body()
        tried: set[str] = set()
        for attempt in range(self.max_retries + 1):
            tried.add(chosen.target)
            self.pipeline.dispatched(p, chosen)
            try:
                return await self._attempt(request, p, chosen, body, path, extra_headers, time.monotonic())
            except UpstreamFailed as e:
                self.pool.record_failure(chosen.instance, connection=e.connection)
                log.warning(
                    "upstream failed before the first byte",
                    extra={"instance": chosen.target, "reason": e.reason, "attempt": attempt},
                )
                nxt = self.pipeline.reroute(p, tried) if attempt < self.max_retries else None
                if nxt is None:
                    self.m.pipeline.rejections.labels("upstream_failed").inc()
                    raise BadGateway(f"upstream failed: {e.reason}") from None
                self.m.retries.labels(e.reason).inc()
                chosen = nxt
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        request: web.Request,
        p: Prepared,
        chosen: Candidate,
        body: bytes,
        path: str,
        extra_headers: dict[str, str],
        t0: float,
    ) -> web.StreamResponse:
        url = self.pool.url(chosen.instance) + path
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.connect_timeout_s, sock_read=self.first_byte_timeout_s
        )
        watcher = UsageWatcher()
        resp: Answer | None = None
        done = False
        try:  # the attempt's load is released in every path, exactly once (the finally)
            resp = await self._post(url, body, self._headers(request, chosen), timeout)
            if resp.status >= 500:
                raise UpstreamFailed(f"status_{resp.status}", connection=False)
            self.pool.record_success(chosen.instance)
            headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            headers.update(extra_headers)
            headers["x-kvrouter-instance"] = chosen.target
            headers["x-kvrouter-cached-tokens"] = str(chosen.cached_tokens)
            if not (p.req.stream and resp.status == 200):
                data = await self._read_all(resp)
                self.pipeline.first_token(p)
                self.m.upstream_ttft.labels(chosen.target).observe(time.monotonic() - t0)
                watcher.feed_body(data)
                done = True
                return web.Response(body=data, status=resp.status, headers=headers)
            out = web.StreamResponse(status=resp.status, headers=headers)
            set_nodelay(request)
            await out.prepare(request)
            try:
                await self._pump(request, resp, out, p, chosen, watcher, t0)
            except ClientGone:
                return out  # not done: the finally closes the upstream request
            done = True
            return out
        finally:
            if resp is not None:
                if done:
                    resp.release()
                else:
                    resp.close()  # client gone or error: abort the upstream request so vLLM stops it
            self.pipeline.finished(p, chosen, watcher.report if done else None)

    async def _post(
        self, url: str, body: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout
    ) -> Answer:
        try:
            if self.http is not None and url.startswith("http://"):
                return await self.http.post(
                    url, body, headers, connect_timeout=timeout.connect, read_timeout=timeout.sock_read
                )
            return await self.session.post(
                url, data=body, headers=headers, timeout=timeout, auto_decompress=False
            )
        except (aiohttp.ClientConnectionError, aiohttp.ClientOSError) as e:
            # aiohttp's read timeout is a connection error too: an instance that accepted the request and
            # never started its answer is a hang (a failure towards ejection), not an unreachable host.
            if isinstance(e, TimeoutError) and not _is_connect_timeout(e):
                raise UpstreamFailed("timeout", connection=False) from e
            raise UpstreamFailed("connect", connection=True) from e
        except TimeoutError as e:
            raise UpstreamFailed("timeout", connection=False) from e

    async def _read_all(self, resp: Answer) -> bytes:
        try:
            return await resp.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            raise UpstreamFailed("body", connection=False) from e
        except TimeoutError as e:
            raise UpstreamFailed("timeout", connection=False) from e

    async def _pump(
        self,
        request: web.Request,
        resp: Answer,
        out: web.StreamResponse,
        p: Prepared,
        chosen: Candidate,
        watcher: UsageWatcher,
        t0: float,
    ) -> None:
        first = True
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(resp.content.readany(), self.chunk_timeout_s)
                except TimeoutError:
                    raise aiohttp.ClientPayloadError("upstream stalled") from None
                if not chunk:
                    break
                if first:
                    first = False
                    self.pipeline.first_token(p)
                    self.m.upstream_ttft.labels(chosen.target).observe(time.monotonic() - t0)
                watcher.feed_stream(chunk)
                await self._to_client(out, chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            # The stream already began: tell the client in-band, then end it cleanly.
            self.m.stream_errors.inc()
            self.pool.record_failure(chosen.instance, connection=isinstance(e, aiohttp.ClientConnectionError))
            log.warning("upstream failed mid-stream", extra={"instance": chosen.target, "error": str(e)})
            await self._to_client(out, sse_error(BadGateway(f"upstream {chosen.target} failed mid-stream")))
        await out.write_eof()

    async def _to_client(self, out: web.StreamResponse, data: bytes) -> None:
        try:
            await out.write(data)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.m.client_disconnects.inc()
            raise ClientGone() from None
