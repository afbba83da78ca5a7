"""predicted-latency live: a gateway in front of a mixed simulated fleet (one instance of the ``test``
profile, one of ``test-slow``: a third of its FLOPs), streaming requests one at a time.  The gateway
learns each instance's speed from the first tokens it sees; once warm it sends to the fast one, explain
shows both predictions, and the metrics count the observations and their errors."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from kvrouter.gateway import Gateway
from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")  # the fleet serves on the module's loop

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def chat(rng: random.Random, n_words: int, stream: bool = True) -> dict[str, object]:
    text = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(n_words))
    return {
        "model": MODEL,
        "max_tokens": 3,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mixed() -> AsyncIterator[SimFleet]:
    # A tenth of the modelled speed: a 2,000-word prompt (about 5,000 tokens) prefills in ~100 ms on the
    # fast instance and ~300 ms on the slow one, above the noise of this process's own tokenizing.
    async with sim_fleet(2, profiles=["test", "test-slow"], speed=0.1) as f:
        yield f


async def stream(gw: Gateway, s: aiohttp.ClientSession, base: str, body: dict[str, object]) -> str:
    """One request, streamed to its end, and the gateway done with it: the client reads the last byte
    before the gateway's handler releases the request's load, and a request sent in between would be
    decided (and its time learned) with the previous one still in flight."""
    async with s.post(f"{base}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
        target = r.headers["x-kvrouter-instance"]
    await until(lambda: gw.router.load.total_in_flight() == 0, what="the gateway released the request")
    return target


async def test_the_gateway_learns_which_instance_is_slow(mixed: SimFleet) -> None:
    rng = random.Random(5)
    fast, slow = (srv.name for srv in mixed.servers)
    over = {"routing": {"policy": "predicted-latency", "predicted_latency": {"model": {"warmup": 8}}}}
    async with gateway(mixed, **over) as (gw, base), aiohttp.ClientSession() as s:
        book = gw.router.latency
        cold = []
        while not all(book.warm(t) for t in (fast, slow)):  # kv-aware spreads new prompts while cold
            cold.append(await stream(gw, s, base, chat(rng, 2000)))
            assert len(cold) < 40, cold
        assert {fast, slow} <= set(cold)
        async with s.post(f"{base}/v1/route/explain", json=chat(rng, 2000, stream=False)) as r:
            assert r.status == 200, await r.text()
            ex = await r.json()
        pred = {c["target"]: c["predicted_ttft_s"] for c in ex["candidates"]}
        assert pred[slow] > 1.4 * pred[fast] > 0, pred
        assert all(c["predicted_tpot_s"] is not None for c in ex["candidates"])
        warm = [await stream(gw, s, base, chat(rng, 2000)) for _ in range(6)]
        assert warm == [fast] * 6
        async with s.get(f"{base}/metrics") as r:
            assert r.status == 200
            text = await r.text()
        assert 'kvrouter_decisions_total{policy="predicted-latency",reason="latency"} 6.0' in text
        assert 'kvrouter_latency_observations_total{kind="ttft",outcome="used"}' in text
        assert 'kvrouter_latency_prediction_error_ratio_count{kind="ttft"}' in text
