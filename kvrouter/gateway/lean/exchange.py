"""One request on the lean core: its head as parsed, its body as it arrives, and the way back.

``Exchange`` is the lean core's ``Downstream``: the proxy answers through it.  Its answer is framed here
(HTTP/1.1: ``Content-Length`` for a whole answer, chunked for a streamed one; an HTTP/1.0 client's stream
ends with the connection) and written to the connection's transport as the proxy hands it over: the
upstream's chunk is one buffer of a vectored write, never copied into a bigger one.
"""

from __future__ import annotations

import asyncio
from collections.abc import ItemsView, Iterator, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING

from ...api.errors import PayloadTooLarge

if TYPE_CHECKING:
    from .protocol import LeanProtocol
    from .routes import Route

_REASONS = {s.value: s.phrase for s in HTTPStatus}
_CRLF = b"\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class LeanHeaders(Mapping[str, str]):
    """A request's headers by lowercased name (a repeated header's values joined with ", "); lookups
    ignore case, as aiohttp's do."""

    __slots__ = ("_d",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        d: dict[str, str] = {}
        for name, value in raw:
            k = name.decode("latin-1").lower()
            v = value.decode("latin-1")
            d[k] = f"{d[k]}, {v}" if k in d else v
        self._d = d

    def __getitem__(self, key: str) -> str:
        return self._d[key.lower()]

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return self._d.get(key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def items(self) -> ItemsView[str, str]:
        return self._d.items()


def head_bytes(status: int, headers: Mapping[str, str], framing: str) -> bytes:
    """The status line and headers of an answer, ``framing`` (its own header lines) last."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
    lines.append(framing)
    return "".join(lines).encode("latin-1")


class Exchange:
    """One request and its answer (see the module docstring).  The protocol feeds the body; the request's
    task reads it and answers."""

    __slots__ = (
        "_parts",
        "_size",
        "_waiter",
        "complete",
        "conn",
        "headers",
        "http11",
        "keep_alive",
        "method",
        "path_qs",
        "route",
        "started",
        "status",
        "task",
        "too_large",
    )

    def __init__(
        self,
        conn: LeanProtocol,
        route: Route,
        path_qs: str,
        headers: LeanHeaders,
        *,
        keep_alive: bool,
        http11: bool,
    ) -> None:
        self.conn = conn
        self.route = route
        self.method = "POST"
        self.path_qs = path_qs
        self.headers = headers
        self.keep_alive = keep_alive
        self.http11 = http11
        self.status = 0
        """The answer's status once its head is written (0: nothing written yet)."""
        self.started = False
        """A streamed answer began (an error can no longer be answered: the connection is closed)."""
        self.complete = False
        """The whole body has arrived."""
        self.too_large = False
        self.task: asyncio.Task[None] | None = None
        self._parts: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ fed by the protocol
    def feed(self, chunk: bytes, limit: int) -> None:
        if self.too_large:
            return
        self._size += len(chunk)
        if self._size > limit:
            self.too_large = True
            self._parts = []
            self._wake()
            return
        self._parts.append(chunk)

    def end(self) -> None:
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ------------------------------------------------------------------ Downstream
    async def read(self) -> bytes:
        while not self.complete and not self.too_large:
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.too_large:
            raise PayloadTooLarge(f"the request body is longer than {self.conn.core.max_body} bytes")
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _connection(self) -> str:
        if not self.keep_alive:
            return "Connection: close\r\n"
        return "" if self.http11 else "Connection: keep-alive\r\n"

    def answer(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        framing = f"Content-Length: {len(body)}\r\n{self._connection()}\r\n"
        self.conn.write((head_bytes(status, headers, framing), body))

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self.started = True
        if not self.http11:
            self.keep_alive = False  # no chunked framing: the stream ends with the connection
        framing = "Transfer-Encoding: chunked\r\n" if self.http11 else ""
        self.conn.write((head_bytes(status, headers, framing + self._connection() + "\r\n"),))
        await self.conn.drained()

    async def send(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self.http11:
            self.conn.write((b"%x\r\n" % len(chunk), chunk, _CRLF))
        else:
            self.conn.write((chunk,))
        await self.conn.drained()

    async def finish(self) -> None:
        if self.http11:
            self.conn.write((_LAST_CHUNK,))
        await self.conn.drained()
