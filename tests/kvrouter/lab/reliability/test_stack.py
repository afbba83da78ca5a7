"""The reliability scenarios, quick settings, against a simulated fleet and real gateways on 127.0.0.1.

Each test runs the scenario function ``kvrouter reliability`` runs and holds every figure to its line; the
long ones (Redis outage, router restart, floods, load, five event-loss trials) are marked slow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from kvrouter.gateway.upstream_http import UpstreamHttp
from kvrouter.lab.reliability.crash import CrashConfig, crash
from kvrouter.lab.reliability.driver import PromptMix, Shot, lean_one, one
from kvrouter.lab.reliability.event_loss import EventLossConfig, event_loss
from kvrouter.lab.reliability.figures import ScenarioResult, render_table
from kvrouter.lab.reliability.flood import FloodConfig, flood
from kvrouter.lab.reliability.gap import GapConfig, gap
from kvrouter.lab.reliability.hang import HangConfig, hang
from kvrouter.lab.reliability.http_fuzz import HttpFuzzConfig, http_fuzz
from kvrouter.lab.reliability.load import LoadConfig, load
from kvrouter.lab.reliability.redis_outage import RedisOutageConfig, redis_outage
from kvrouter.lab.reliability.restart import RestartConfig, restart
from kvrouter.lab.reliability.security import access_control, log_hygiene
from kvrouter.lab.reliability.stack import MODEL, Resources, client, set_faults
from kvrouter.lab.reliability.tenants import TenantConfig, tenants
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def res() -> AsyncIterator[Resources]:
    async with Resources() as r:
        yield r


def holds(r: ScenarioResult) -> None:
    assert r.ok, "\n" + render_table([r]) + "\n" + "\n".join(r.notes)


# ---------------------------------------------------------------------------------------------- faults
async def test_event_loss_one_trial(res: Resources) -> None:
    holds(await event_loss(res, EventLossConfig(trials=1, requests=80, seed=1)))


async def test_gap_older_than_the_buffer(res: Resources) -> None:
    holds(await gap(res, GapConfig(seed=1)))


async def test_crash_mid_stream(res: Resources) -> None:
    holds(await crash(res, CrashConfig(streams=6, stream_tokens=800, down_s=1.0)))


async def test_hung_instance(res: Resources) -> None:
    holds(await hang(res, HangConfig(requests=24)))


async def test_admission_answers_429_before_reading_the_body(res: Resources) -> None:
    """limits.max_requests: past it a 429 with Retry-After at once; /health still answers."""
    async with res.fleet(2) as fleet:
        g = await res.gateway(fleet, {"limits": {"max_requests": 2}})
        async with g, client() as s:
            for srv in fleet.servers:
                await set_faults(s, srv.url, latency_s=1.0)
            body = {"model": MODEL, "prompt": "wait for me", "max_tokens": 1}

            async def one() -> tuple[int, str | None, float]:
                t0 = time.monotonic()
                async with s.post(f"{g.base}/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After"), time.monotonic() - t0

            slow = [asyncio.create_task(one()) for _ in range(2)]
            assert g.gw is not None
            pipeline = g.gw.pipeline
            await until(lambda: pipeline.admission.active == 2, what="both slow requests held")
            fast = await asyncio.gather(*(one() for _ in range(4)))
            # answered at once: while both slow ones (each held >= 1 s upstream) are still in flight
            assert not any(t.done() for t in slow)
            async with s.get(f"{g.base}/health") as r:
                assert r.status == 200
            assert [st for st, _, _ in await asyncio.gather(*slow)] == [200, 200]
            assert all(st == 429 and ra == "1" for st, ra, _ in fast), fast
            async with s.get(f"{g.base}/metrics") as r:
                text = await r.text()
            assert 'kvrouter_rejections_total{reason="gateway_full"} 4.0' in text
            assert "kvrouter_event_loop_tasks" in text
            for srv in fleet.servers:
                await set_faults(s, srv.url, latency_s=0.0)


async def test_the_open_loop_driver_records_what_aiohttps_client_records(res: Resources) -> None:
    """The load scenario's driver sends through the lean client: 200s and prompt 429s read as aiohttp's
    client reads them (status, Retry-After, instance, decision time), a refused connection as an error."""
    async with res.fleet(2) as fleet:
        g = await res.gateway(fleet, {"limits": {"max_requests": 2}})
        names = {srv.name for srv in fleet.servers}
        lean = UpstreamHttp()
        async with g, client() as s:
            url = f"{g.base}/v1/completions"
            mix = PromptMix(3, prefix=16, tail=4)
            served = [Shot(sent=0.0), Shot(sent=0.0)]
            await asyncio.gather(
                lean_one(lean, url, mix.body(), served[0]), one(s, url, mix.body(), served[1])
            )
            for srv in fleet.servers:  # held until cancelled: the refusals cannot race their release
                await set_faults(s, srv.url, latency_s=30.0)
            slow = [Shot(sent=0.0) for _ in range(2)]
            held = [asyncio.create_task(lean_one(lean, url, mix.body(), sh)) for sh in slow]
            assert g.gw is not None
            pipeline = g.gw.pipeline
            await until(lambda: pipeline.admission.active == 2, what="both slow requests held")
            refused = [Shot(sent=0.0), Shot(sent=0.0)]
            await asyncio.gather(
                lean_one(lean, url, mix.body(), refused[0]), one(s, url, mix.body(), refused[1])
            )
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            await until(lambda: pipeline.admission.active == 0, what="the abandoned requests released")
            for srv in fleet.servers:
                await set_faults(s, srv.url, latency_s=0.0)
        gone = Shot(sent=0.0)
        await lean_one(lean, url, mix.body(), gone)  # the gateway has stopped: nothing listens
        lean.close()
    for sh in served:
        assert sh.status == 200 and sh.error is None and sh.instance and sh.decision_ms is not None, sh
    assert {sh.instance for sh in served} <= names
    assert [(sh.status, sh.retry_after, sh.error) for sh in refused] == [(429, "1", None)] * 2
    assert gone.status == 0 and gone.error, gone


# ---------------------------------------------------------------------------------------------- bad input
async def test_http_apis_never_answer_5xx(res: Resources) -> None:
    holds(await http_fuzz(res, HttpFuzzConfig(examples=300, seed=2)))


# ---------------------------------------------------------------------------------------------- security
async def test_tenants_never_see_each_others_cache(res: Resources) -> None:
    holds(await tenants(res, TenantConfig(prompts=4, seed=3)))


async def test_logs_carry_no_event_or_request_contents(res: Resources) -> None:
    holds(await log_hygiene(res, seed=4))


async def test_admin_routes_and_api_keys_are_locked(res: Resources) -> None:
    holds(await access_control(res))


# ---------------------------------------------------------------------------------------------- slow
@pytest.mark.slow
async def test_event_loss_five_trials(res: Resources) -> None:
    holds(await event_loss(res, EventLossConfig()))


@pytest.mark.slow
async def test_router_restart_comes_back_warm(res: Resources) -> None:
    holds(await restart(res, RestartConfig()))


@pytest.mark.slow
async def test_redis_gone_and_back(res: Resources) -> None:
    holds(await redis_outage(res, RedisOutageConfig(bursts=4)))


@pytest.mark.slow
async def test_event_flood() -> None:
    # A lower cap than the full scenario's: the flooded source must reach it within the first half of a
    # 10 s flood on a slow machine too, or the RSS-plateau check measures the climb (it failed so once).
    holds(await flood(FloodConfig(seconds=10.0, baseline_s=2.0, cap=50_000)))


@pytest.mark.slow
async def test_load_then_overload() -> None:
    holds(await load(LoadConfig(step_s=3.0, direct_s=4.0, sustain_s=15.0, overload_s=6.0, recovery_s=5.0)))


async def test_gateway_health_is_not_behind_the_admission_limit(res: Resources) -> None:
    """The liveness routes answer whatever the OpenAI routes are doing (k8s must not kill a busy router)."""
    async with res.fleet(1) as fleet:
        g = await res.gateway(fleet, {"limits": {"max_requests": 1}})
        async with g, aiohttp.ClientSession() as s:
            for path in ("/livez", "/health", "/ping", "/metrics"):
                async with s.get(f"{g.base}{path}") as r:
                    assert r.status == 200, path
