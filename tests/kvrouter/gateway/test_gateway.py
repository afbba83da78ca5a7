"""The gateway in front of a simulated vLLM fleet: real HTTP, real ZeroMQ, real tokenizer."""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from indexer.config import parse_fleet
from kvrouter.api import parse_body
from kvrouter.config import RouterFleetConfig
from kvrouter.lab.sim.server.fleet import SimFleet
from kvrouter.pipeline import FleetTokens
from tests.support.gateway import MODEL, counter_by, gateway, heal, sim_fleet
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(n))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(3) as f:
        yield f


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def whole_fleet(fleet: SimFleet) -> None:
    """No fault left on by an earlier test of the module (one that failed before unsetting it)."""
    await heal(fleet)


async def post(
    s: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[int, dict[str, str], dict]:  # type: ignore[type-arg]
    async with s.post(url, json=body) as r:
        data = await r.json(content_type=None)
        return r.status, dict(r.headers), data


async def test_routing_goes_where_the_cache_is(fleet: SimFleet) -> None:
    rng = random.Random(1)
    system = words(rng, 600)
    async with gateway(fleet, routing={"shadow_every": 1}) as (gw, base), aiohttp.ClientSession() as s:
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "first"}],
        }
        st, h1, d1 = await post(s, f"{base}/v1/chat/completions", body)
        assert st == 200, d1
        first = h1["x-kvrouter-instance"]
        # the instance's events reach the index; then the same prefix goes back there, and hits
        await until(lambda: any(gw.indexer.index.blocks(src)[0] > 0 for src in gw.indexer.sources()))
        picks, hits = Counter(), []
        for i in range(5):
            body["messages"][1]["content"] = f"question number {i}"  # type: ignore[index]
            st, h, d = await post(s, f"{base}/v1/chat/completions", body)
            assert st == 200
            picks[h["x-kvrouter-instance"]] += 1
            hits.append(
                (int(h["x-kvrouter-cached-tokens"]), d["usage"]["prompt_tokens_details"]["cached_tokens"])
            )
        assert picks == {first: 5}
        assert all(pred > 500 and pred == real for pred, real in hits), hits
        # predicted vs reported cached tokens are exported
        m = await (await s.get(f"{base}/metrics")).text()
        assert (
            "kvrouter_reported_cached_tokens_total" in m
            and 'kvrouter_decisions_total{policy="kv-aware",reason="cache"}' in m
        )
        # shadow scoring (deferred until each request is on its way) ran for every request and policy
        shadow = {
            sample.labels["policy"]: sample.value
            for fam in text_string_to_metric_families(m)
            for sample in fam.samples
            if sample.name == "kvrouter_shadow_cached_tokens_total"
        }
        assert set(shadow) == {
            "kv-aware",
            "prefix-hash",
            "least-loaded",
            "round-robin",
            "random",
            "session",
            "predicted-latency",
        }
        assert shadow["kv-aware"] == sum(pred for pred, _ in hits) + int(h1["x-kvrouter-cached-tokens"])
        assert "kvrouter_shadow_scored_total 6.0" in m


async def test_shadow_scoring_samples_one_decision_in_shadow_every(fleet: SimFleet) -> None:
    async with gateway(fleet, routing={"shadow_every": 3}) as (_gw, base), aiohttp.ClientSession() as s:
        for i in range(7):
            body = {"model": MODEL, "max_tokens": 2, "prompt": f"sample {i} of the shadow scoring"}
            st, _, d = await post(s, f"{base}/v1/completions", body)
            assert st == 200, d
        m = await (await s.get(f"{base}/metrics")).text()
        scored = {
            sample.name: sample.value
            for fam in text_string_to_metric_families(m)
            for sample in fam.samples
            if sample.name == "kvrouter_shadow_scored_total"
        }
        assert scored["kvrouter_shadow_scored_total"] == 2  # decisions 3 and 6 of 7


async def test_a_burst_of_a_new_prefix_sticks_together(fleet: SimFleet) -> None:
    rng = random.Random(2)
    prefix = words(rng, 500)
    async with gateway(fleet) as (_, base), aiohttp.ClientSession() as s:
        bodies = [{"model": MODEL, "max_tokens": 8, "prompt": prefix + f" tail {i}"} for i in range(8)]
        res = await asyncio.gather(*(post(s, f"{base}/v1/completions", b) for b in bodies))
        assert all(st == 200 for st, _, _ in res)
        assert len({h["x-kvrouter-instance"] for _, h, _ in res}) == 1


