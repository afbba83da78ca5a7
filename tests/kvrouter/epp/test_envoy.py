"""kvrouter as the Endpoint Picker of a real Envoy (``deploy/envoy/envoy.yaml``, ports changed) in front of
a simulated vLLM fleet: every request reaches the instance the picker chose (chat, completions, streamed),
the decision is in kvrouter's metrics, the same workload gets the same decisions and hit rates as through
``kvrouter serve``, and failures behave as the protocol says."""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.epp import Picker, PickerServer
from kvrouter.lab.sim.server.fleet import SimFleet
from kvrouter.telemetry import parse_traceparent, traceparent
from tests.support.envoy import envoy_binary, envoy_config, picker, running_envoy, served_counts
from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.net import free_port
from tests.support.wait import until

pytestmark = [
    pytest.mark.skipif(envoy_binary() is None, reason="envoy not installed (make install)"),
    pytest.mark.asyncio(loop_scope="module"),
]


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(n))


def metric(pk: Picker, name: str, **labels: str) -> float:
    text = generate_latest(pk.gw.metrics.registry).decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def call(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    async with s.post(url, json=body) as r:
        raw = await r.read()
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            return r.status, {k.lower(): v for k, v in r.headers.items()}, events
        try:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(raw)
        except ValueError:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, raw.decode(errors="replace")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(3) as f:
        yield f


async def envoy_for(server: PickerServer, tmp_path: Path, **kw: Any) -> Any:
    cfg = envoy_config(free_port(), free_port(), server.port, **kw)
    return running_envoy(cfg, tmp_path)


async def test_requests_reach_the_instance_the_picker_chose(fleet: SimFleet, tmp_path: Path) -> None:
    rng = random.Random(3)
    system = words(rng, 500)
    async with (
        picker(fleet) as (pk, server),
        await envoy_for(server, tmp_path) as base,
        aiohttp.ClientSession() as s,
    ):
        chat = {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "first"}],
        }
        bodies: list[tuple[str, dict[str, Any]]] = [
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"model": MODEL, "max_tokens": 4, "prompt": words(rng, 300)}),
            (
                "/v1/chat/completions",
                {**chat, "stream": True, "stream_options": {"include_usage": True}},
            ),
        ]
        for path, body in bodies:
            before = served_counts(fleet)
            st, h, data = await call(s, base + path, body)
            assert st == 200, data
            after = served_counts(fleet)
            went = [n for n in after if after[n] != before[n]]
            assert went == [h["x-kvrouter-instance"]], (went, h)
            assert "x-gateway-destination-endpoint-served" not in h  # internal to gateway and picker
            if body.get("stream"):
                assert data[-1] == "[DONE]" and '"usage"' in data[-2]
        # the cached prefix brings the chat back to the same instance, predicted exactly
        first = h["x-kvrouter-instance"]
        chat["messages"][1]["content"] = "second question"  # type: ignore[index]
        await until(lambda: any(pk.gw.indexer.index.blocks(src)[0] > 0 for src in pk.gw.indexer.sources()))
        st, h, data = await call(s, base + "/v1/chat/completions", chat)
        assert st == 200 and h["x-kvrouter-instance"] == first and h["x-kvrouter-reason"] == "cache"
        real = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(h["x-kvrouter-cached-tokens"]) == real > 400
        # and the decisions are in kvrouter's metrics, predicted against reported
        assert metric(pk, "kvrouter_decisions_total", policy="kv-aware") == 4
        assert metric(pk, "kvrouter_decisions_total", reason="cache") >= 1
        assert metric(pk, "kvrouter_epp_picks_total") == 4
        assert metric(pk, "kvrouter_reported_cached_tokens_total", target=first) >= real
        await until(lambda: pk.metrics.open_streams._value.get() == 0)
        # every load released (our own accounting: the engine's scraped running count may lag a scrape behind)
        assert pk.gw.router.load.loads[first].in_flight == 0


async def test_a_body_larger_than_one_body_message(fleet: SimFleet, tmp_path: Path) -> None:
    big = "the cat sat on the mat " * 4000  # 92 KB, 24,000 tokens: two body pieces each way
    async with (
        picker(fleet) as (pk, server),
        await envoy_for(server, tmp_path) as base,
        aiohttp.ClientSession() as s,
    ):
        st, _, data = await call(
            s, base + "/v1/completions", {"model": MODEL, "max_tokens": 2, "prompt": big}
        )
        assert st == 200, data
        assert data["usage"]["prompt_tokens"] >= 24000
        assert metric(pk, "kvrouter_prompt_tokens_total") == data["usage"]["prompt_tokens"]


