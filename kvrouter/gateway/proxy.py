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
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from ..routing import Router
from ..routing.policies import Candidate
from ..routing.router import RouteInput
from .metrics import GatewayMetrics
from .requests import ParsedRequest
from .upstream import UpstreamPool

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


class ClientGone(Exception):
    """The client closed its connection; the upstream request is aborted."""


def _is_connect_timeout(e: BaseException) -> bool:
    """A connect timeout (aiohttp >= 3.10 names it; older releases say so in the message)."""
    cls = getattr(aiohttp, "ConnectionTimeoutError", None)
    return isinstance(e, cls) if cls is not None else "connect" in str(e).lower()


class UpstreamFailed(Exception):
    def __init__(self, reason: str, *, connection: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.connection = connection


def set_nodelay(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def sse_error(message: str, code: int = 502) -> bytes:
    err = msgspec.json.encode({"error": {"message": message, "type": "upstream_error", "code": code}})
    return b"data: " + err + b"\n\ndata: [DONE]\n\n"


class UsageWatcher:
    """Finds ``usage.prompt_tokens_details.cached_tokens`` in a response, streamed or not."""

    def __init__(self) -> None:
        self._tail = b""
        self.cached_tokens: int | None = None
        self.prompt_tokens: int | None = None

    def feed_stream(self, chunk: bytes) -> None:
        data = self._tail + chunk
        if b"cached_tokens" not in data and b'"usage"' not in data:
            self._tail = data[-64:]
            return
        *events, self._tail = data.split(b"\n\n")
        for ev in events:
            if b'"usage"' in ev and ev.startswith(b"data: {"):
                self._read(ev[6:])

    def feed_body(self, body: bytes) -> None:
        if b'"usage"' in body:
            self._read(body)

    def _read(self, js: bytes) -> None:
        try:
            obj = msgspec.json.decode(js)
        except msgspec.DecodeError:
            return
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if not isinstance(usage, dict):
            return
        if isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]


class Proxy:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: UpstreamPool,
        router: Router,
        metrics: GatewayMetrics,
        *,
        first_byte_timeout_s: float,
        chunk_timeout_s: float,
        connect_timeout_s: float,
        max_retries: int,
        upstream_api_key: str | None = None,
        on_finish: Callable[[], None] = lambda: None,
    ) -> None:
        self.session = session
        self.pool = pool
        self.router = router
        self.m = metrics
        self.first_byte_timeout_s = first_byte_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.upstream_api_key = upstream_api_key
        self.on_finish = on_finish

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
        req: ParsedRequest,
        inp: RouteInput,
        chosen: Candidate,
        reroute: Callable[[set[str]], Awaitable[Candidate | None]],
        path: str,
        extra_headers: dict[str, str],
    ) -> web.StreamResponse:
        body = req.encoded_body()
        tried: set[str] = set()
        for attempt in range(self.max_retries + 1):
            tried.add(chosen.target)
            now = time.monotonic()
            self.router.dispatched(inp, chosen, now)
            self.m.predicted_cached.labels(chosen.target).inc(chosen.cached_tokens)
            try:
                return await self._attempt(request, req, inp, chosen, body, path, extra_headers, now)
            except UpstreamFailed as e:
                self.router.finished(inp.request_id)
                self.on_finish()
                self.pool.record_failure(chosen.instance, connection=e.connection)
                log.warning(
                    "upstream failed before the first byte",
                    extra={"instance": chosen.target, "reason": e.reason, "attempt": attempt},
                )
                nxt = await reroute(tried) if attempt < self.max_retries else None
                if nxt is None:
                    self.m.rejections.labels("upstream_failed").inc()
                    return web.json_response(
                        {
                            "error": {
                                "message": f"upstream failed: {e.reason}",
                                "type": "upstream_error",
                                "code": 502,
                            }
                        },
                        status=502,
                    )
                self.m.retries.labels(e.reason).inc()
                chosen = nxt
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        request: web.Request,
        req: ParsedRequest,
        inp: RouteInput,
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
        rid = inp.request_id
        try:
            resp = await self.session.post(
                url, data=body, headers=self._headers(request, chosen), timeout=timeout, auto_decompress=False
            )
        except (aiohttp.ClientConnectionError, aiohttp.ClientOSError) as e:
            # aiohttp's read timeout is a connection error too: an instance that accepted the request and
            # never started its answer is a hang (a failure towards ejection), not an unreachable host.
            if isinstance(e, TimeoutError) and not _is_connect_timeout(e):
                raise UpstreamFailed("timeout", connection=False) from e
            raise UpstreamFailed("connect", connection=True) from e
        except TimeoutError as e:
            raise UpstreamFailed("timeout", connection=False) from e
        done = False
        try:
            if resp.status >= 500:
                resp.close()
                raise UpstreamFailed(f"status_{resp.status}", connection=False)
            self.pool.record_success(chosen.instance)
            headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            headers.update(extra_headers)
            headers["x-kvrouter-instance"] = chosen.target
            headers["x-kvrouter-cached-tokens"] = str(chosen.cached_tokens)
            watcher = UsageWatcher()
            is_stream = req.stream and resp.status == 200
            if not is_stream:
                data = await self._read_all(resp)
                self.router.first_token(rid)
                self.m.upstream_ttft.labels(chosen.target).observe(time.monotonic() - t0)
                watcher.feed_body(data)
                self._observe_usage(chosen, watcher)
                done = True
                return web.Response(body=data, status=resp.status, headers=headers)
            out = web.StreamResponse(status=resp.status, headers=headers)
            set_nodelay(request)
            await out.prepare(request)
            try:
                await self._pump(request, resp, out, chosen, rid, watcher, t0)
            except ClientGone:
                return out  # not done: the finally closes the upstream request
            done = True
            return out
        finally:
            if not done:
                resp.close()  # client gone or error: abort the upstream request so vLLM stops it
            else:
                resp.release()
            self.router.finished(rid)
            self.on_finish()

    async def _read_all(self, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            raise UpstreamFailed("body", connection=False) from e
        except TimeoutError as e:
            raise UpstreamFailed("timeout", connection=False) from e

    async def _pump(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        out: web.StreamResponse,
        chosen: Candidate,
        rid: Any,
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
                    self.router.first_token(rid)
                    self.m.upstream_ttft.labels(chosen.target).observe(time.monotonic() - t0)
                watcher.feed_stream(chunk)
                await self._to_client(out, chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            # The stream already began: tell the client in-band, then end it cleanly.
            self.m.stream_errors.inc()
            self.pool.record_failure(chosen.instance, connection=isinstance(e, aiohttp.ClientConnectionError))
            log.warning("upstream failed mid-stream", extra={"instance": chosen.target, "error": str(e)})
            await self._to_client(out, sse_error(f"upstream {chosen.target} failed mid-stream"))
        self._observe_usage(chosen, watcher)
        await out.write_eof()

    async def _to_client(self, out: web.StreamResponse, data: bytes) -> None:
        try:
            await out.write(data)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.m.client_disconnects.inc()
            raise ClientGone() from None

    def _observe_usage(self, chosen: Candidate, w: UsageWatcher) -> None:
        if w.cached_tokens is None:
            return
        self.m.reported_cached.labels(chosen.target).inc(w.cached_tokens)
        self.m.cached_error.observe(chosen.cached_tokens - w.cached_tokens)
