"""Active health checks against a real HTTP server: an instance that refuses connections or answers non-200
leaves rotation at once; one that answers late leaves only after ``health_timeouts`` late checks in a row,
so one slow answer from a busy API server does not take a healthy instance out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from indexer.config import InstanceConfig
from kvrouter.gateway.upstream import UpstreamPool
from kvrouter.loop_lag import LoopLag
from kvrouter.routing import LoadTracker
from tests.support.net import free_port


class Behaviour:
    def __init__(self) -> None:
        self.delay_s = 0.0
        self.status = 200


@asynccontextmanager
async def instance(b: Behaviour, port: int) -> AsyncIterator[str]:
    async def health(_: web.Request) -> web.Response:
        await asyncio.sleep(b.delay_s)
        return web.Response(status=b.status)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_late_answers_take_an_instance_out_only_after_health_timeouts_in_a_row() -> None:
    b, port = Behaviour(), free_port()
    async with instance(b, port) as url, aiohttp.ClientSession() as s:
        # interval 0.25 s: a check waits 0.5 s for its answer
        pool = UpstreamPool([InstanceConfig("v0", url=url)], LoadTracker(), health_interval_s=0.25)
        pool._session = s
        u = pool.upstreams["v0"]
        await pool._check(u)
        assert u.healthy and u.served_models == ["m"]
        b.delay_s = 2.0
        await pool._check(u)
        assert u.healthy and u.check_timeouts == 1, "one late answer took the instance out"
        await pool._check(u)
        assert not u.healthy and u.check_timeouts == 2
        b.delay_s = 0.0
        await pool._check(u)
        assert u.healthy and u.check_timeouts == 0
        # a late answer between passing checks starts the count over
        b.delay_s = 2.0
        await pool._check(u)
        b.delay_s = 0.0
        await pool._check(u)
        b.delay_s = 2.0
        await pool._check(u)
        assert u.healthy and u.check_timeouts == 1
        # an instance that says it is down leaves at once
        b.delay_s, b.status = 0.0, 503
        await pool._check(u)
        assert not u.healthy
        b.status = 200
        await pool._check(u)
        assert u.healthy


async def test_a_check_that_timed_out_while_this_loop_stood_still_gives_no_verdict() -> None:
    b, port = Behaviour(), free_port()
    lag = LoopLag()
    lag.start()
    try:
        async with instance(b, port) as url, aiohttp.ClientSession() as s:
            pool = UpstreamPool(
                [InstanceConfig("v0", url=url)],
                LoadTracker(),
                health_interval_s=0.25,
                health_timeouts=1,
                lag=lag,
            )
            pool._session = s
            u = pool.upstreams["v0"]
            b.delay_s = 2.0  # no answer within the check's 0.5 s
            check = asyncio.create_task(pool._check(u))
            await asyncio.sleep(0.05)  # the check is waiting for its answer
            time.sleep(0.6)  # this process stands still past the check's timeout
            await check
            assert u.healthy and u.check_timeouts == 0, "a timeout of our own was held against the instance"
            await pool._check(u)  # the same late answer with the loop free: it counts
            assert not u.healthy and u.check_timeouts == 1
    finally:
        lag.stop()


async def test_a_refused_connection_takes_the_instance_out_at_once() -> None:
    b, port = Behaviour(), free_port()
    async with aiohttp.ClientSession() as s:
        async with instance(b, port) as url:
            pool = UpstreamPool([InstanceConfig("v0", url=url)], LoadTracker(), health_interval_s=0.25)
            pool._session = s
            u = pool.upstreams["v0"]
            await pool._check(u)
            assert u.healthy
        await pool._check(u)  # the server is gone: connection refused
        assert not u.healthy and u.check_timeouts == 0