async def test_the_openai_client_works_streaming_and_not(fleet: SimFleet) -> None:
    async with gateway(fleet) as (_, base):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
        try:
            c = await client.completions.create(model=MODEL, prompt="Hello there, router", max_tokens=5)
            assert c.usage is not None and c.usage.completion_tokens == 5
            ch = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
            assert ch.choices[0].message.content is not None
            chunks = []
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "stream please"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                chunks.append(chunk)
            assert len(chunks) >= 7 and chunks[-1].usage is not None
            assert chunks[0].choices[0].delta.role == "assistant"
            cs = await client.completions.create(model=MODEL, prompt="count", max_tokens=4, stream=True)
            texts = [c.choices[0].text async for c in cs if c.choices]
            assert len(texts) == 4
            models = await client.models.list()
            assert [m.id for m in models.data][:1] == [MODEL]
        finally:
            await client.close()


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/v1/completions", b"{", 400, "not valid JSON"),
        ("/v1/completions", b"[]", 400, "JSON object"),
        ("/v1/completions", b'{"model": "sim-model"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "x", "stream": "yes"}', 400, "stream"),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "x", "cache_salt": ""}', 400, "cache_salt"),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "not served"),
        ("/v1/chat/completions", b'{"model": "sim-model", "messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "sim-model", "messages": [{"content": "x"}]}', 400, "role"),
        ("/v1/route/explain", b"{}", 400, "prompt"),
    ],
)
async def test_bad_requests_get_a_4xx_with_a_reason(
    fleet: SimFleet, path: str, body: bytes, status: int, needle: str
) -> None:
    async with (
        gateway(fleet) as (_, base),
        aiohttp.ClientSession() as s,
        s.post(f"{base}{path}", data=body, headers={"Content-Type": "application/json"}) as r,
    ):
        assert r.status == status
        assert needle in await r.text()


async def test_explain_shows_every_candidate_without_sending(fleet: SimFleet) -> None:
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "explain me " * 50, "max_tokens": 3}
        st, _, d = await post(s, f"{base}/v1/route/explain", body)
        assert st == 200 and d["tokenized"] and d["num_tokens"] > 50
        assert {c["target"] for c in d["candidates"]} == {i.name for i in gw.cfg.instances}
        assert d["choice"] in {c["target"] for c in d["candidates"]}
        assert set(d["shadow"]) == {
            "prefix-hash",
            "least-loaded",
            "round-robin",
            "random",
            "session",
            "predicted-latency",
        }
        # every candidate with the latency models' predictions, whatever the policy
        assert all(c["predicted_ttft_s"] is not None for c in d["candidates"])
        assert gw.router.load.total_in_flight() == 0


async def test_sagemaker_contract(fleet: SimFleet) -> None:
    # prefix-hash keys on affinity id + prefix: one prompt under eight affinity ids spreads over the
    # instances, each id keeps its instance, and the body's prompt_cache_key is the same key as the header.
    # (Bounded load off: the engines' scraped load, stale on a busy machine, must not move a key here.)
    routing = {"policy": "prefix-hash", "prefix_hash": {"load_bound": 1000.0}}
    async with gateway(fleet, routing=routing) as (_, base), aiohttp.ClientSession() as s:
        async with s.get(f"{base}/ping") as r:
            assert r.status == 200
        prompt = {"model": MODEL, "prompt": "the same prompt for every tenant " * 5, "max_tokens": 2}
        ids = [f"tenant-{i}" for i in range(8)]

        async def where(tenant: str, *, header: bool = True) -> str:
            body = prompt if header else {**prompt, "prompt_cache_key": tenant}
            hdrs = {"X-Amzn-SageMaker-Prefix-Aware-Id": tenant} if header else {}
            async with s.post(f"{base}/invocations", json=body, headers=hdrs) as r:
                assert r.status == 200
                return r.headers["x-kvrouter-instance"]

        first = {t: await where(t) for t in ids}
        assert len(set(first.values())) > 1, first
        assert {t: await where(t) for t in ids} == first
        assert {t: await where(t, header=False) for t in ids[:3]} == {t: first[t] for t in ids[:3]}
        async with s.post(
            f"{base}/invocations",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ) as r:
            assert r.status == 200 and (await r.json())["object"] == "chat.completion"