async def test_same_decisions_and_hit_rate_as_kvrouter_serve(tmp_path: Path) -> None:
    rng = random.Random(11)
    systems = [words(rng, 300) for _ in range(3)]
    workload = [
        {
            "model": MODEL,
            "max_tokens": 3,
            "messages": [
                {"role": "system", "content": systems[i % 3]},
                {"role": "user", "content": f"question {i} " + words(rng, 5)},
            ],
        }
        for i in range(12)
    ]

    async def run(send: Any) -> tuple[list[str], int, int]:
        picks, cached, prompt = [], 0, 0
        async with aiohttp.ClientSession() as s:
            for body in workload:
                st, h, data = await call(s, await send(), body)
                assert st == 200, data
                picks.append(h["x-kvrouter-instance"])
                cached += data["usage"]["prompt_tokens_details"]["cached_tokens"]
                prompt += data["usage"]["prompt_tokens"]
                await asyncio.sleep(0.05)  # the instance's events reach the index before the next
        return picks, cached, prompt

    async with sim_fleet(3) as f1, gateway(f1) as (_gw, base):
        served = await run(lambda: _const(base + "/v1/chat/completions"))
    async with (
        sim_fleet(3) as f2,
        picker(f2) as (_pk, server),
        await envoy_for(server, tmp_path) as base,
    ):
        picked = await run(lambda: _const(base + "/v1/chat/completions"))
    assert picked == served
    assert served[1] > 0.5 * served[2]  # the shared prefixes were hit


async def _const(v: str) -> str:
    return v


async def test_picker_down_fail_closed_and_fail_open(fleet: SimFleet, tmp_path: Path) -> None:
    body = {"model": MODEL, "max_tokens": 2, "prompt": "hello there"}

    async def get_models(s: aiohttp.ClientSession, base: str) -> tuple[int, dict[str, str]]:
        async with s.get(base + "/v1/models") as r:
            await r.read()
            return r.status, {k.lower(): v for k, v in r.headers.items()}

    async with picker(fleet) as (_, server), aiohttp.ClientSession() as s:
        await server.stop()  # the picker is down; its components keep running
        async with await envoy_for(server, tmp_path / "closed") as base:
            before = served_counts(fleet)
            st, _, _ = await call(s, base + "/v1/completions", body)
            assert st == 500 and served_counts(fleet) == before  # fail closed: nothing reaches the fleet
            assert (await get_models(s, base))[0] == 500
        async with await envoy_for(server, tmp_path / "open", fail_open=True, fleet_urls=fleet.urls) as base:
            # fail open: a request whose headers ended it goes to Envoy's own balancing over the pool
            st, h = await get_models(s, base)
            assert st == 200 and "x-kvrouter-instance" not in h
            # but a body already streamed to the picker (FULL_DUPLEX_STREAMED) is gone from Envoy: Envoy
            # 1.40 answers 500 even with failure_mode_allow (its ext_proc: "Sending local reply 500")
            st, _, _ = await call(s, base + "/v1/completions", body)
            assert st == 500 and served_counts(fleet) == before


async def test_instance_killed_leaves_rotation(tmp_path: Path) -> None:
    body = {"model": MODEL, "max_tokens": 2, "prompt": "the same words every time " * 20}
    async with (
        sim_fleet(3) as fleet,
        picker(fleet) as (pk, server),
        await envoy_for(server, tmp_path) as base,
        aiohttp.ClientSession() as s,
    ):
        st, h, _ = await call(s, base + "/v1/completions", body)
        assert st == 200
        victim = h["x-kvrouter-instance"]
        await fleet.server(victim).stop()
        # Envoy answers 503 for the refused connection (one endpoint named: ORIGINAL_DST has no other to
        # try); the picker reads that answer on the response path and counts the failure, so the victim
        # is out after at most failure_threshold of them (or the next health check, if sooner)
        # A request may also go elsewhere first (the victim's event stream dropped, so its cache no longer
        # counts): those are answered by a live instance.
        statuses = []
        deadline = time.monotonic() + 30
        while pk.pool.upstreams[victim].healthy:
            assert time.monotonic() < deadline, statuses
            st, h, _ = await call(s, base + "/v1/completions", body)
            statuses.append(st)
            assert st == 503 or (st == 200 and h.get("x-kvrouter-instance") != victim), (st, h)
            assert statuses.count(503) <= pk.cfg.gateway.failure_threshold, statuses
        for _ in range(3):
            st, h, _ = await call(s, base + "/v1/completions", body)
            assert st == 200 and h["x-kvrouter-instance"] != victim
        assert pk.gw.router.load.loads[victim].in_flight == 0  # the failed ones released (our accounting)


