"""Admission at the gateway's front door: a request the gateway refuses is answered 429 with Retry-After
before its body is read (the client never sends it here); a loop busy on every turn refuses, a free one
serves again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from kvrouter.gateway import Gateway
from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(2) as f:
        yield f


async def headers_only(base: str, length: int = 4096) -> tuple[int, dict[str, str], bytes]:
    """POST /v1/completions announcing a ``length``-byte body that never comes: only a request refused
    before its body is read is answered."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


def rejected(gw: Gateway, reason: str) -> float:
    reg = gw.metrics.registry
    return reg.get_sample_value("kvrouter_rejections_total", {"reason": reason}) or 0.0


async def test_a_full_gateway_refuses_before_the_body(fleet: SimFleet) -> None:
    async with gateway(fleet, limits={"max_requests": 1}) as (gw, base):
        with gw.pipeline.held():  # the one request the gateway may hold
            status, headers, body = await headers_only(base)
        assert status == 429 and headers["retry-after"] == "1"
        assert b"TooManyRequestsError" in body
        assert rejected(gw, "gateway_full") == 1


async def test_a_loop_behind_on_every_turn_refuses_and_recovers(fleet: SimFleet) -> None:
    async with (
        gateway(fleet, limits={"max_loop_lag_s": 0.02}) as (gw, base),
        aiohttp.ClientSession() as s,
    ):
        stop = asyncio.Event()

        async def hog() -> None:  # CPU work on the loop: every turn 60 ms late, never idle
            while not stop.is_set():
                end = time.monotonic() + 0.06
                while time.monotonic() < end:
                    pass
                await asyncio.sleep(0)

        task = asyncio.create_task(hog())
        try:
            await until(
                lambda: gw.lag.standing_s >= 0.045 and gw.lag.demand >= 0.9,
                what="a standing delay past twice the bound, the loop never idle",
            )
            status, headers, _ = await headers_only(base)
            assert status == 429 and "retry-after" in headers
            assert rejected(gw, "gateway_busy") >= 1
        finally:
            stop.set()
            await task
        await until(lambda: gw.lag.standing_s < 0.02, what="the loop on time again")
        body = {"model": MODEL, "prompt": "back to normal", "max_tokens": 1}
        async with s.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
