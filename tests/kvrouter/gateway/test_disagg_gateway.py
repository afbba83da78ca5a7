"""The gateway in front of a simulated 2-prefill / 2-decode fleet: real HTTP, real ZeroMQ, real tokenizer.

Split requests are answered (chat and completions, streamed and not) with both legs in the metrics, the
prefill leg lands where the prompt is cached, and a prefill or decode instance that dies costs no request."""

from __future__ import annotations

import asyncio
import json
import random
import string
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.gateway import Gateway
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig, parse_roles
from kvrouter.lab.sim.server.kv_transfer import KvTransferConfig
from kvrouter.types import TargetKey
from tests.support.gateway import MODEL, gateway, heal
from tests.support.sim_server import shared_sim_tokenizer
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALWAYS = {"routing": {"disaggregation": {"mode": "always"}}}
PREFILL = ("sim-prefill-0", "sim-prefill-1")
DECODE = ("sim-decode-0", "sim-decode-1")


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(n))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    cfg = SimFleetConfig(
        instances=4,
        roles=parse_roles("2P2D"),
        profile="test",
        capacity_blocks=2048,
        kv_transfer=KvTransferConfig(lease_s=5.0),
        responses_store=True,
    )
    tok, template = shared_sim_tokenizer()  # the fleet file then names the simulator's chat template
    async with SimFleet(cfg, tokenizer=tok, chat_template=template) as f:
        yield f


GW = tuple[Gateway, str]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def always(fleet: SimFleet) -> AsyncIterator[GW]:
    """A gateway that splits every request it can (starting one takes seconds: shared by the tests)."""
    async with gateway(fleet, **ALWAYS) as g:
        yield g


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def conditional(fleet: SimFleet) -> AsyncIterator[GW]:
    """Conditional disaggregation, with a threshold the tests' short prompts cross."""
    async with gateway(fleet, routing={"disaggregation": {"local_prefill_tokens": 256}}) as g:
        yield g


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def whole_fleet(fleet: SimFleet, always: GW) -> AsyncIterator[None]:
    """Every test starts from the whole fleet: no fault left on, every instance back in the shared
    gateway's rotation (a test that kills an instance, or fails halfway, cannot degrade the next one)."""
    await heal(fleet)
    gw, _ = always
    await until(
        lambda: all(u.healthy for u in gw.pool.upstreams.values()), what="the whole fleet in rotation"
    )
    yield


async def metrics(
    s: aiohttp.ClientSession, base: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with s.get(f"{base}/metrics") as r:
        text = await r.text()
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for fam in text_string_to_metric_families(text)
        for x in fam.samples
    }


def total(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and labels.items() <= dict(lab).items())