async def test_over_limits_is_429_with_retry_after(fleet: SimFleet, tmp_path: Path) -> None:
    limits = {"limits": {"concurrency_threshold": 1, "max_in_flight": 1, "queue_size": 0}}
    slow = {"model": MODEL, "max_tokens": 400, "prompt": "a long answer please", "stream": True}
    async with (
        picker(fleet, **limits) as (pk, server),
        await envoy_for(server, tmp_path) as base,
        aiohttp.ClientSession() as s,
    ):
        held = [asyncio.create_task(call(s, base + "/v1/completions", slow)) for _ in range(3)]
        await until(lambda: sum(c.effective_in_flight() for c in pk.gw.router.load.loads.values()) >= 3)
        st, h, data = await call(
            s, base + "/v1/completions", {"model": MODEL, "max_tokens": 1, "prompt": "x"}
        )
        assert st == 429, data
        assert h.get("retry-after") and data["error"]["code"] == 429
        assert metric(pk, "kvrouter_epp_immediate_responses_total", status="429") == 1
        results = await asyncio.gather(*held)
        assert [r[0] for r in results] == [200, 200, 200]


async def test_the_inference_objective_orders_the_queue(tmp_path: Path) -> None:
    """One instance taking one request at a time, its engine stalled under the first (``batch``): three more
    ``batch`` requests and one of an unknown objective wait in the picker, then a ``premium`` one arrives.
    When the engine steps again the premium request is the next to reach the instance.  The order is
    read from the instance (each request's own ``traceparent``, in arrival order), not from timings."""
    limits = {"max_in_flight": 1, "queue_size": 16, "queue_timeout_s": 300.0, "early_refusal": False}
    flows = {"objectives": {"batch": 0, "premium": 1}}
    body = {"model": MODEL, "max_tokens": 4, "prompt": "a short question " * 8}
    async with (
        sim_fleet(1) as fleet,
        picker(fleet, limits=limits, flows=flows) as (pk, server),
        await envoy_for(server, tmp_path) as base,
        aiohttp.ClientSession() as s,
    ):
        inst = fleet.servers[0]

        async def send(name: str, objective: str) -> tuple[str, int]:
            h = {
                "x-gateway-inference-objective": objective,
                "traceparent": traceparent(names.index(name) + 1, 1),
            }
            async with s.post(base + "/v1/completions", json=body, headers=h) as r:
                await r.read()
                return name, r.status

        async def stall(seconds: float) -> None:
            async with s.post(inst.url + "/sim/faults", json={"stall_s": seconds}) as r:
                assert r.status == 200, await r.text()

        def waiting() -> float:
            return metric(pk, "kvrouter_flow_queue_depth")

        names = ["running", "batch-1", "batch-2", "batch-3", "unknown", "premium"]
        await stall(600)  # resumed below, once every request is where the test wants it
        tasks = [asyncio.create_task(send("running", "batch"))]
        await until(lambda: len(inst.instance.trace_contexts) == 1, 120, "the first request at the instance")
        for i, (name, objective) in enumerate(
            [("batch-1", "batch"), ("batch-2", "batch"), ("batch-3", "batch"), ("unknown", "nope")]
        ):
            tasks.append(asyncio.create_task(send(name, objective)))
            await until(lambda i=i: waiting() == i + 1, 120, f"{name} waiting")
        assert metric(pk, "kvrouter_flow_header_warnings_total", header="objective", reason="unknown") == 1
        tasks.append(asyncio.create_task(send("premium", "premium")))
        await until(lambda: waiting() == 5, 120, "premium waiting")
        await stall(0)
        done = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        assert [st for _, st in done] == [200] * len(names), done
        ids = [parse_traceparent(tp) for tp in inst.instance.trace_contexts]
        arrived = [names[t[0] - 1] if t else "?" for t in ids]
        # premium overtook every request that waited before it; the others kept their arrival order (one
        # flow: the unknown objective is the default priority, the batch's)
        assert arrived == ["running", "premium", "batch-1", "batch-2", "batch-3", "unknown"], arrived
        assert metric(pk, "kvrouter_flow_admitted_total", priority="1") == 1
        assert metric(pk, "kvrouter_flow_admitted_total", priority="0") == 5
