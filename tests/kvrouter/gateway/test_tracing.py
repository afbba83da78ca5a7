"""Traces through the gateway, received by a real OTLP/HTTP receiver: one trace from the client's
``traceparent`` through the router's steps into the (simulated) vLLM instance, which receives the
context of the router's upstream span; exemplars on the TTFT and decision histograms; the access log."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import string
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from kvrouter.gateway import Gateway
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig, parse_roles
from kvrouter.telemetry import parse_traceparent, traceparent
from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.otlp import OtlpReceiver, Span, otlp_grpc_receiver, otlp_receiver
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

SECRET = "zebraquokka"
"""A word in every prompt: it must appear in no span (no content in any attribute)."""


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(n))


def chat(rng: random.Random, stream: bool = False) -> dict[str, object]:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "messages": [{"role": "user", "content": f"{SECRET} {words(rng, 60)}"}],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(2) as f:
        yield f


async def flushed(gw: Gateway, rx: OtlpReceiver, trace_id: str, at_least: int) -> list[Span]:
    sink = gw.telemetry.sink
    assert sink is not None
    await asyncio.get_running_loop().run_in_executor(None, sink.force_flush)
    await until(lambda: len(rx.trace(trace_id)) >= at_least, 20, f"{at_least} spans of trace {trace_id}")
    return rx.trace(trace_id)


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def received(fleet: SimFleet) -> list[str | None]:
    return [tp for srv in fleet.servers for tp in srv.instance.trace_contexts]


def forget(fleet: SimFleet) -> None:
    """Start counting what the instances receive afresh (each keeps its own list, in its own order)."""
    for srv in fleet.servers:
        srv.instance.trace_contexts.clear()


async def test_one_trace_from_the_client_through_the_router_into_vllm(fleet: SimFleet) -> None:
    rng = random.Random(3)
    async with otlp_receiver() as (rx, url):
        tracing = {"tracing": {"enabled": True, "sample_rate": 0.0, "endpoint": url}}
        async with gateway(fleet, **tracing) as (gw, base), aiohttp.ClientSession() as s:
            client_trace, client_span = rng.getrandbits(128), rng.getrandbits(64)
            headers = {"traceparent": traceparent(client_trace, client_span), "tracestate": "vendor=x1"}
            forget(fleet)
            for stream in (False, True):
                before = len(received(fleet))
                async with s.post(
                    f"{base}/v1/chat/completions", json=chat(rng, stream), headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                    instance = r.headers["x-kvrouter-instance"]
                assert len(received(fleet)) == before + 1
            trace_id = f"{client_trace:032x}"
            spans = await flushed(gw, rx, trace_id, 2 * 9)
            names = by_name(spans)
            roots = names["kvrouter.request"]
            assert len(roots) == 2
            assert all(r.parent_id == f"{client_span:016x}" for r in roots)  # the client's span is its parent
            assert all(x.raw.trace_state == "vendor=x1" for x in roots)  # the client's tracestate kept
            assert all(r.service == "kvrouter" and r.kind == 2 for r in roots)  # SERVER
            root_ids = {r.span_id for r in roots}
            for name in ("kvrouter.parse", "kvrouter.tokenize", "kvrouter.index_lookup", "kvrouter.decision"):
                assert len(names[name]) == 2 and all(x.parent_id in root_ids for x in names[name]), name
            ups = names["kvrouter.upstream.whole"]
            assert len(ups) == 2 and all(u.parent_id in root_ids and u.kind == 3 for u in ups)  # CLIENT
            up_ids = {u.span_id for u in ups}
            for name in ("kvrouter.upstream_connect", "kvrouter.first_token", "kvrouter.completion"):
                assert len(names[name]) == 2 and all(x.parent_id in up_ids for x in names[name]), name
            # Every child lies within its parent.
            ids = {x.span_id: x for x in spans}
            for x in spans:
                parent = ids.get(x.parent_id)
                if parent is not None:
                    assert parent.start_ns <= x.start_ns <= x.end_ns <= parent.end_ns, x.name

            # Attributes: the decision, the tokenizer cache, the lookup; usage counts, never the content.
            for dec in names["kvrouter.decision"]:
                up = next(u for u in ups if u.parent_id == dec.parent_id)
                assert dec.attrs["kvrouter.chosen"] == up.attrs["kvrouter.target"]
            d = names["kvrouter.decision"][-1].attrs
            assert d["kvrouter.policy"] == "kv-aware" and instance in ("sim-0", "sim-1")
            assert (
                "kvrouter.runner_up" in d and "kvrouter.runner_up.score" in d and "kvrouter.chosen.score" in d
            )
            tok = names["kvrouter.tokenize"]
            assert all(t.attrs["kvrouter.tokens"] > 60 for t in tok)
            assert {t.attrs["kvrouter.tokenizer_cache"] for t in tok} <= {"hit", "miss"}
            assert "kvrouter.matched_blocks.GPU" in names["kvrouter.index_lookup"][0].attrs
            assert all(u.attrs["gen_ai.usage.input_tokens"] > 60 for u in ups)
            assert all(r.attrs["http.response.status_code"] == 200 for r in roots)
            assert not any(SECRET.encode() in b for b in rx.bodies)

            # vLLM received the router's upstream span as its parent, in the client's trace (and tracestate).
            got = [parse_traceparent(tp) for tp in received(fleet)]
            assert all(g is not None and g[2] for g in got)
            assert {g[:2] for g in got if g} == {(client_trace, int(u.span_id, 16)) for u in ups}

            # Exemplars: the TTFT and decision histograms carry the trace id (OpenMetrics exposition).
            async with s.get(f"{base}/metrics", headers={"Accept": "application/openmetrics-text"}) as r:
                assert r.status == 200
                text = await r.text()
            sent = [
                ln for ln in text.splitlines() if ln.startswith('kvrouter_trace_spans_total{result="sent"}')
            ]
            assert sent and float(sent[0].split()[1]) >= 18
            for family in (
                "kvrouter_upstream_ttft_seconds_bucket",
                "kvrouter_routing_decision_seconds_bucket",
            ):
                assert any(
                    line.startswith(family) and f'trace_id="{trace_id}"' in line for line in text.splitlines()
                ), family


async def test_sampling_follows_the_client_and_the_rate(fleet: SimFleet) -> None:
    rng = random.Random(4)
    async with otlp_receiver() as (rx, url):
        tracing = {"tracing": {"enabled": True, "sample_rate": 1.0, "endpoint": url}}
        async with gateway(fleet, **tracing) as (gw, base), aiohttp.ClientSession() as s:
            # Not sampled by the client: not traced, and vLLM gets the client's context unchanged.
            unsampled = traceparent(rng.getrandbits(128), rng.getrandbits(64), sampled=False)
            forget(fleet)
            async with s.post(
                f"{base}/v1/chat/completions", json=chat(rng), headers={"traceparent": unsampled}
            ) as r:
                assert r.status == 200
            assert received(fleet) == [unsampled]
            # No traceparent at all, sample_rate 1: a new trace; vLLM joins it under the router's span.
            forget(fleet)
            async with s.post(f"{base}/v1/chat/completions", json=chat(rng)) as r:
                assert r.status == 200
            (only,) = received(fleet)
            tp = parse_traceparent(only)
            assert tp is not None and tp[2]
            spans = await flushed(gw, rx, f"{tp[0]:032x}", 9)
            root = by_name(spans)["kvrouter.request"][0]
            assert root.parent_id == ""
            assert by_name(spans)["kvrouter.upstream.whole"][0].span_id == f"{tp[1]:016x}"
            assert not rx.trace(unsampled.split("-")[1])


async def test_tracing_off_passes_the_context_on_and_records_nothing(fleet: SimFleet) -> None:
    rng = random.Random(5)
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:
        assert gw.telemetry.sink is None and not gw.telemetry.on
        tp = traceparent(rng.getrandbits(128), rng.getrandbits(64))
        forget(fleet)
        async with s.post(
            f"{base}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"traceparent": tp, "tracestate": "a=b"},
        ) as r:
            assert r.status == 200
        assert received(fleet) == [tp]


async def test_the_access_log_says_what_happened_and_never_the_content(
    fleet: SimFleet, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(6)
    over = {
        "access_log": {"enabled": True},
        "tenants": {"api_keys": {"sk-secret-key": {"name": "team-a", "salt": "s1"}}},
    }
    async with gateway(fleet, **over) as (_, base), aiohttp.ClientSession() as s:
        with caplog.at_level(logging.INFO, logger="kvrouter.access"):
            h = {"Authorization": "Bearer sk-secret-key"}
            async with s.post(f"{base}/v1/chat/completions", json=chat(rng, stream=True), headers=h) as r:
                assert r.status == 200
                await r.read()
                instance = r.headers["x-kvrouter-instance"]
            async with s.post(f"{base}/v1/chat/completions", json={**chat(rng), "model": "nope"}) as r:
                assert r.status == 404
        lines = [rec for rec in caplog.records if rec.name == "kvrouter.access"]
        assert len(lines) == 2
        ok, missing = (vars(x) for x in lines)
        assert ok["route"] == "/v1/chat/completions" and ok["status"] == 200 and ok["model"] == MODEL
        assert ok["tenant"] == "team-a" and ok["instance"] == instance and ok["policy"] == "kv-aware"
        assert ok["reason"] and ok["predicted_cached_tokens"] is not None
        assert ok["reported_cached_tokens"] is not None and ok["ttft_ms"] > 0 and ok["queue_wait_ms"] == 0
        assert ok["trace_id"] is None and ok["traced"] is False
        assert missing["status"] == 404 and missing["instance"] is None
        dumped = json.dumps([{k: str(v) for k, v in vars(x).items()} for x in lines])
        assert SECRET not in dumped and "sk-secret-key" not in dumped


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pd_fleet() -> AsyncIterator[SimFleet]:
    cfg = SimFleetConfig(instances=2, roles=parse_roles("1P1D"), profile="test", capacity_blocks=2048)
    async with SimFleet(cfg) as f:
        yield f


async def test_each_leg_of_a_disaggregated_request_is_a_span(pd_fleet: SimFleet) -> None:
    rng = random.Random(7)
    async with otlp_receiver() as (rx, url):
        over = {
            "tracing": {"enabled": True, "sample_rate": 1.0, "endpoint": url},
            "routing": {"disaggregation": {"mode": "always"}},
        }
        async with gateway(pd_fleet, **over) as (gw, base), aiohttp.ClientSession() as s:
            async with s.post(f"{base}/v1/chat/completions", json=chat(rng, stream=True)) as r:
                assert r.status == 200, await r.text()
                await r.read()
                assert r.headers["x-kvrouter-pd"] == "split"
            legs = [parse_traceparent(tp) for srv in pd_fleet.servers for tp in srv.instance.trace_contexts]
            legs = [x for x in legs if x is not None]
            assert len(legs) == 2 and legs[0][0] == legs[1][0]
            spans = await flushed(gw, rx, f"{legs[0][0]:032x}", 12)
            names = by_name(spans)
            pre, dec = names["kvrouter.upstream.prefill"][0], names["kvrouter.upstream.decode"][0]
            assert {pre.span_id, dec.span_id} == {f"{x[1]:016x}" for x in legs}
            assert pre.end_ns <= dec.start_ns  # the decode leg follows its prefill leg
            assert pre.parent_id == dec.parent_id == names["kvrouter.request"][0].span_id


async def test_export_over_grpc(fleet: SimFleet) -> None:
    rng = random.Random(8)
    async with otlp_grpc_receiver() as (rx, endpoint):
        tracing = {"tracing": {"enabled": True, "sample_rate": 1.0, "endpoint": endpoint, "protocol": "grpc"}}
        async with gateway(fleet, **tracing) as (gw, base), aiohttp.ClientSession() as s:
            forget(fleet)
            async with s.post(f"{base}/v1/chat/completions", json=chat(rng)) as r:
                assert r.status == 200
            (only,) = received(fleet)
            tp = parse_traceparent(only)
            assert tp is not None
            spans = await flushed(gw, rx, f"{tp[0]:032x}", 9)
            assert {x.name for x in spans} >= {
                "kvrouter.request",
                "kvrouter.decision",
                "kvrouter.upstream.whole",
            }
