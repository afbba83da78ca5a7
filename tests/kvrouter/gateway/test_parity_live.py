"""Token parity watched on a live (simulated) fleet: a misrendering instance is detected from sampled
requests within seconds, its model alone is routed without token-based predictions, and trust returns
once the probes pass.  Instances given only a URL are subscribed from their ``/kv_event_sources``."""

from __future__ import annotations

import random
import string
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvrouter.gateway.parity_probe import MM_PROBE_SET, PROBE_SET
from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, counter_by, gateway, heal, sim_fleet
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")
ADAPTER = "sql"


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(n))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(3, lora_names=[ADAPTER]) as f:
        yield f


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def whole_fleet(fleet: SimFleet) -> None:
    """No fault left on by an earlier test of the module (one that failed before unsetting it)."""
    await heal(fleet)


def chat(model: str, system: str, q: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
    }


async def explain(s: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> dict[str, Any]:
    async with s.post(f"{base}/v1/route/explain", json=body) as r:
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


def parity_of(gw: Any, model: str) -> str:
    m = gw.pipeline.parity.models.get(model)
    return "unknown" if m is None else str(m.status)


async def test_a_misrendering_instance_is_detected_and_its_model_falls_back(fleet: SimFleet) -> None:
    rng = random.Random(5)
    system = words(rng, 300)
    over = {
        "models": {ADAPTER: {"chat_template": fleet.chat_template}},
        "parity": {"sample_rate": 1.0, "recheck_interval_s": 0.3},
    }
    async with gateway(fleet, **over) as (gw, base), aiohttp.ClientSession() as s:
        # start-up probes: every instance renders as the router does
        await until(lambda: parity_of(gw, MODEL) == "ok", what="start-up parity")
        assert (await explain(s, base, chat(MODEL, system, "q")))["tokenized"]
        # The faulty instance is the one this conversation goes to: kv-aware routing keeps chats over one
        # shared system prompt where that prompt is cached, so a fault anywhere else would never be
        # sampled.  Detection is then bounded by requests that instance served, not by the machine's speed.
        async with s.post(f"{base}/v1/chat/completions", json=chat(MODEL, system, "first")) as r:
            assert r.status == 200
            holder = r.headers["x-kvrouter-instance"]
        victim = next(v for v in fleet.servers if v.instance.config.name == holder)
        async with s.post(f"{victim.url}/sim/faults", json={"render_fault": True}) as r:
            assert r.status == 200
        # Every request is sampled (sample_rate 1): the first one the victim serves is checked against its
        # /tokenize, which now differs.  The check runs beside the request, so wait for its verdict (the
        # timeout only bounds a hang; the claim's speed is the parity bench's).
        for _ in range(20):
            async with s.post(f"{base}/v1/chat/completions", json=chat(MODEL, system, words(rng, 5))) as r:
                assert r.status == 200
                if r.headers["x-kvrouter-instance"] == holder:
                    break
        else:
            raise AssertionError(f"20 chats over the prompt {holder} caches were all routed elsewhere")
        await until(lambda: parity_of(gw, MODEL) == "failing", what="the sampled request's check failing")
        mm = gw.pipeline.parity.models[MODEL].last_mismatch
        assert mm is not None and mm.instance == victim.instance.config.name and mm.position < 8
        # the failing model is routed without token-based predictions; the other model keeps them
        e = await explain(s, base, chat(MODEL, system, "q"))
        assert not e["tokenized"] and e["predicted_cached_tokens"] == 0
        assert (await explain(s, base, chat(ADAPTER, system, "q")))["tokenized"]
        async with s.get(f"{base}/health") as r:
            health = await r.json()
        assert health["token_parity"]["models"][MODEL]["status"] == "failing"
        async with s.get(f"{base}/v1/fleet") as r:
            assert (await r.json())["token_parity"]["models"][MODEL]["status"] == "failing"
        async with s.get(f"{base}/metrics") as r:
            text = await r.text()
        checks = counter_by(text, "kvrouter_token_parity_checks", "result", model=MODEL)
        assert checks["mismatch"] >= 1 and checks["match"] >= 1
        # the instance is fixed: the next recheck passes and predictions return
        async with s.post(f"{victim.url}/sim/faults", json={"render_fault": False}) as r:
            assert r.status == 200
        await until(lambda: parity_of(gw, MODEL) == "ok", what="parity back after the fix")
        assert (await explain(s, base, chat(MODEL, system, "q")))["tokenized"]


async def test_instances_given_only_a_url_are_subscribed_from_their_event_sources(fleet: SimFleet) -> None:
    d = fleet.fleet_dict()
    urls_only = [{"name": i["name"], "url": i["url"], "models": i["models"]} for i in d["instances"]]
    async with gateway(fleet, instances=urls_only) as (gw, base), aiohttp.ClientSession() as s:
        await until(
            lambda: all(u.cfg.events is not None for u in gw.pool.upstreams.values()), what="events resolved"
        )
        for u in gw.pool.upstreams.values():
            ic = next(x.instance.config for x in fleet.servers if x.instance.config.name == u.name)
            assert u.cfg.events == ic.events_endpoint and u.cfg.replay == ic.replay_endpoint
        rng = random.Random(9)
        body = chat(MODEL, words(rng, 200), "hello")
        async with s.post(f"{base}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            first = r.headers["x-kvrouter-instance"]
        await until(
            lambda: (
                gw.indexer.index.blocks(next(src for src in gw.indexer.sources() if src.instance == first))[0]
                > 0
            ),
            what="events indexed",
        )
        e = await explain(s, base, body)
        assert e["choice"] == first and e["predicted_cached_tokens"] > 0


async def test_a_sweep_of_the_fleet_makes_each_probe_once(fleet: SimFleet) -> None:
    """The start-up sweep checks every instance with the same probe set: the router's own ids for it are
    made once per sweep (a worker per core each tokenizing them once per instance slowed its first
    requests), and every instance's answer is still checked against them."""
    async with gateway(fleet) as (gw, _):
        await until(lambda: parity_of(gw, MODEL) == "ok", what="start-up parity")
        made = 0
        tokens = gw.pipeline.tokens.tokens

        async def counted(req: Any) -> Any:
            nonlocal made
            made += 1
            return await tokens(req)

        gw.pipeline.tokens.tokens = counted
        names = [s.instance.config.name for s in fleet.servers]
        memo: dict[str | None, Any] = {}
        results = [await gw.parity.check_instance(n, "startup", models=[MODEL], memo=memo) for n in names]
        per_instance = len(results[0])
        assert per_instance >= 2 and all(r == results[0] for r in results)
        assert set(results[0]) <= {"match", "skipped", "unsupported"} and "match" in results[0]
        assert made == len(PROBE_SET) + len(MM_PROBE_SET)  # once for the sweep, not once per instance
        made = 0
        await gw.parity.check_instance(names[0], "startup", models=[MODEL])  # no sweep: made again
        assert made > 0