async def post(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    async with s.post(url, json=body, headers=headers or {}) as r:
        raw = await r.read()
        if body.get("stream"):
            events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
            return r.status, dict(r.headers), events
        return r.status, dict(r.headers), json.loads(raw)


async def state(s: aiohttp.ClientSession, fleet: SimFleet, name: str) -> dict[str, Any]:
    async with s.get(f"{fleet.server(name).url}/sim/state") as r:
        data: dict[str, Any] = await r.json()
        return data


async def indexed(gw: Gateway, name: str) -> None:
    await until(
        lambda: gw.indexer.index.blocks(next(s for s in gw.indexer.sources() if s.instance == name))[0] > 0
    )


async def test_chat_and_completions_streamed_and_not_with_both_legs(fleet: SimFleet, always: GW) -> None:
    rng = random.Random(1)
    gw, base = always
    book = gw.router.latency

    def counts() -> dict[tuple[str, str], int]:
        return {
            (t, k): book.model(TargetKey(t)).count(k) for t in (*PREFILL, *DECODE) for k in ("ttft", "tpot")
        }

    learned = counts()
    async with aiohttp.ClientSession() as s:
        before = await metrics(s, base)
        cases = []
        for kind in ("chat", "completions"):
            for stream in (False, True):
                text = words(rng, 200)
                body: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "stream": stream}
                if kind == "chat":
                    body["messages"] = [{"role": "user", "content": text}]
                else:
                    body["prompt"] = text
                if stream:
                    body["stream_options"] = {"include_usage": True}
                cases.append((kind, stream, body))
        work = 0  # each request's tokens computed: its prompt less the prefill instance's hit, its output
        for kind, stream, body in cases:
            path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            st, h, data = await post(s, base + path, body, {"X-Request-Id": f"id-{kind}-{stream}"})
            assert st == 200, data
            assert h["x-kvrouter-pd"] == "split" and h["x-kvrouter-pd-reason"] == "remote_prefill"
            assert h["x-kvrouter-prefill-instance"] in PREFILL and h["x-kvrouter-instance"] in DECODE
            if stream:
                assert data[-1] == "[DONE]"
                chunks = [json.loads(d) for d in data[:-1]]
                answer = chunks[-1]
                text = "".join(
                    (c["choices"][0]["delta"].get("content") or "")
                    if kind == "chat"
                    else c["choices"][0]["text"]
                    for c in chunks
                    if c["choices"]
                )
                assert text
            else:
                answer = data
            prefix = "chatcmpl" if kind == "chat" else "cmpl"
            assert answer["id"] == f"{prefix}-id-{kind}-{stream}"  # the decode leg ran under the client's id
            assert answer["usage"]["completion_tokens"] == 5  # the client sees one request's usage
            work += answer["usage"]["prompt_tokens"] - int(h["x-kvrouter-cached-tokens"]) + 5
            # ... and the prefill leg under the same one: its held blocks were read for this id
            p_state = await state(s, fleet, h["x-kvrouter-prefill-instance"])
            assert answer["id"] in p_state["kv_transfer"]["recent_reads"]
        after = await metrics(s, base)
        for leg in ("prefill", "decode"):
            n = total(after, "kvrouter_pd_legs_total", leg=leg) - total(
                before, "kvrouter_pd_legs_total", leg=leg
            )
            assert n == 4, leg
        assert total(after, "kvrouter_pd_decisions_total", mode="disaggregated", reason="remote_prefill") >= 4
        # the flow was charged each request's work, its decode leg's output included
        name = "kvrouter_flow_work_tokens_total"
        assert total(after, name) - total(before, name) == work
        # every leg's load was released
        assert all(load.in_flight == 0 for load in gw.router.load.loads.values())
    # the latency models learned each prefill leg as its instance's TTFT and each streamed decode leg's
    # pace as its instance's TPOT (a unary answer's tokens come at once: no pace), never a decode leg's
    # first token (the prefill's and the transfer's time) as TTFT

    def grown(kind: str, pool: tuple[str, ...]) -> int:
        now = counts()
        return sum(now[(t, kind)] - learned[(t, kind)] for t in pool)

    await until(lambda: grown("ttft", PREFILL) == 4 and grown("tpot", DECODE) == 2, what="legs learned")
    assert grown("ttft", DECODE) == 0 and grown("tpot", PREFILL) == 0


async def test_responses_api_split_then_continued_whole_on_its_holder(fleet: SimFleet, always: GW) -> None:
    """A Responses request is split like a chat request (the prefill leg one output token, not streamed);
    its answer is stored where it was decoded, so a follow-up naming it goes there whole (a prefill
    instance would not know the id) and reads the conversation from that instance's cache."""
    rng = random.Random(2)
    gw, base = always
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            body: dict[str, Any] = {
                "model": MODEL,
                "input": words(rng, 200),
                "max_output_tokens": 4,
                "stream": stream,
            }
            st, h, data = await post(s, base + "/v1/responses", body)
            assert st == 200, data
            assert h["x-kvrouter-pd"] == "split" and h["x-kvrouter-instance"] in DECODE
            answer = json.loads(data[-1])["response"] if stream else data
            assert answer["status"] == "incomplete" and answer["usage"]["output_tokens"] == 4
            assert answer["kv_transfer_params"] is None  # the decode leg's answer names no blocks
            decoded_on = h["x-kvrouter-instance"]
            follow = {
                "model": MODEL,
                "input": words(rng, 20),
                "max_output_tokens": 4,
                "previous_response_id": answer["id"],
            }
            st, h2, data2 = await post(s, base + "/v1/responses", follow)
            assert st == 200, data2
            assert h2["x-kvrouter-instance"] == decoded_on and "x-kvrouter-pd" not in h2
            # the first turn's prompt was received there from the prefill instance: cached for turn 2
            assert data2["usage"]["input_tokens_details"]["cached_tokens"] >= 200
        assert all(load.in_flight == 0 for load in gw.router.load.loads.values())


