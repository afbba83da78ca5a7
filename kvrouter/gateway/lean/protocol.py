"""One client connection on the lean core: HTTP/1.1 parsed by llhttp (``httptools``), requests in order.

::

    bytes ──httptools──▶ head complete ──POST to a lean route──▶ Exchange ──▶ its task (core.handle)
                              │            body chunks ──▶ Exchange.feed;  message end ──▶ Exchange.end
                              └─ any other request ──▶ the connection is aiohttp's from here on: its
                                 protocol takes the transport and the request's bytes as received

Requests on one connection are handled one at a time, in order (as aiohttp does): a pipelined request
waits, parsed and buffered, until the one before it is answered.  Its admission and routing begin then.

The hand-over needs the request's bytes from its first one: they are kept from the start of a chunk that
begins a request until its head is complete.  A request that is not the lean core's and arrives pipelined
behind lean ones (it began inside a chunk, or while a lean answer was under way) cannot be handed over:
the connection is closed once the requests before it are answered, and the client retries it (RFC 9112,
9.3.2: an unanswered pipelined request).  Clients do not pipeline in practice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import httptools

from ...api.errors import error_body
from ..errors import ClientGone
from .exchange import Exchange, LeanHeaders, head_bytes

if TYPE_CHECKING:
    from .core import LeanCore

log = logging.getLogger("kvrouter.gateway.lean")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_PENDING = 32
"""Pipelined requests buffered at most per connection; past it the connection stops reading."""
MAX_HEAD = 64 << 10
"""Bytes a request's line and headers may take (the parser buffers them whole): more is a 431."""


class _HandOver(Exception):
    """Raised from the parser's callback: the request is not the lean core's."""


class LeanProtocol(asyncio.Protocol):
    def __init__(self, core: LeanCore) -> None:
        self.core = core
        self.loop = core.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: Exchange | None = None
        """The request being handled (its task runs); later ones wait in ``pending``."""
        self.pending: deque[Exchange] = deque()
        self.parsing: Exchange | None = None
        """The request whose body is being parsed (None between messages, or when it is discarded)."""
        self.gone = False
        self.closing = False
        """Close once the requests already parsed are answered (nothing more is read)."""
        self.idle_since = time.monotonic()
        self._url = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._between = True
        self._fresh = True
        self._begins = 0
        self._raw: list[bytes] | None = None
        self._in_head = False
        self._head_size = 0
        self._raw_ok = False
        self._discard = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: the same methods, duck-typed
        self.transport = cast(asyncio.Transport, transport)
        self.core.conns.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self._fresh = self._between
        self._begins = 0
        if self._between:  # this chunk begins a request: kept until its head says whose it is
            self._raw = [data]
            self._head_size = len(data)
        else:
            if self._raw is not None:
                self._raw.append(data)
            if self._in_head:
                self._head_size += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _HandOver):
                self._hand_over()
                return
            log.error("lean core: error in a parser callback", exc_info=e.__context__)
            self._refuse(500, "internal error")
        except httptools.HttpParserUpgrade:
            self._hand_over_or_close()
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")
            return
        if self._in_head and self._head_size > MAX_HEAD:
            self._refuse(431, f"the request's line and headers are longer than {MAX_HEAD} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.core.conns.discard(self)
        for ex in (self.current, *self.pending):
            if ex is not None and ex.task is not None:
                ex.task.cancel()  # the client went away: its upstream request is closed, its load freed
        self.pending.clear()
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        self._between = False
        self._in_head = True
        self._raw_ok = self._fresh and self._begins == 0
        self._begins += 1
        self._url = b""
        self._raw_headers = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        url = self._url
        q = url.find(b"?")
        route = self.core.routes.get(url if q < 0 else url[:q])
        if route is None or self.parser.get_method() != b"POST":
            raise _HandOver()
        self._raw = None
        headers = LeanHeaders(self._raw_headers)
        ex = Exchange(
            self,
            route,
            url.decode("latin-1"),
            headers,
            keep_alive=self.parser.should_keep_alive(),
            http11=self.parser.get_http_version() == "1.1",
        )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.core.max_body:
            ex.too_large = True  # answered 413 by its task without reading the body; then closed
            ex.keep_alive = False
            self._discard = True
        elif (headers.get("expect") or "").lower() == "100-continue" and self.current is None:
            self.write((_CONTINUE,))
        self.parsing = ex
        if self.current is None:
            self._begin(ex)
        else:
            self.pending.append(ex)
            if len(self.pending) > _MAX_PENDING and self.transport is not None:
                self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is not None and not self._discard:
            ex.feed(body, self.core.max_body)
            if ex.too_large:
                ex.keep_alive = False
                self._discard = True

    def on_message_complete(self) -> None:
        ex = self.parsing
        self.parsing = None
        self._between = True
        if self._discard:
            self._discard = False
            self.closing = True  # a body too large to read: answered, then the connection closed
        if ex is not None:
            ex.end()

    # ------------------------------------------------------------------ requests in order
    def _begin(self, ex: Exchange) -> None:
        self.current = ex
        ex.task = self.loop.create_task(self.core.handle(ex))

    def done(self, ex: Exchange) -> None:
        """``ex`` is answered (its task ended): the next request's turn, or the connection's end."""
        if self.current is not ex or self.gone:
            return
        self.current = None
        if not ex.keep_alive or not ex.complete:
            # (answered before its body was all read, as a request refused at once: the rest of the body
            # would have to be read and dropped to find the next request; closing is cheaper)
            self.close()
            return
        if self.pending:
            nxt = self.pending.popleft()
            if self.transport is not None and len(self.pending) == _MAX_PENDING:
                self.transport.resume_reading()
            self._begin(nxt)
        elif self.closing:
            self.close()
        else:
            self.idle_since = time.monotonic()

    def idle(self) -> bool:
        return self.current is None and self._between

    # ------------------------------------------------------------------ writing
    def write(self, bufs: Iterable[bytes]) -> None:
        t = self.transport
        if not self.gone and t is not None and not t.is_closing():
            t.writelines(bufs)

    async def drained(self) -> None:
        """Back once the transport can take more (the client reads slower than the upstream writes);
        ``ClientGone`` when the client went away."""
        if self._write_paused and not self.gone:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None
        if self.gone or (self.transport is not None and self.transport.is_closing()):
            raise ClientGone()

    def close(self) -> None:
        if self.transport is not None and not self.gone:
            self.transport.close()

    # ------------------------------------------------------------------ not ours
    def _hand_over(self) -> None:
        """Give the connection, and the request's bytes as received, to aiohttp's protocol."""
        if not self._raw_ok or self._raw is None or self.current is not None or self.pending:
            self._hand_over_or_close()
            return
        transport = self.transport
        assert transport is not None
        raw = b"".join(self._raw)
        self._raw = None
        self.core.conns.discard(self)
        handler = self.core.aiohttp_protocol()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        handler.data_received(raw)

    def _hand_over_or_close(self) -> None:
        """A request that cannot be handed over (pipelined behind lean requests): read nothing more,
        answer those before it, then close (the client retries it)."""
        if self._raw_ok and self._raw is not None and self.current is None and not self.pending:
            self._hand_over()
            return
        self.closing = True
        if self.transport is not None:
            self.transport.pause_reading()
        if self.current is None:
            self.close()

    def _refuse(self, status: int, message: str) -> None:
        """A request the parser refused: answered with the error, then closed (framing is lost)."""
        self.closing = True
        if self.current is None and not self.pending:
            body = error_body(status, message)
            framing = (
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            self.write((head_bytes(status, {}, framing), body))
            self.close()
