"""A gateway whose event source stays silent while its instance computes prompts says so: the simulated
instance publishes on one port, the fleet file names another (as with vLLM connecting its PUB out)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.net import free_port


async def test_a_silent_source_is_logged_counted_and_shown_in_health() -> None:
    async with sim_fleet(1) as fleet:
        inst = fleet.fleet_dict()["instances"][0]
        wrong = {**inst, "events": f"tcp://127.0.0.1:{free_port()}"}  # nobody publishes there
        wrong.pop("replay", None)
        async with gateway(fleet, instances=[wrong]) as (gw, base), aiohttp.ClientSession() as s:
            for i in range(4):
                body = {"model": MODEL, "prompt": f"deaf {i} " + "word " * 80, "max_tokens": 1}
                async with s.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
            gw.pipeline.event_watch.grace_s = 0.0  # the owed batches are long overdue on the sim

            async def degraded() -> bool:
                async with s.get(base + "/health") as r:
                    assert r.status == 200
                    return (await r.json())["status"] == "events_degraded"

            for _ in range(200):
                if await degraded():
                    break
                await asyncio.sleep(0.05)
            async with s.get(base + "/health") as r:
                health = await r.json()
            async with s.get(base + "/metrics") as r:
                assert r.status == 200
                text = await r.text()
        src = f"{inst['name']}/0"
        assert health["status"] == "events_degraded" and src in health["events"]["deaf"], health["events"]
        assert f'kvrouter_event_source_deaf{{source="{src}"}} 1.0' in text