async def test_the_prefill_leg_lands_where_the_prompt_is_cached(fleet: SimFleet, always: GW) -> None:
    rng = random.Random(2)
    system = words(rng, 500)
    gw, base = always
    async with aiohttp.ClientSession() as s:
        body = {
            "model": MODEL,
            "max_tokens": 3,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "first"}],
        }
        st, h, _ = await post(s, f"{base}/v1/chat/completions", body)
        assert st == 200
        first = h["x-kvrouter-prefill-instance"]
        await indexed(gw, first)
        for i in range(4):
            body["messages"][1]["content"] = f"question {i}"  # type: ignore[index]
            st, h, d = await post(s, f"{base}/v1/chat/completions", body)
            assert st == 200
            assert h["x-kvrouter-prefill-instance"] == first
            predicted = int(h["x-kvrouter-cached-tokens"])
            assert predicted > 500 and d["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
        # explain shows the plan
        async with s.post(f"{base}/v1/route/explain", json=body) as r:
            ex = await r.json()
        assert ex["disaggregation"]["split"] and ex["disaggregation"]["prefill"] == first


async def test_conditional_keeps_a_mostly_cached_request_whole_on_its_decode_instance(
    fleet: SimFleet, conditional: GW
) -> None:
    rng = random.Random(3)
    history = words(rng, 400)
    gw, base = conditional
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "max_tokens": 3, "prompt": history}
        st, h, _ = await post(s, f"{base}/v1/completions", body)
        assert st == 200 and h["x-kvrouter-pd"] == "split"
        decode = h["x-kvrouter-instance"]
        await indexed(gw, decode)  # its events say it received the prompt
        body["prompt"] = history + " and one more short question"
        st, h, d = await post(s, f"{base}/v1/completions", body)
        assert st == 200
        assert (h["x-kvrouter-pd"], h["x-kvrouter-pd-reason"], h["x-kvrouter-instance"]) == (
            "whole",
            "short_uncached",
            decode,
        )
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] > 300


async def test_predicted_mode_splits_where_neither_plan_can_meet_the_objectives(fleet: SimFleet) -> None:
    """``mode: predicted`` live: the conditional rules decide while the models are cold (short prompts
    whole, teaching the decode instances their TTFT; long ones split, teaching the prefill instances
    theirs).  Then every instance's model is set to predict 3 s of TTFT, past the 2 s objective: neither
    plan can meet it, so a short prompt the conditional rules keep whole is split (``predicted_neither``),
    through both legs, counted, and explain shows the same plan."""
    rng = random.Random(8)
    cfg = {
        "disaggregation": {"mode": "predicted", "local_prefill_tokens": 256},
        "predicted_latency": {"model": {"warmup": 3}},
    }
    async with gateway(fleet, routing=cfg) as (gw, base), aiohttp.ClientSession() as s:
        lat = gw.router.latency
        reasons = []
        for i in range(40):
            n = 20 if i % 2 else 400  # short: whole on a decode instance; long: split
            # streamed: a whole request's first chunk is its decode instance's TTFT to learn
            body = {"model": MODEL, "max_tokens": 3, "prompt": words(rng, n), "stream": True}
            st, h, _ = await post(s, f"{base}/v1/completions", body)
            assert st == 200
            reasons.append(h["x-kvrouter-pd-reason"])
            await until(lambda: gw.router.load.total_in_flight() == 0, what="the request released")
            lat.train()
            if all(lat.warm(TargetKey(t)) for t in (*PREFILL, *DECODE)):
                break
        else:
            pytest.fail(f"the models never warmed: {reasons}")
        assert "short_uncached" in reasons and "remote_prefill" in reasons  # cold: the conditional rules
        assert not [r for r in reasons if r.startswith("predicted_")]
        for t in (*PREFILL, *DECODE):
            m = lat.model(TargetKey(t)).models
            m["ttft"].set((3.0, 0, 0, 0, 0, 0, 0, 0))
            m["tpot"].set((0.01, 0, 0, 0))
        body = {"model": MODEL, "max_tokens": 3, "prompt": words(rng, 20)}
        async with s.post(f"{base}/v1/route/explain", json=body) as r:
            ex = await r.json()
        assert ex["disaggregation"]["reason"] == "predicted_neither" and ex["disaggregation"]["split"]
        st, h, _ = await post(s, f"{base}/v1/completions", body)  # short: conditional would keep it whole
        assert st == 200 and (h["x-kvrouter-pd"], h["x-kvrouter-pd-reason"]) == ("split", "predicted_neither")
        assert h["x-kvrouter-prefill-instance"] in PREFILL and h["x-kvrouter-instance"] in DECODE
        m = await metrics(s, base)
        assert total(m, "kvrouter_pd_decisions_total", mode="disaggregated", reason="predicted_neither") == 1


