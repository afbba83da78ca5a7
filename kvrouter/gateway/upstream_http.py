"""A lean HTTP/1.1 client for the one request the proxy sends per routed request: POST, keep-alive pooled.

``post`` takes an idle connection for (host, port) or opens one, writes the request in one write, and
reads the status line and headers within ``read_timeout``, then the body as it comes (Content-Length,
chunked, or until close).  ``release()`` returns a finished keep-alive connection to the pool;
``close()`` closes it (vLLM aborts the request of a closed connection).

It replaces aiohttp's client because that client's per-request objects cost more CPU than the rest of
the proxy (docs/measurements.md, "Every core").  The answer keeps the part of ``aiohttp.ClientResponse``
the proxy reads and raises aiohttp's own exceptions, so failure handling is unchanged:
``ClientOSError``, ``ConnectionTimeoutError``, ``SocketTimeoutError`` (nothing in ``read_timeout``),
``ServerDisconnectedError`` (closed before the status line), ``ClientPayloadError`` (closed mid-body).
Invariant: a pooled connection the server closed while idle is retried once on a new one, before any
byte of the answer (the server never read the request).
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import aiohttp

_MAX_HEAD = 64 << 10
_HIGH_WATER = 256 << 10
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class UpstreamAnswer:
    """One answer: the status line and headers at once, the body as it arrives."""

    def __init__(self, conn: _Conn, read_timeout: float | None) -> None:
        self._conn = conn
        self._loop = conn.loop
        self.read_timeout = read_timeout
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.got_bytes = False
        self._head = bytearray()
        self._head_done = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._length = -1  # bytes of body left (Content-Length); -1: chunked or until close
        self._chunked = False
        self._cbuf = bytearray()
        self._cstate = _SIZE
        self._cleft = 0

    @property
    def content(self) -> UpstreamAnswer:
        return self

    # ------------------------------------------------------------------ fed by the protocol
    def feed(self, data: bytes) -> None:
        self.got_bytes = True
        if not self._head_done:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > _MAX_HEAD:
                    self.fail(aiohttp.ClientPayloadError("upstream headers too long"))
                return
            try:
                self._parse_head(bytes(self._head[:end]))
            except (ValueError, IndexError):
                self.fail(aiohttp.ClientPayloadError("malformed upstream status line or headers"))
                return
            data = bytes(self._head[end + 4 :])
            self._head = bytearray()
            if not self._head_done:  # a 1xx answer: the real one follows
                if data:
                    self.feed(data)
                return
            self._wake()
            if not data:
                return
        if self._done:
            self.keep_alive = False  # bytes past the end of the answer: the connection is not reusable
            return
        if self._chunked:
            self._feed_chunked(data)
        elif self._length >= 0:
            if len(data) > self._length:
                self.keep_alive = False
                data = data[: self._length]
            self._length -= len(data)
            self._push(data)
            if self._length == 0:
                self._finish()
        else:
            self._push(data)

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, code = lines[0].split(b" ", 2)[:2]
        status = int(code)
        if 100 <= status < 200:
            return
        self.status = status
        hdrs: dict[str, str] = {}
        for line in lines[1:]:
            k, sep, v = line.partition(b":")
            if not sep:
                raise ValueError("header without a colon")
            name = k.strip().decode("latin-1")
            value = v.strip().decode("latin-1")
            hdrs[name] = f"{hdrs[name]}, {value}" if name in hdrs else value
        self.headers = hdrs
        low = {k.lower(): v for k, v in hdrs.items()}
        conn = low.get("connection", "").lower()
        self.keep_alive = (version == b"HTTP/1.1" and "close" not in conn) or "keep-alive" in conn
        self._head_done = True
        if status in (204, 304):
            self._finish()
        elif "chunked" in low.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in low:
            self._length = int(low["content-length"])
            if self._length == 0:
                self._finish()
        else:
            self.keep_alive = False  # the body ends when the connection does

    def _feed_chunked(self, data: bytes) -> None:
        buf = self._cbuf
        buf += data
        while not self._done:
            if self._cstate == _SIZE or self._cstate == _TRAILER:
                nl = buf.find(b"\r\n")
                if nl < 0:
                    if len(buf) > _MAX_HEAD:
                        self.fail(aiohttp.ClientPayloadError("malformed chunked encoding"))
                    return
                line = bytes(buf[:nl])
                del buf[: nl + 2]
                if self._cstate == _TRAILER:
                    if not line:
                        self._finish()
                    continue
                try:
                    self._cleft = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    self.fail(aiohttp.ClientPayloadError("malformed chunk size"))
                    return
                self._cstate = _DATA if self._cleft else _TRAILER
            elif self._cstate == _DATA:
                if not buf:
                    return
                take = bytes(buf[: self._cleft])
                del buf[: len(take)]
                self._cleft -= len(take)
                self._push(take)
                if not self._cleft:
                    self._cstate = _DATA_END
            else:  # _DATA_END: the CRLF after a chunk's data
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    self.fail(aiohttp.ClientPayloadError("malformed chunk end"))
                    return
                del buf[:2]
                self._cstate = _SIZE

    def _push(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            if self._buffered > _HIGH_WATER:
                self._conn.pause()
            self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def eof(self) -> None:
        """The connection ended: the body too, if it had no length; otherwise it was cut short."""
        if self._done:
            return
        if self._head_done and not self._chunked and self._length < 0:
            self._finish()
        elif self._head_done:
            self.fail(aiohttp.ClientPayloadError("upstream closed the connection mid-answer"))
        else:
            self.fail(aiohttp.ServerDisconnectedError("upstream closed the connection before answering"))

    def fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._done:
            self._exc = exc
            self.keep_alive = False
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ------------------------------------------------------------------ read by the proxy
    async def _wait(self) -> None:
        if self._exc is not None:
            raise self._exc
        fut = self._waiter = self._loop.create_future()
        timer = None
        if self.read_timeout:
            timer = self._loop.call_later(self.read_timeout, self._timed_out, fut)
        try:
            await fut
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        if self._exc is not None:
            raise self._exc

    def _timed_out(self, fut: asyncio.Future[None]) -> None:
        if not fut.done():
            fut.set_exception(aiohttp.SocketTimeoutError("no bytes from upstream in time"))

    async def head(self) -> None:
        while not self._head_done:
            await self._wait()

    async def read(self) -> bytes:
        while not self._done:
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    async def readany(self) -> bytes:
        while not self._chunks and not self._done:
            await self._wait()
        if not self._chunks:
            return b""
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the answer ended cleanly."""
        if self._done and self.keep_alive and self._exc is None:
            self._conn.idle()
        else:
            self.close()

    def close(self) -> None:
        self._conn.close()


