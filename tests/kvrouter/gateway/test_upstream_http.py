"""The proxy's lean HTTP/1.1 client against real servers: aiohttp's (Content-Length and chunked answers,
streamed bodies, keep-alive reuse) and raw asyncio servers that answer byte by byte as a broken or
unusual upstream would (close-delimited bodies, 1xx, idle connections the server closed, bodies cut short,
malformed framing, silence).  Every answer is compared with what the server sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.gateway.upstream_http import UpstreamHttp
from tests.support.net import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    writers: list[asyncio.StreamWriter] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        writers.append(w)
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        server.close()
        for w in writers:
            w.close()
        await server.wait_closed()


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        hdrs[k.strip().decode().lower()] = v.strip().decode()
    body = await r.readexactly(int(hdrs.get("content-length", "0")))
    return lines[0], hdrs, body


@asynccontextmanager
async def aiohttp_server() -> AsyncIterator[tuple[str, list[web.Request]]]:
    seen: list[web.Request] = []

    async def fixed(request: web.Request) -> web.Response:
        seen.append(request)
        body = await request.read()
        return web.Response(body=b"echo:" + body, headers={"X-Upstream": "yes"})

    async def stream(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        n = int((await request.json())["n"])
        out = web.StreamResponse()
        await out.prepare(request)
        for i in range(n):
            await out.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0)
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/fixed", fixed)
    app.router.add_post("/stream", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_content_length_and_chunked_answers_reuse_one_connection() -> None:
    http = UpstreamHttp()
    async with aiohttp_server() as (base, seen):
        for i in range(3):
            ans = await http.post(
                base + "/fixed", b"body%d" % i, {"X-Test": "t"}, connect_timeout=5, read_timeout=5
            )
            assert ans.status == 200 and ans.headers["X-Upstream"] == "yes"
            assert await ans.read() == b"echo:body%d" % i
            ans.release()
        assert seen[-1].headers["X-Test"] == "t"
        assert http.idle_connections() == 1  # released cleanly: kept alive and reused
        peers = {r.transport.get_extra_info("peername") for r in seen if r.transport is not None}
        assert len(peers) == 1

        ans = await http.post(base + "/stream", b'{"n": 50}', {}, connect_timeout=5, read_timeout=5)
        got = b""
        while chunk := await ans.content.readany():
            got += chunk
        assert got == b"".join(f"data: {i}\n\n".encode() for i in range(50))
        ans.release()
        assert http.idle_connections() == 1
    http.close()


@settings(max_examples=25, deadline=None)
@given(
    body=st.binary(max_size=3000),
    sizes=st.lists(st.integers(1, 700), min_size=1, max_size=8),
    cut=st.integers(1, 64),
)
def test_chunked_body_split_anywhere_decodes_to_what_was_sent(
    body: bytes, sizes: list[int], cut: int
) -> None:
    """The server frames ``body`` in chunks of ``sizes`` and writes the bytes ``cut`` at a time (chunk
    boundaries and packet boundaries fall anywhere): the client reads exactly ``body``."""

    async def run() -> None:
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            framed = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            i, k = 0, 0
            while i < len(body):
                part = body[i : i + sizes[k % len(sizes)]]
                framed += b"%x;ext=1\r\n" % len(part) + part + b"\r\n"
                i, k = i + len(part), k + 1
            framed += b"0\r\nX-Trailer: y\r\n\r\n"
            for j in range(0, len(framed), cut):
                w.write(framed[j : j + cut])
                await w.drain()
                await asyncio.sleep(0)
            await r.read()  # until the client closes or idles out

        http = UpstreamHttp()
        async with raw_server(handler) as url:
            ans = await http.post(url, b"x", {}, connect_timeout=5, read_timeout=5)
            assert await ans.read() == body
            ans.release()
            assert http.idle_connections() == 1
        http.close()

    asyncio.run(run())


async def test_close_delimited_body_and_informational_answer() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\nX-A: 1\r\nX-A: 2\r\n\r\npart one,")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b" part two")
        w.close()

    http = UpstreamHttp()
    async with raw_server(handler) as url:
        ans = await http.post(url, b"", {}, connect_timeout=5, read_timeout=5)
        assert ans.status == 200 and ans.headers["X-A"] == "1, 2"
        assert await ans.read() == b"part one, part two"
        ans.release()
        assert http.idle_connections() == 0  # its end was the connection's: not reusable
    http.close()


async def test_an_idle_connection_the_server_closed_is_retried_once_on_a_new_one() -> None:
    requests: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        _, _, body = await read_request(r)
        requests.append(body)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        w.close()  # the server keeps no connection alive, without saying so

    http = UpstreamHttp()
    async with raw_server(handler) as url:
        for i in range(3):
            ans = await http.post(url, b"%d" % i, {}, connect_timeout=5, read_timeout=5)
            assert await ans.read() == b"ok"
            ans.release()
            await asyncio.sleep(0.05)
    assert requests == [b"0", b"1", b"2"]  # each sent once, none lost
    http.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"", aiohttp.ServerDisconnectedError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", aiohttp.ClientPayloadError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", aiohttp.ClientPayloadError),
        (b"HTTP/1.1 200 OK\r\nbroken header line\r\n\r\n", aiohttp.ClientPayloadError),
    ],
)
async def test_broken_answers_raise_aiohttps_errors(answer: bytes, error: type[Exception]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(answer)
        await w.drain()
        w.close()

    http = UpstreamHttp()
    async with raw_server(handler) as url:
        with pytest.raises(error):
            ans = await http.post(url, b"", {}, connect_timeout=5, read_timeout=5)
            await ans.read()
    assert http.idle_connections() == 0
    http.close()


async def test_silence_and_refusal() -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await asyncio.sleep(5)

    http = UpstreamHttp()
    async with raw_server(silent) as url:
        with pytest.raises(aiohttp.SocketTimeoutError):
            await http.post(url, b"", {}, connect_timeout=5, read_timeout=0.2)
    with pytest.raises(aiohttp.ClientOSError):
        await http.post(f"http://127.0.0.1:{free_port()}/x", b"", {}, connect_timeout=5, read_timeout=1)
    with pytest.raises(ValueError):
        await http.post("https://127.0.0.1:1/x", b"", {}, connect_timeout=5, read_timeout=1)
    http.close()
