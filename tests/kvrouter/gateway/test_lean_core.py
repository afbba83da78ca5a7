"""The lean core's own HTTP/1.1 (``gateway.lean``), over raw sockets in front of a simulated fleet: what the
aiohttp front did for it (framing, keep-alive, the other routes on the same port) it must do too."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from kvrouter.gateway import Gateway
from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, gateway, sim_fleet

pytestmark = pytest.mark.asyncio(loop_scope="module")

LEAN = {"gateway": {"front": "lean"}, "limits": {"max_body_bytes": 64 << 10}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(2) as f:
        yield f


@pytest_asyncio.fixture(loop_scope="module")
async def lean(fleet: SimFleet) -> AsyncIterator[tuple[Gateway, str]]:
    async with gateway(fleet, **LEAN) as (gw, base):
        yield gw, base


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> dict:  # type: ignore[type-arg]
        return json.loads(self.body)


async def read_answer(r: asyncio.StreamReader) -> Answer:
    """One HTTP/1.1 answer (a 100 Continue skipped): Content-Length, chunked, or until the connection ends."""
    while True:
        line = await r.readline()
        status = int(line.split()[1])
        headers: dict[str, str] = {}
        while (h := await r.readline()) not in (b"\r\n", b""):
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if status != 100:
            break
    if "content-length" in headers:
        return Answer(status, headers, await r.readexactly(int(headers["content-length"])))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int((await r.readline()).split(b";")[0], 16)) > 0:
            body += await r.readexactly(size)
            await r.readline()
        await r.readline()
        return Answer(status, headers, body)
    return Answer(status, headers, await r.read())


@contextlib.asynccontextmanager
async def connect(base: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    u = urlsplit(base)
    r, w = await asyncio.open_connection(u.hostname, u.port)
    try:
        yield r, w
    finally:
        w.close()
        with contextlib.suppress(ConnectionError):
            await w.wait_closed()


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: gw", "Content-Type: application/json", *extra]
    if not any(e.lower().startswith(("transfer-encoding", "content-length")) for e in extra):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def completion(text: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": text, "max_tokens": 2}).encode()


async def test_a_connection_serves_routed_requests_then_hands_the_rest_to_aiohttp(
    lean: tuple[Gateway, str],
) -> None:
    _, base = lean
    async with connect(base) as (r, w):
        w.write(post("/v1/completions", completion("one on the lean core")))
        a = await read_answer(r)
        assert a.status == 200 and a.json()["choices"] and "x-kvrouter-instance" in a.headers
        w.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")  # not a lean route: aiohttp's from here
        a = await read_answer(r)
        assert a.status == 200 and a.json()["data"][0]["id"] == MODEL
        w.write(post("/v1/completions", completion("then on aiohttp, routed the same way")))
        a = await read_answer(r)
        assert a.status == 200 and a.json()["choices"] and "x-kvrouter-instance" in a.headers
    m = await _metrics(base)
    assert 'kvrouter_requests_total{route="/v1/completions",status="200"} 2.0' in m


async def test_pipelined_requests_are_answered_in_order(lean: tuple[Gateway, str]) -> None:
    _, base = lean
    async with connect(base) as (r, w):
        w.write(b"".join(post("/v1/completions", completion(f"pipelined number {i}")) for i in range(3)))
        answers = [await read_answer(r) for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 200]


async def test_chunked_bodies_expect_continue_and_http_1_0(lean: tuple[Gateway, str]) -> None:
    _, base = lean
    body = completion("a chunked request body")
    async with connect(base) as (r, w):
        chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
        w.write(post("/v1/completions", b"", "Transfer-Encoding: chunked") + chunked)
        assert (await read_answer(r)).status == 200
        w.write(post("/v1/completions", b"", "Expect: 100-continue", f"Content-Length: {len(body)}"))
        assert (await r.readline()).startswith(b"HTTP/1.1 100")
        await r.readline()
        w.write(body)
        assert (await read_answer(r)).status == 200
    async with connect(base) as (r, w):  # HTTP/1.0: answered with its length, then the connection ends
        w.write(post("/v1/completions", body, version="1.0"))
        a = await read_answer(r)
        assert a.status == 200 and a.json()["choices"] and await r.read() == b""


async def test_too_large_and_malformed_requests_get_a_4xx_with_a_reason(lean: tuple[Gateway, str]) -> None:
    gw, base = lean
    async with connect(base) as (r, w):
        w.write(post("/v1/completions", b"x" * (100 << 10)))
        a = await read_answer(r)
        assert a.status == 413 and "longer than" in a.json()["error"]["message"]
        assert await r.read() == b""  # closed: the rest of that body is not read
    async with connect(base) as (r, w):
        w.write(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n")
        a = await read_answer(r)
        assert a.status == 400 and "malformed" in a.json()["error"]["message"]
    async with connect(base) as (r, w):  # a head the parser would buffer without end
        w.write(b"POST /v1/completions HTTP/1.1\r\nX-Long: " + b"a" * (200 << 10))
        a = await read_answer(r)
        assert a.status == 431 and "headers are longer" in a.json()["error"]["message"]
    async with connect(base) as (r, w):
        w.write(post("/v1/chat/completions", b"{not json"))
        a = await read_answer(r)
        assert a.status == 400 and a.json()["error"]["type"] == "BadRequestError"
    assert gw.pipeline.admission.active == 0


async def test_a_streamed_answer_is_relayed_chunk_by_chunk(lean: tuple[Gateway, str]) -> None:
    _, base = lean
    body = json.dumps(
        {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    async with connect(base) as (r, w):
        w.write(post("/v1/chat/completions", body))
        a = await read_answer(r)
    assert a.status == 200 and a.headers["content-type"].startswith("text/event-stream")
    events = [e for e in a.body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) >= 3


async def _metrics(base: str) -> str:
    async with connect(base) as (r, w):
        w.write(b"GET /metrics HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        return (await read_answer(r)).body.decode()
