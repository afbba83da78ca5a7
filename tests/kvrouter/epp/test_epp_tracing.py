"""The picker's exchange with a real Envoy as one trace, received by a real OTLP/HTTP receiver: the
client's ``traceparent`` is the parent, the picker's steps are spans, and the (simulated) vLLM instance
receives the context of the picker's upstream span through the header mutation."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from kvrouter.lab.sim.server.fleet import SimFleet
from kvrouter.telemetry import parse_traceparent, traceparent
from tests.support.envoy import envoy_binary, envoy_config, picker, running_envoy
from tests.support.gateway import MODEL, sim_fleet
from tests.support.net import free_port
from tests.support.otlp import otlp_receiver
from tests.support.wait import until

pytestmark = [
    pytest.mark.skipif(envoy_binary() is None, reason="envoy not installed (make install)"),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(2) as f:
        yield f


async def test_the_pickers_exchange_is_one_trace_into_vllm(fleet: SimFleet, tmp_path: Path) -> None:
    rng = random.Random(9)
    client_trace, client_span = rng.getrandbits(128), rng.getrandbits(64)
    async with otlp_receiver() as (rx, url):
        tracing = {"tracing": {"enabled": True, "sample_rate": 0.0, "endpoint": url}}
        async with picker(fleet, **tracing) as (pk, server):
            cfg = envoy_config(free_port(), free_port(), server.port)
            async with running_envoy(cfg, tmp_path) as base, aiohttp.ClientSession() as s:
                for srv in fleet.servers:
                    srv.instance.trace_contexts.clear()
                body = {"model": MODEL, "max_tokens": 4, "prompt": "a prompt of a few words " * 20}
                h = {"traceparent": traceparent(client_trace, client_span)}
                async with s.post(base + "/v1/completions", json=body, headers=h) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                got = [tp for srv in fleet.servers for tp in srv.instance.trace_contexts]
                sink = pk.gw.telemetry.sink
                assert sink is not None
                await until(lambda: pk.metrics.open_streams._value.get() == 0, what="the stream closed")
                await asyncio.get_running_loop().run_in_executor(None, sink.force_flush)
                trace_id = f"{client_trace:032x}"
                await until(lambda: len(rx.trace(trace_id)) >= 9, 20, "the picker's spans")
    spans = {x.name: x for x in rx.trace(trace_id)}
    root = spans["kvrouter.request"]
    assert root.parent_id == f"{client_span:016x}"
    assert root.attrs["http.response.status_code"] == 200
    for name in ("kvrouter.epp.request_body", "kvrouter.parse", "kvrouter.tokenize", "kvrouter.decision"):
        assert spans[name].parent_id == root.span_id, name
    up = spans["kvrouter.upstream.whole"]
    assert spans["kvrouter.completion"].parent_id == up.span_id
    # Envoy forwarded the picker's header mutation: vLLM's parent is the picker's upstream span.
    assert len(got) == 1
    tp = parse_traceparent(got[0])
    assert tp is not None and (tp[0], f"{tp[1]:016x}") == (client_trace, up.span_id)