async def test_a_killed_prefill_instance_costs_no_request(fleet: SimFleet, always: GW) -> None:
    rng = random.Random(4)
    prefix = words(rng, 400)
    gw, base = always
    async with aiohttp.ClientSession() as s:
        st, h, _ = await post(
            s, f"{base}/v1/completions", {"model": MODEL, "prompt": prefix, "max_tokens": 2}
        )
        assert st == 200 and h.get("x-kvrouter-pd") == "split", (st, h.get("x-kvrouter-pd-reason"))
        victim = h["x-kvrouter-prefill-instance"]
        other = next(n for n in PREFILL if n != victim)
        await indexed(gw, victim)
        before = await metrics(s, base)
        # dies while computing the next prefill leg (slowed down so the leg is in flight when it dies)
        await (await s.post(f"{fleet.server(victim).url}/sim/faults", json={"slowdown": 200.0})).release()
        body = {"model": MODEL, "prompt": prefix + " plus a tail", "max_tokens": 4, "stream": True}
        task = asyncio.create_task(post(s, f"{base}/v1/completions", body))
        await until(lambda: fleet.server(victim).instance.ranks[0].in_flight > 0, what="leg in flight")
        await fleet.server(victim).crash(down_s=1.5)
        st, h, events = await task
        assert st == 200 and events[-1] == "[DONE]"
        assert h.get("x-kvrouter-prefill-instance") == other, h.get("x-kvrouter-pd-reason")
        after = await metrics(s, base)
        assert total(after, "kvrouter_pd_leg_failures_total", leg="prefill") > total(
            before, "kvrouter_pd_leg_failures_total", leg="prefill"
        )
        # while it is down, it is not planned at all
        await until(lambda: not gw.pool.upstreams[victim].healthy, what="out of rotation")
        st, h, _ = await post(
            s, f"{base}/v1/completions", {"model": MODEL, "prompt": prefix, "max_tokens": 2}
        )
        assert st == 200 and h.get("x-kvrouter-prefill-instance") == other, h.get("x-kvrouter-pd-reason")
        await until(lambda: gw.pool.upstreams[victim].healthy, what="back")
        await (await s.post(f"{fleet.server(victim).url}/sim/faults", json={"slowdown": 1.0})).release()
        assert all(load.in_flight == 0 for load in gw.router.load.loads.values())


@pytest.mark.parametrize("stream", [True, False])
async def test_a_killed_decode_instance_costs_no_request(fleet: SimFleet, always: GW, stream: bool) -> None:
    rng = random.Random(5 + stream)
    gw, base = always
    async with aiohttp.ClientSession() as s:
        # both decode instances hold the request before its first byte; the one it went to dies
        for name in DECODE:
            await (await s.post(f"{fleet.server(name).url}/sim/faults", json={"latency_s": 1.0})).release()
        before = await metrics(s, base)
        body = {"model": MODEL, "prompt": words(rng, 300), "max_tokens": 4, "stream": stream}
        task = asyncio.create_task(post(s, f"{base}/v1/completions", body))

        def busy() -> str | None:
            return next((n for n in DECODE if gw.router.load.get(n).in_flight), None)  # type: ignore[arg-type]

        await until(lambda: busy() is not None, what="decode leg sent")
        victim = busy()
        assert victim is not None
        await fleet.server(victim).crash(down_s=1.0)
        st, h, data = await task
        assert st == 200, data
        assert (h["x-kvrouter-pd"], h["x-kvrouter-pd-reason"]) == ("whole", "decode_failed")
        assert h["x-kvrouter-instance"] != victim and "x-kvrouter-prefill-instance" not in h
        if stream:
            assert data[-1] == "[DONE]"
        else:
            assert data["usage"]["completion_tokens"] == 4
        after = await metrics(s, base)
        assert (
            total(after, "kvrouter_pd_fallbacks_total", reason="decode_failed")
            == total(before, "kvrouter_pd_fallbacks_total", reason="decode_failed") + 1
        )
        for name in DECODE:
            await (await s.post(f"{fleet.server(name).url}/sim/faults", json={"latency_s": 0.0})).release()
        await until(lambda: gw.pool.upstreams[victim].healthy, what="back")
        assert all(load.in_flight == 0 for load in gw.router.load.loads.values())
