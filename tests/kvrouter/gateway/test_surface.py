"""vLLM's whole serving surface through the gateway, in front of a simulated fleet of four (real HTTP, real
ZeroMQ, the real ``openai`` and ``anthropic`` clients): the Responses API with stored conversations, the
Messages API, LoRA adapters loaded and unloaded at run time, sessions, and every other route."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.sim_server import BS, long_text
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(4, responses_store=True, runtime_lora=True, pooling=True) as f:
        yield f


async def _conversation(
    client: openai.AsyncOpenAI, stream: bool, turns: int = 10, seed: int = 0
) -> list[tuple[int, int]]:
    """A ``turns``-turn agent conversation chained by previous_response_id: (input, cached) per turn."""
    prev: str | None = None
    out = []
    for turn in range(turns):
        kw: dict[str, Any] = {
            "model": MODEL,
            "input": f"step {turn}: " + long_text(40, seed=seed + turn),
            "instructions": f"Agent {seed}: you write code. Be brief.",
            "previous_response_id": prev,
            "max_output_tokens": 24,
        }
        if stream:
            final = None
            async with await client.responses.create(**kw, stream=True) as events:
                async for ev in events:
                    if ev.type in ("response.completed", "response.incomplete"):
                        final = ev.response
            assert final is not None
            r = final
        else:
            r = await client.responses.create(**kw)
        assert r.output_text and r.usage is not None, turn
        out.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
        prev = r.id
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_ten_turn_responses_conversation_is_served_from_cache(fleet: SimFleet, stream: bool) -> None:
    async with gateway(fleet) as (gw, base):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        turns = await _conversation(client, stream, seed=1000 if stream else 0)
        await client.close()
        for i in range(1, len(turns)):
            # everything the previous turn computed is cached, up to the block that holds the answer's end
            assert turns[i][1] >= turns[i - 1][0] - BS, (i, turns)
        assert turns[0][1] == 0
        assert gw.pipeline.affinity.recorded == len(turns)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_continuation_is_predicted_as_its_instance_renders_it(fleet: SimFleet, stream: bool) -> None:
    """previous_response_id: the router keeps what the instance stored for each answer it forwarded (the
    messages rendered, the output), so a continuation's cached tokens are predicted exactly; with the
    history off (``responses.history_entries: 0``) they cannot be (routed to the instance without tokens)."""
    for entries in (10_000, 0):
        async with (
            gateway(fleet, responses={"history_entries": entries}) as (gw, base),
            aiohttp.ClientSession() as s,
        ):
            prev = None
            seen: list[tuple[int, int]] = []
            for turn in range(4):
                body: dict[str, Any] = {
                    "model": MODEL,
                    "instructions": f"Agent {entries}-{stream}: you write code.",
                    "input": f"step {turn}: " + long_text(30, seed=7000 + turn + 10 * stream + entries),
                    "max_output_tokens": 12,
                    "stream": stream,
                }
                if prev is not None:
                    body["previous_response_id"] = prev
                async with s.post(f"{base}/v1/responses", json=body) as r:
                    assert r.status == 200, await r.text()
                    predicted = int(r.headers["x-kvrouter-cached-tokens"])
                    raw = await r.read()
                if stream:
                    events = [json.loads(x[6:]) for x in raw.decode().splitlines() if x.startswith("data: {")]
                    final = next(
                        e["response"]
                        for e in events
                        if e.get("type") in ("response.completed", "response.incomplete")
                    )
                else:
                    final = json.loads(raw)
                prev = final["id"]
                seen.append((predicted, final["usage"]["input_tokens_details"]["cached_tokens"]))
            assert all(reported > 0 for _, reported in seen[1:]), seen
            if entries:
                assert all(p == r for p, r in seen), seen
                assert len(gw.pipeline.history) == 4
            else:
                assert all(p == 0 for p, _ in seen[1:]), seen  # no tokens, no prediction
                assert len(gw.pipeline.history) == 0


async def test_stored_response_routes_go_to_their_holder(fleet: SimFleet) -> None:
    async with gateway(fleet) as (_gw, base), aiohttp.ClientSession() as s:
        body = {"model": MODEL, "input": "remember me", "max_output_tokens": 4}
        async with s.post(f"{base}/v1/responses", json=body) as r:
            assert r.status == 200
            first = await r.json()
            holder = r.headers["x-kvrouter-instance"]
        for _ in range(4):  # whatever the cache or load says, the stored id is read where it lives
            async with s.get(f"{base}/v1/responses/{first['id']}") as r:
                assert r.status == 200 and r.headers["x-kvrouter-instance"] == holder
                assert (await r.json())["id"] == first["id"]
        # background: answered at once, cancelled where it runs
        body = {"model": MODEL, "input": "long", "background": True, "max_output_tokens": 100000}
        async with s.post(f"{base}/v1/responses", json=body) as r:
            assert r.status == 200
            queued = await r.json()
            where = r.headers["x-kvrouter-instance"]
        async with s.post(f"{base}/v1/responses/{queued['id']}/cancel") as r:
            assert r.status == 200 and r.headers["x-kvrouter-instance"] == where
            assert (await r.json())["status"] == "cancelled"
        # unknown everywhere: vLLM's own 404, after asking the fleet
        async with s.get(f"{base}/v1/responses/resp_nope") as r:
            assert r.status == 404
            err = (await r.json())["error"]
            assert (
                err["message"] == "Response with id 'resp_nope' not found." and err["param"] == "response_id"
            )


async def test_a_response_made_elsewhere_is_found_on_the_fleet(fleet: SimFleet) -> None:
    """An id this router never saw (made straight on an instance, or before it started) is looked for."""
    direct = fleet.servers[2]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{direct.url}/v1/responses", json={"model": MODEL, "input": long_text(50)}) as r:
            rid = (await r.json())["id"]
        async with gateway(fleet) as (gw, base):
            body = {"model": MODEL, "input": "and then?", "previous_response_id": rid, "max_output_tokens": 4}
            async with s.post(f"{base}/v1/responses", json=body) as r:
                assert r.status == 200 and r.headers["x-kvrouter-instance"] == direct.name
                assert (await r.json())["usage"]["input_tokens_details"]["cached_tokens"] > 0
            assert gw.pipeline.affinity.lookup(rid, now=0.0) is not None


async def test_holder_out_of_rotation_or_gone_is_a_clear_error(fleet: SimFleet) -> None:
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:
        async with s.post(
            f"{base}/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 2}
        ) as r:
            assert r.status == 200
            rid = (await r.json())["id"]
            holder = r.headers["x-kvrouter-instance"]
        body = {"model": MODEL, "input": "y", "previous_response_id": rid}
        gw.pool.upstreams[holder].healthy = False
        async with s.post(f"{base}/v1/responses", json=body) as r:
            assert r.status == 503 and "Retry-After" in r.headers
            assert holder in (await r.json())["error"]["message"]
        gw.pool.upstreams[holder].healthy = True
        gone = gw.pool.remove(holder)
        assert gone is not None
        async with s.post(f"{base}/v1/responses", json=body) as r:
            assert r.status == 404
            assert "left the fleet" in (await r.json())["error"]["message"]


async def test_messages_api_is_routed_on_its_tokens(fleet: SimFleet) -> None:
    system = long_text(400, seed=7)
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:
        where, cached = [], []
        for i in range(4):
            body = {
                "model": MODEL,
                "max_tokens": 4,
                "system": system,
                "messages": [{"role": "user", "content": f"question {i}"}],
                "stream": i % 2 == 1,
            }
            async with s.post(f"{base}/v1/messages", json=body) as r:
                assert r.status == 200
                where.append(r.headers["x-kvrouter-instance"])
                raw = await r.read()
            if i == 0:  # its blocks reach the index before the next one is routed
                await until(lambda: any(gw.indexer.index.blocks(src)[0] > 0 for src in gw.indexer.sources()))
            cached.append(b'"cache_read_input_tokens":0' not in raw)
        assert len(set(where)) == 1 and all(cached[1:])
        count = {"model": MODEL, "system": system, "messages": [{"role": "user", "content": "q"}]}
        async with s.post(f"{base}/v1/messages/count_tokens", json=count) as r:
            assert r.status == 200 and (await r.json())["input_tokens"] > 400
        async with s.post(f"{base}/v1/messages", json={**count, "model": "nope", "max_tokens": 3}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "not_found_error"
        assert gw.metrics.pipeline.prompt_tokens._value.get() > 0  # they were tokenized


async def test_anthropic_client(fleet: SimFleet) -> None:
    anthropic = pytest.importorskip("anthropic")
    async with gateway(fleet) as (_, base):
        client = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
        msg = await client.messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello there"}]
        )
        assert msg.type == "message" and msg.content[0].type == "text" and msg.usage.output_tokens == 5
        async with client.messages.stream(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello again"}]
        ) as stream:
            text = await stream.get_final_text()
        assert text
        await client.close()


async def test_adapters_land_only_where_loaded(fleet: SimFleet) -> None:
    names = [srv.name for srv in fleet.servers]
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:

        async def where(n: int = 6) -> set[str]:
            seen = set()
            for i in range(n):
                body = {"model": "sql", "prompt": f"select {i} " + long_text(20, seed=i), "max_tokens": 2}
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    seen.add(r.headers["x-kvrouter-instance"])
            return seen

        load = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        async with s.post(f"{base}/v1/completions", json={"model": "sql", "prompt": "x"}) as r:
            assert r.status == 404  # no instance has it yet
        hdr = {"x-kvrouter-instances": names[1]}
        async with s.post(f"{base}/v1/load_lora_adapter", json=load, headers=hdr) as r:
            assert r.status == 200 and "added successfully" in await r.text()
        assert await where() == {names[1]}
        hdr = {"x-kvrouter-instances": f"{names[2]},{names[3]}"}
        async with s.post(f"{base}/v1/load_lora_adapter", json=load, headers=hdr) as r:
            assert r.status == 200
        assert await where(12) <= {names[1], names[2], names[3]}
        hdr = {"x-kvrouter-instances": names[1]}
        async with s.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=hdr) as r:
            assert r.status == 200
        assert names[1] not in await where(8)
        # unloaded behind the gateway's back: learned from /v1/models, or from the 404 of the first try
        async with s.post(f"{fleet.servers[2].url}/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
            assert r.status == 200
        assert await where(6) == {names[3]}
        await until(lambda: "sql" not in gw.pool.upstreams[names[2]].adapters)
        async with s.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
            assert r.status == 200
        async with s.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
            assert r.status == 404  # vLLM's answer: nobody has it


async def test_adapter_loaded_on_demand(fleet: SimFleet) -> None:
    lora = {"load_on_demand": True, "adapters": {"summarize": {"path": "/adapters/sum", "base": MODEL}}}
    async with gateway(fleet, lora=lora) as (gw, base), aiohttp.ClientSession() as s:
        bodies = [{"model": "summarize", "prompt": f"text {i}", "max_tokens": 2} for i in range(5)]
        answers = await asyncio.gather(*(s.post(f"{base}/v1/completions", json=b) for b in bodies))
        hosts = set()
        for r in answers:
            assert r.status == 200
            hosts.add(r.headers["x-kvrouter-instance"])
            r.release()
        assert len(hosts) == 1 and gw.adapters.loaded_on_demand == 1  # one load for the burst
        assert gw.pool.holders("summarize") == list(hosts)
        async with s.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "summarize"}) as r:
            assert r.status == 200


async def test_session_header_keeps_a_session_on_its_instance(fleet: SimFleet) -> None:
    async with gateway(fleet, routing={"policy": "session"}) as (_, base), aiohttp.ClientSession() as s:
        homes: dict[str, Counter[str]] = {}
        for i in range(12):
            sid = f"s{i % 3}"
            body = {"model": MODEL, "prompt": long_text(30, seed=100 + i), "max_tokens": 2}
            async with s.post(f"{base}/v1/completions", json=body, headers={"x-session-id": sid}) as r:
                assert r.status == 200
                homes.setdefault(sid, Counter())[r.headers["x-kvrouter-instance"]] += 1
                if i >= 3:
                    assert r.headers["x-kvrouter-reason"] == "session"
        assert all(len(c) == 1 for c in homes.values())


async def test_every_other_route_is_passed_through(fleet: SimFleet) -> None:
    async with gateway(fleet) as (_gw, base), aiohttp.ClientSession() as s:
        async with s.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "hello world"}) as r:
            assert r.status == 200 and (await r.json())["count"] > 0
            ids = (await r.json())["tokens"]
        async with s.post(f"{base}/detokenize", json={"model": MODEL, "tokens": ids}) as r:
            assert r.status == 200 and "hello world" in (await r.json())["prompt"]
        async with s.get(f"{base}/version") as r:
            assert r.status == 200 and (await r.json())["version"]
        text = long_text(200, seed=3)
        where = set()
        for _ in range(3):
            async with s.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": text}) as r:
                assert r.status == 200
                where.add(r.headers["x-kvrouter-instance"])
            await asyncio.sleep(0.3)
        assert len(where) == 1  # a long text input is routed where it is cached
        for path, body in (
            ("/score", {"model": MODEL, "text_1": "q", "text_2": ["a"]}),
            ("/v1/score", {"model": MODEL, "text_1": "q", "text_2": ["a"]}),
            ("/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]}),
            ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"]}),
            ("/v2/rerank", {"model": MODEL, "query": "q", "documents": ["a"]}),
            ("/pooling", {"model": MODEL, "input": "p"}),
            ("/classify", {"model": MODEL, "input": "c"}),
        ):
            async with s.post(f"{base}{path}", json=body) as r:
                assert r.status == 200, path
                assert r.headers["x-kvrouter-instance"] in {srv.name for srv in fleet.servers}
        async with s.get(f"{base}/not-a-vllm-route") as r:
            assert r.status == 404 and "x-kvrouter-instance" in r.headers  # vLLM's own answer
        async with s.post(f"{base}/v1/embeddings", json={"model": "nope", "input": "x"}) as r:
            assert r.status == 404 and "x-kvrouter-instance" not in r.headers


async def test_audio_uploads_are_streamed_through(fleet: SimFleet) -> None:
    async with gateway(fleet) as (_, base), aiohttp.ClientSession() as s:
        seen_early = asyncio.Event()

        async def audio() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield b"\0" * (256 << 10)
            # the gateway routed on the model field and sent the first megabyte on before the rest exists
            await until(lambda: any(srv.instance.audio_bytes_seen > 0 for srv in fleet.servers))
            seen_early.set()
            for _ in range(4):
                yield b"\1" * (256 << 10)

        form = aiohttp.FormData()
        form.add_field("model", MODEL)
        form.add_field("file", audio(), filename="a.wav", content_type="audio/wav")
        async with s.post(f"{base}/v1/audio/transcriptions", data=form) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["text"].endswith(f"({2 << 20} bytes)")
        assert seen_early.is_set()


async def test_adapter_blocks_are_keyed_by_its_name(fleet: SimFleet) -> None:
    """The adapter's name is in the block hashes, as in vLLM's: its cached prefix counts for requests of
    that adapter only, never for the base model's same prompt."""
    names = [srv.name for srv in fleet.servers]
    prompt = "Adapter-keyed blocks. " + long_text(300, seed=77)  # nobody else's prefix
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:
        hdr = {"x-kvrouter-instances": ",".join(names[:2])}
        load = {"lora_name": "legal", "lora_path": "/adapters/legal"}
        async with s.post(f"{base}/v1/load_lora_adapter", json=load, headers=hdr) as r:
            assert r.status == 200
        body = {"model": "legal", "prompt": prompt, "max_tokens": 2}
        async with s.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200
            first = r.headers["x-kvrouter-instance"]
        await until(lambda: any(gw.indexer.index.blocks(src)[0] > 0 for src in gw.indexer.sources()))
        async with s.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["x-kvrouter-instance"] == first
            assert int(r.headers["x-kvrouter-cached-tokens"]) >= 300
            assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300
        async with s.post(f"{base}/v1/completions", json={**body, "model": MODEL}) as r:
            assert r.status == 200 and r.headers["x-kvrouter-cached-tokens"] == "0"
            assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with s.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "legal"}) as r:
            assert r.status == 200
