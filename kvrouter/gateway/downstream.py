"""The client's side of one routed exchange, whatever server carries it: aiohttp, or the lean core.

::

    front door (aiohttp handler │ lean core) ──Downstream──▶ route_and_forward ──▶ Proxy / DisaggProxy
        read()                                   the request's body
        answer(status, headers, body)            a whole answer
        start(status, headers) · send(chunk)* · finish()      a streamed one (``ClientGone`` from send
                                                              when the client went away)

The proxy and the disaggregated proxy write through this alone, so failover, retries, streaming errors
and P/D legs are one implementation for every front door.  ``error_answer`` is the one mapping from an
exception to the answer a client gets (status, headers, body), for every front door too.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Protocol

from aiohttp import web

from ..api.errors import ApiError, InternalError, Overloaded, ServiceUnavailable
from ..api.messages import anthropic_error_body
from .errors import ClientGone

log = logging.getLogger("kvrouter.gateway")

Headers = Mapping[str, str]


class Downstream(Protocol):
    """One request as a front door received it, and the way back to its client."""

    @property
    def method(self) -> str: ...

    @property
    def path_qs(self) -> str:
        """The path and query string as the client sent them."""

    @property
    def headers(self) -> Headers:
        """The request's headers; lookups ignore case."""

    @property
    def status(self) -> int:
        """The answer's status once its head is written (0: nothing written yet)."""

    async def read(self) -> bytes:
        """The whole request body."""

    def answer(self, status: int, headers: Headers, body: bytes) -> None:
        """Answer with a whole body (``Content-Length`` is the front door's)."""

    async def start(self, status: int, headers: Headers) -> None:
        """Begin a streamed answer (its framing is the front door's)."""

    async def send(self, chunk: bytes) -> None:
        """One chunk of a streamed answer, flushed; ``ClientGone`` if the client went away."""

    async def finish(self) -> None:
        """End a streamed answer."""


def error_answer(e: ApiError, retry_after_s: float | None, path: str) -> tuple[int, dict[str, str], bytes]:
    """The error answer, in the route's own shape (vLLM answers the Messages routes Anthropic's way);
    ``Retry-After`` for the errors a client should come back after (overloaded, unavailable): the error's
    own ``retry_after_s`` when it knows better (a rate limit knows when its bucket refills), else
    ``retry_after_s``."""
    headers = {**e.headers, "Content-Type": "application/json"}
    if isinstance(e, Overloaded) and e.retry_after_s is not None:
        retry_after_s = e.retry_after_s
    if retry_after_s is not None and isinstance(e, (Overloaded, ServiceUnavailable)):
        headers["Retry-After"] = str(retry_after_s)
    body = anthropic_error_body(e.status, e.message) if path.startswith("/v1/messages") else e.body()
    return e.status, headers, body


def internal_error(e: Exception, route: str) -> InternalError:
    """A bug, not the client's fault: logged with its traceback but without the request's contents (the
    caller counts it); the client gets a well-formed JSON 500."""
    log.exception("internal error", extra={"route": route, "error": type(e).__name__})
    return InternalError(f"internal error ({type(e).__name__})")


class AiohttpDownstream:
    """``Downstream`` over an aiohttp request; ``response`` is what its handler returns."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def status(self) -> int:
        return 0 if self.response is None else self.response.status

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def path_qs(self) -> str:
        return self.request.path_qs

    @property
    def headers(self) -> Headers:
        return self.request.headers

    async def read(self) -> bytes:
        return await self.request.read()

    def answer(self, status: int, headers: Headers, body: bytes) -> None:
        self.response = web.Response(body=body, status=status, headers=headers)

    async def start(self, status: int, headers: Headers) -> None:
        out = self.response = web.StreamResponse(status=status, headers=headers)
        transport = self.request.transport
        sock = transport.get_extra_info("socket") if transport else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await out.prepare(self.request)

    async def send(self, chunk: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(chunk)
        except ConnectionResetError:  # (aiohttp's ClientConnectionResetError is one)
            raise ClientGone() from None

    async def finish(self) -> None:
        assert self.response is not None
        await self.response.write_eof()