async def test_limits_spill_and_reject_with_retry_after(fleet: SimFleet) -> None:
    over = {"limits": {"max_in_flight": 1, "queue_size": 1, "queue_timeout_s": 0.5}}
    async with gateway(fleet, **over) as (_, base), aiohttp.ClientSession() as s:
        for srv in fleet.servers:
            async with s.post(f"{srv.url}/sim/faults", json={"latency_s": 0.6}) as r:
                assert r.status == 200
        try:
            bodies = [{"model": MODEL, "prompt": f"slow {i}", "max_tokens": 2} for i in range(6)]
            res = await asyncio.gather(*(s.post(f"{base}/v1/completions", json=b) for b in bodies))
            statuses = Counter(r.status for r in res)
            assert statuses[200] >= 3 and statuses[429] >= 1, statuses
            r429 = next(r for r in res if r.status == 429)
            assert r429.headers["Retry-After"] == "1"
            for r in res:
                r.release()
        finally:
            for srv in fleet.servers:
                async with s.post(f"{srv.url}/sim/faults", json={"latency_s": 0.0}) as r:
                    assert r.status == 200


async def test_failover_retries_a_dead_instance_and_takes_it_out(fleet: SimFleet) -> None:
    # A dead engine's 503s eject it (failure_threshold in a row) before any health check sees it down;
    # a short ejection keeps this test about fail-over and the return (ejection has its own test).
    over = {"routing": {"policy": "round-robin"}, "gateway": {"ejection_s": 0.5}}
    async with gateway(fleet, **over) as (gw, base), aiohttp.ClientSession() as s:
        dead = fleet.servers[0]
        async with s.post(f"{dead.url}/sim/faults", json={"dead": True}) as r:
            assert r.status == 200
        try:
            res = [
                await post(s, f"{base}/v1/completions", {"model": MODEL, "prompt": f"p{i}", "max_tokens": 2})
                for i in range(6)
            ]
            assert all(st == 200 for st, _, _ in res)
            assert all(h["x-kvrouter-instance"] != dead.name for _, h, _ in res)
            await until(lambda: not gw.pool.upstreams[dead.name].healthy)
        finally:
            async with s.post(f"{dead.url}/sim/faults", json={"dead": False}) as r:
                assert r.status == 200
        await until(lambda: gw.pool.upstreams[dead.name].healthy)


