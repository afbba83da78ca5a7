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


async def objective(s: aiohttp.ClientSession, base: str, body: dict[str, object], ms: str) -> tuple[int, str]:
    async with s.post(f"{base}/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": ms}) as r:
        await r.read()
        return r.status, r.headers.get("x-kvrouter-slo", "")


@pytest.mark.parametrize("learned", [True, False])
async def test_slo_admission_predicts_from_the_learned_models_once_warm(
    mixed: SimFleet, learned: bool
) -> None:
    """No rates configured (``flows.slo``): an objective is not predicted until every instance's models are
    warm; then, with ``learned``, it is judged by the fast instance's learned TTFT (the least)."""
    rng = random.Random(11)
    fast, slow = (srv.name for srv in mixed.servers)
    over = {
        "routing": {"predicted_latency": {"model": {"warmup": 8}}},
        "flows": {"slo": {"on_miss": "reject", "learned": learned}},
    }
    async with gateway(mixed, **over) as (gw, base), aiohttp.ClientSession() as s:
        book = gw.router.latency
        assert await objective(s, base, chat(rng, 200, stream=False), "1") == (200, "not_predicted")
        sent = 0
        while not all(book.warm(t) for t in (fast, slow)):
            await stream(gw, s, base, chat(rng, 2000))
            sent += 1
            assert sent < 40
        body = chat(rng, 2000, stream=False)
        async with s.post(f"{base}/v1/route/explain", json=body) as r:
            assert r.status == 200, await r.text()
            pred = {c["target"]: c["predicted_ttft_s"] for c in (await r.json())["candidates"]}
        status, verdict = await objective(s, base, body, "1")
        if not learned:
            assert (status, verdict) == (200, "not_predicted")
            return
        assert status == 429 and verdict.startswith("rejected; ttft; predicted_ms="), verdict
        assert verdict.endswith("; by=models"), verdict
        predicted_ms = float(verdict.split("predicted_ms=", 1)[1].split(";")[0])
        # the least of the two (the fast instance's), as explain showed it a moment before
        assert predicted_ms == pytest.approx(min(pred.values()) * 1e3, rel=0.2, abs=5), (verdict, pred)
        assert pred[slow] > pred[fast]
        assert await objective(s, base, chat(rng, 2000, stream=False), "60000") == (200, "met")
        async with s.get(f"{base}/metrics") as r:
            text = await r.text()
        assert 'kvrouter_flow_slo_total{outcome="rejected_ttft",tenant="default"} 1.0' in text
        assert 'kvrouter_flow_slo_total{outcome="not_predicted",tenant="default"} 1.0' in text


async def test_only_streamed_answers_teach_the_models(mixed: SimFleet) -> None:
    """A unary answer's time is its whole generation: not a TTFT (its "first token" is its last byte),
    and no pace (its tokens all arrive at once): counted as ``unary``.  A stream's first chunk is its first
    token, and its usage block (``include_usage``) gives the tokens its pace is learned over; without it,
    its pace is counted as ``no_pace``."""
    rng = random.Random(13)
    async with gateway(mixed) as (gw, base), aiohttp.ClientSession() as s:
        book = gw.router.latency

        def counts() -> dict[str, int]:
            learned = {
                k: book.outcomes[(k, "used")] + book.outcomes[(k, "clipped")] for k in ("ttft", "tpot")
            }
            untaught = {f"{k}:{o}": n for (k, o), n in book.outcomes.items() if o in ("unary", "no_pace")}
            return {**learned, **untaught}

        async def settled(expected: dict[str, int]) -> None:
            await until(lambda: gw.router.load.total_in_flight() == 0, what="the request released")
            await until(lambda: book.pending_training == 0 and counts() == expected, what=f"{expected}")

        unary = {**chat(rng, 300, stream=False), "max_tokens": 12}
        async with s.post(f"{base}/v1/chat/completions", json=unary) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["completion_tokens"] > 1
        await settled({"ttft": 0, "tpot": 0, "ttft:unary": 1})
        streamed = {**chat(rng, 300), "max_tokens": 12, "stream_options": {"include_usage": True}}
        await stream(gw, s, base, streamed)
        await settled({"ttft": 1, "tpot": 1, "ttft:unary": 1})
        await stream(gw, s, base, {**chat(rng, 300), "max_tokens": 12})  # no usage: its pace is unknown
        await settled({"ttft": 2, "tpot": 1, "ttft:unary": 1, "tpot:no_pace": 1})
        assert not book._pending  # every request forgotten once it ended
        async with s.get(f"{base}/metrics") as r:
            text = await r.text()
        assert 'kvrouter_latency_observations_total{kind="ttft",outcome="unary"} 1.0' in text
        assert 'kvrouter_latency_observations_total{kind="tpot",outcome="no_pace"} 1.0' in text