class _Conn(asyncio.Protocol):
    def __init__(self, pool: UpstreamHttp, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.answer: UpstreamAnswer | None = None
        self.closed = False
        self.used = 0
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: the same methods, duck-typed
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.answer is None:
            self.close()  # bytes nobody asked for: the connection's framing is lost
            return
        self.answer.feed(data)

    def eof_received(self) -> bool:
        if self.answer is not None:
            self.answer.eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.answer is not None:
            if exc is not None and not self.answer.got_bytes:
                self.answer.fail(aiohttp.ClientOSError(getattr(exc, "errno", 0) or 0, str(exc)))
            self.answer.eof()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def idle(self) -> None:
        self.answer = None
        self.resume()
        if self.closed:
            return
        self.pool.put(self)

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()
        self.closed = True
        self.pool.forget(self)


class UpstreamHttp:
    """Keep-alive connections per (host, port); one request at a time on each."""

    def __init__(self, *, max_idle_per_host: int = 256) -> None:
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._urls: dict[str, tuple[tuple[str, int], bytes]] = {}

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        t = self._urls.get(url)
        if t is None:
            u = urlsplit(url)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"not an http:// URL: {url}")
            port = u.port or 80
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            host = u.netloc.rsplit("@", 1)[-1]
            line = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")
            if len(self._urls) > 4096:
                self._urls.clear()
            t = self._urls[url] = ((u.hostname, port), line)
        return t

    async def post(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        *,
        connect_timeout: float | None,
        read_timeout: float | None,
    ) -> UpstreamAnswer:
        key, line = self._target(url)
        head = line + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
        data = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        for _ in range(2):
            conn = self._take(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key, connect_timeout)
            conn.used += 1
            ans = conn.answer = UpstreamAnswer(conn, read_timeout)
            assert conn.transport is not None
            conn.transport.write(data)
            try:
                await ans.head()
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                conn.close()
                if reused and not ans.got_bytes:
                    continue  # the server had closed the idle connection: it never read this request
                raise
            except BaseException:
                conn.close()
                raise
            return ans
        raise aiohttp.ServerDisconnectedError("upstream closed the connection before answering")

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            c = idle.pop()
            if not c.closed:
                return c
        return None

    async def _connect(self, key: tuple[str, int], timeout: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: _Conn(self, key), key[0], key[1])
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(f"no connection to {key[0]}:{key[1]} in time") from None
        except OSError as e:
            raise aiohttp.ClientOSError(e.errno or 0, f"cannot connect to {key[0]}:{key[1]}: {e}") from e
        return conn

    def put(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        idle.append(conn)

    def forget(self, conn: _Conn) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        for idle in self._idle.values():
            for c in list(idle):
                c.close()
        self._idle.clear()