async def test_a_connect_timeout_of_the_routers_own_stall_is_retried_on_the_same_instance(
    fleet: SimFleet,
) -> None:
    """A connection that timed out while the router's own loop stood still says nothing about the
    instance, and the prompt was placed there (speculative entries, claims, placements tell every router
    so): the retry goes to the same instance, which is not held to blame.  Moved elsewhere, the prompt
    would be cached where no router expects it, and its next requests would miss where they are sent."""
    async with gateway(fleet, gateway={"connect_timeout_s": 0.2}) as (gw, base), aiohttp.ClientSession() as s:
        loop = asyncio.get_running_loop()
        first: list[str] = []
        dispatched = gw.pipeline.dispatched

        def stall_once(p: object, chosen: object, **kw: object) -> None:
            if not first:
                first.append(chosen.instance)  # type: ignore[attr-defined]
                loop.call_soon(time.sleep, 0.5)  # this process stands still past the connect timeout
            dispatched(p, chosen, **kw)  # type: ignore[arg-type]

        gw.pipeline.dispatched = stall_once  # type: ignore[method-assign]
        prompt = words(random.Random(11), 60)
        st, h, _ = await post(
            s, f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert st == 200 and first
        async with s.get(f"{base}/metrics") as r:
            text = await r.text()
        retries = counter_by(text, "kvrouter_retries", "reason")
        assert sum(retries.values()) == 1, "the stall did not time the connect out"
        assert h["x-kvrouter-instance"] == first[0]
        assert retries == {"stalled": 1.0}
        assert counter_by(text, "kvrouter_upstream_failures_excused", "instance") == {first[0]: 1.0}
        up = gw.pool.upstreams[first[0]]
        assert up.healthy and up.failures == 0


async def test_a_hung_engine_behind_a_live_health_check_is_ejected_with_backoff(fleet: SimFleet) -> None:
    """The victim answers /health but never starts an answer: its timeouts eject it for ``ejection_s``
    during which passing checks do not put it back (no flapping); further ejections last twice as long."""
    over = {
        "routing": {"policy": "round-robin"},
        "gateway": {"first_byte_timeout_s": 0.3, "failure_threshold": 2, "ejection_s": 3.0},
    }
    async with gateway(fleet, **over) as (gw, base), aiohttp.ClientSession() as s:
        victim = fleet.servers[0]
        up = gw.pool.upstreams[victim.name]
        async with s.post(f"{victim.url}/sim/faults", json={"latency_s": 3600.0}) as r:
            assert r.status == 200
        try:
            res = [
                await post(s, f"{base}/v1/completions", {"model": MODEL, "prompt": f"h{i}", "max_tokens": 2})
                for i in range(6)
            ]
            assert all(st == 200 for st, _, _ in res)  # each timeout was retried elsewhere
            assert up.ejections == 1 and not up.healthy
            # the next health check passes (/health answers) during the ejection, and the ejection holds
            checked = up.last_check
            await until(lambda: up.last_check != checked, what="a health check during the ejection")
            assert up.last_check is not None and up.last_check < up.ejected_until
            assert not up.healthy
        finally:
            async with s.post(f"{victim.url}/sim/faults", json={"latency_s": 0.0}) as r:
                assert r.status == 200
        await until(lambda: up.healthy)
        async with s.get(f"{base}/metrics") as r:
            assert f'kvrouter_instance_ejections_total{{instance="{victim.name}"}} 1.0' in await r.text()
        # a second ejection soon after the first lasts twice as long
        gw.pool.record_failure(victim.name, connection=False)
        gw.pool.record_failure(victim.name, connection=False)
        assert up.ejections == 2 and up.ejected_until - up.last_ejection == pytest.approx(6.0)
        assert not up.healthy  # out of rotation at once, not only at the next health check


async def test_a_crash_mid_stream_ends_with_an_error_event(fleet: SimFleet) -> None:
    async with gateway(fleet, routing={"policy": "round-robin"}) as (gw, base), aiohttp.ClientSession() as s:
        victim = fleet.servers[1]
        async with s.post(f"{victim.url}/sim/faults", json={"slowdown": 200.0}) as r:
            assert r.status == 200
        try:
            body = {"model": MODEL, "prompt": "long story", "max_tokens": 400, "stream": True}
            for _ in range(len(fleet.servers)):
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200
                    if r.headers["x-kvrouter-instance"] != victim.name:
                        await r.read()
                        continue
                    first = await r.content.readany()
                    assert first.startswith(b"data: ")
                    async with aiohttp.ClientSession() as admin:
                        try:  # the crash may close this very connection before it answers
                            async with admin.post(
                                f"{victim.url}/sim/faults", json={"crash": True, "down_s": 0.3}
                            ):
                                pass
                        except aiohttp.ClientError:
                            pass
                    rest = await asyncio.wait_for(r.read(), 10)
                    assert b'"BadGatewayError"' in rest and rest.rstrip().endswith(b"data: [DONE]")
                    break
            else:
                pytest.fail("round-robin never chose the victim")
        finally:
            # the victim restarts (down_s) with its faults as they were: wait until it is back (its own
            # word: the gateway may never have seen it down) and in rotation, then take the slowdown off
            # (the fleet is shared by the module's tests)
            await until(lambda: not victim.instance.faults.crashed, what="the victim back up")
            await until(lambda: gw.pool.upstreams[victim.name].healthy, what="the victim in rotation")
            async with (
                aiohttp.ClientSession() as admin,
                admin.post(f"{victim.url}/sim/faults", json={"slowdown": 1.0}) as r,
            ):
                assert r.status == 200


async def test_a_client_that_disconnects_frees_its_slot(fleet: SimFleet) -> None:
    async with gateway(fleet) as (gw, base):
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "never mind", "max_tokens": 3000, "stream": True}
            r = await s.post(f"{base}/v1/completions", json=body)
            await r.content.readany()
            assert gw.router.load.total_in_flight() == 1
            r.close()  # the client goes away mid-stream
        await until(lambda: gw.router.load.total_in_flight() == 0)
        # and the engine was told: nothing keeps generating for it
        await until(
            lambda: all(
                sum(len(rk.engine.scheduler.running) for rk in srv.instance.ranks) == 0
                for srv in fleet.servers
            ),
        )


async def test_cache_lookup_accepts_messages_and_prompts(fleet: SimFleet) -> None:
    rng = random.Random(5)
    system = words(rng, 300)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "lookup me"}]
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:
        st, h, _ = await post(
            s, f"{base}/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": msgs}
        )
        assert st == 200
        target = h["x-kvrouter-instance"]
        await until(lambda: any(gw.indexer.index.blocks(src)[0] > 0 for src in gw.indexer.sources()))
        st, _, d = await post(s, f"{base}/v1/cache/lookup", {"model": MODEL, "messages": msgs})
        assert st == 200
        best = max(d["instances"], key=lambda m: m["matched_blocks"])
        assert best["instance"] == target and best["matched_tokens"] >= 300
        st, _, d = await post(s, f"{base}/v1/cache/lookup", {"model": MODEL, "messages": [{"role": 5}]})
        assert st == 400


