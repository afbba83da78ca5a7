"""A live (simulated) fleet with a shared L2: what one instance wrote is credited to every instance, valued
at the L2's worth in explain, routed on, reported by vLLM as cached, and counted by tier in metrics."""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, counter_by, gateway, sim_fleet

pytestmark = pytest.mark.asyncio(loop_scope="module")


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(n))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    # 64 GPU blocks per instance (a few prompts evict each other), a 4096-block L2 shared by all three
    async with sim_fleet(3, capacity_blocks=64, shared_l2_blocks=4096) as f:
        yield f


async def complete(s: aiohttp.ClientSession, url: str, prompt: str) -> tuple[dict[str, Any], Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json(), r.headers


async def test_a_block_in_the_l2_counts_for_every_instance(fleet: SimFleet) -> None:
    rng = random.Random(3)
    prompt = words(rng, 120)
    a = fleet.servers[0]
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:
        # instance 0 computes the prompt (written through to the L2), then other prompts push it out of
        # its 64-block GPU pool: afterwards only the L2 holds it, for all three instances alike
        await complete(s, a.url, prompt)
        for _ in range(4):
            await complete(s, a.url, words(rng, 150))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

        async def explain() -> dict[str, Any]:
            async with s.post(f"{base}/v1/route/explain", json=body) as r:
                assert r.status == 200
                out: dict[str, Any] = await r.json()
                return out

        deadline = time.monotonic() + 15
        while True:
            e = await explain()
            splits = [c["tiers"] for c in e["candidates"]]
            if all(t.get("l2", 0) > 0 and t["GPU"] == 0 for t in splits) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert all(t.get("l2", 0) > 0 and t["GPU"] == 0 for t in splits), splits
        value = e["tier_costs"]["value"]["l2"]
        assert 0 < value < 1
        for c in e["candidates"]:
            assert c["tier_value"]["l2"] == pytest.approx(value, abs=1e-4)
            assert c["hit_tokens"] == c["tiers"]["l2"] * 16
            assert c["cached_tokens"] == round(c["hit_tokens"] * value)

        # routed through the gateway: vLLM (the simulator) reports the L2's tokens as cached
        out, headers = await complete(s, base, prompt)
        predicted = int(headers["x-kvrouter-cached-tokens"])
        assert predicted > 0
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted

        async with s.get(f"{base}/metrics") as r:
            text = await r.text()
        blocks = counter_by(text, "kvrouter_routed_cached_blocks", "tier")
        assert blocks.get("l2", 0) * 16 == predicted
        assert gw.router.load.total_in_flight() == 0