async def test_tenants_get_their_salt_and_admin_routes_need_the_token(fleet: SimFleet) -> None:
    over = {
        "tenants": {
            "require_api_key": True,
            "api_keys": {"key-a": {"name": "a", "salt": "salt-a"}, "key-b": {"name": "b", "salt": "salt-b"}},
        },
        "gateway": {"admin_token": "sekret"},
    }
    prompt = "tenant shared prompt " * 60
    async with gateway(fleet, **over) as (gw, base), aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with s.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 401
        async with s.post(
            f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer key-a"}
        ) as r:
            assert r.status == 200
        await until(lambda: any(gw.indexer.index.blocks(src)[0] > 0 for src in gw.indexer.sources()))
        # tenant b sends the same prompt, even claiming a's salt: it never sees a's blocks
        body_b = {**body, "cache_salt": "salt-a"}
        async with s.post(
            f"{base}/v1/completions", json=body_b, headers={"Authorization": "Bearer key-b"}
        ) as r:
            assert r.status == 200
            assert r.headers["x-kvrouter-cached-tokens"] == "0"
            assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with s.post(
            f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer key-a"}
        ) as r:
            assert r.status == 200 and int(r.headers["x-kvrouter-cached-tokens"]) > 0
        async with s.post(f"{base}/v1/route/explain", json=body) as r:
            assert r.status == 401
        async with s.post(
            f"{base}/v1/route/explain", json=body, headers={"Authorization": "Bearer sekret"}
        ) as r:
            assert r.status == 200


async def test_remote_indexer_mode(fleet: SimFleet) -> None:
    """The gateway pointed at a standalone `kvrouter indexer`: events indexed there, routing the same."""
    from aiohttp.test_utils import TestServer

    from indexer import service as index_service

    app = index_service.build(fleet.fleet_config())
    ix_server = TestServer(app, host="127.0.0.1")
    await ix_server.start_server()
    try:
        url = str(ix_server.make_url("")).rstrip("/")
        remote_ix = app[index_service.INDEXER]
        rng = random.Random(9)
        prompt = words(rng, 400)
        async with gateway(fleet, gateway={"indexer_url": url}) as (gw, base), aiohttp.ClientSession() as s:
            assert gw.subscriber is None
            st, h, _ = await post(
                s, f"{base}/v1/completions", {"model": MODEL, "prompt": prompt + " one", "max_tokens": 2}
            )
            assert st == 200
            first = h["x-kvrouter-instance"]
            await until(lambda: any(remote_ix.index.blocks(src)[0] > 0 for src in remote_ix.sources()))
            st, h, d = await post(
                s, f"{base}/v1/completions", {"model": MODEL, "prompt": prompt + " two", "max_tokens": 2}
            )
            assert st == 200 and h["x-kvrouter-instance"] == first
            assert (
                int(h["x-kvrouter-cached-tokens"])
                == d["usage"]["prompt_tokens_details"]["cached_tokens"]
                > 300
            )
    finally:
        await ix_server.close()


async def test_chat_without_a_router_side_template_is_routed_untokenized(fleet: SimFleet) -> None:
    """vLLM may hold a template the router lacks (``--chat-template``): such chat requests are served,
    routed by load and prefix text, counted, instead of refused; completions still get token ids."""
    d = fleet.fleet_dict()
    for spec in (d.get("models") or {}).values():
        spec.pop("chat_template", None)
    d.pop("chat_template", None)
    cfg = parse_fleet(d, RouterFleetConfig)
    tokens = FleetTokens.from_config(cfg)
    try:
        chat = parse_body(b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}', "chat")
        assert await tokens.tokens(chat) is None
        assert await tokens.tokens(chat) is None
        assert tokens.untokenized == Counter({MODEL: 2})
        text = parse_body(b'{"model": "sim-model", "prompt": "hi there"}', "completions")
        ids = await tokens.tokens(text)
        assert ids and all(isinstance(t, int) for t in ids)
    finally:
        tokens.close()
    async with gateway(fleet) as (gw, base):
        gw.tokens = FleetTokens.from_config(cfg)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
                async with s.post(f"{base}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-kvrouter-cached-tokens"] == "0"
        finally:
            assert isinstance(gw.tokens, FleetTokens)
            gw.tokens.close()
