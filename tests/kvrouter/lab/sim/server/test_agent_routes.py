"""One simulated instance serving the Responses API (with the real ``openai`` client), Anthropic's Messages
API, runtime LoRA adapters and the pooling / audio routes, as vLLM 0.33 answers them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from kvrouter.lab.sim.server.env import responses_store, runtime_lora
from kvrouter.lab.sim.server.server import SimServer
from tests.support.sim_server import BS, instance_config, long_text, running, shared_tokenizer
from tests.support.wait import until

MODEL = "sim-model"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def stored() -> AsyncIterator[SimServer]:
    async with running(instance_config(responses_store=True, runtime_lora=True)) as s:
        yield s


@pytest.fixture
async def client(stored: SimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=f"{stored.url}/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


def test_environment_switches_read_as_vllm_reads_them() -> None:
    assert responses_store({"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    assert not responses_store({"VLLM_ENABLE_RESPONSES_API_STORE": "0"}) and not responses_store({})
    assert runtime_lora({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " True "})
    assert not runtime_lora({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"})


async def test_chained_responses_hit_the_cache_turn_after_turn(client: openai.AsyncOpenAI) -> None:
    prev = None
    cached, prompts = [], []
    for turn in range(4):
        r = await client.responses.create(
            model=MODEL,
            input=long_text(60, seed=turn),
            instructions="You are a careful agent.",
            previous_response_id=prev,
            max_output_tokens=12,
        )
        assert r.status in ("completed", "incomplete") and r.output_text
        assert r.usage is not None and r.previous_response_id == prev
        cached.append(r.usage.input_tokens_details.cached_tokens)
        prompts.append(r.usage.input_tokens)
        prev = r.id
    assert cached[0] == 0
    for i in range(1, 4):
        # the whole previous prompt and most of its answer are served from cache
        assert prompts[i - 1] - BS <= cached[i] < prompts[i]
    got = await client.responses.retrieve(prev)
    assert got.id == prev and got.output_text


async def test_streamed_response_events(client: openai.AsyncOpenAI) -> None:
    kinds, text = [], []
    stream = await client.responses.create(model=MODEL, input="stream me", max_output_tokens=9, stream=True)
    async for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text.append(ev.delta)
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = ev.response  # the last event carries the whole response
    assert final.output_text == "".join(text) and final.usage is not None
    assert final.usage.output_tokens == 9


async def test_without_the_store_previous_response_id_is_a_404(http: aiohttp.ClientSession) -> None:
    async with running(instance_config(responses_store=False)) as s:
        async with http.post(f"{s.url}/v1/responses", json={"model": MODEL, "input": "hi"}) as r:
            first = await r.json()
        body = {"model": MODEL, "input": "again", "previous_response_id": first["id"]}
        async with http.post(f"{s.url}/v1/responses", json=body) as r:
            assert r.status == 404
            err = (await r.json())["error"]
        assert err["message"] == f"Response with id '{first['id']}' not found."
        assert err["type"] == "invalid_request_error" and err["param"] == "response_id"
        async with http.get(f"{s.url}/v1/responses/{first['id']}") as r:
            assert r.status == 404
        body = {"model": MODEL, "input": "x", "background": True}
        async with http.post(f"{s.url}/v1/responses", json=body) as r:
            assert r.status == 400 and "VLLM_ENABLE_RESPONSES_API_STORE" in (await r.text())


async def test_background_response_and_cancel(stored: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "input": "a long one", "background": True, "max_output_tokens": 200000}
    async with http.post(f"{stored.url}/v1/responses", json=body) as r:
        queued = await r.json()
    assert queued["status"] == "queued"
    async with http.post(f"{stored.url}/v1/responses/{queued['id']}/cancel") as r:
        assert r.status == 200 and (await r.json())["status"] == "cancelled"
    async with http.get(f"{stored.url}/v1/responses/{queued['id']}") as r:
        assert (await r.json())["status"] == "cancelled"
    body = {"model": MODEL, "input": "short", "background": True, "max_output_tokens": 3}
    async with http.post(f"{stored.url}/v1/responses", json=body) as r:
        rid = (await r.json())["id"]

    await until(lambda: rid not in stored.instance.background)
    async with http.get(f"{stored.url}/v1/responses/{rid}") as r:
        assert (await r.json())["status"] == "incomplete"
    async with http.post(f"{stored.url}/v1/responses/{rid}/cancel") as r:
        assert (
            r.status == 400
            and (await r.json())["error"]["message"] == "Cannot cancel a synchronous response."
        )


async def test_messages_api(stored: SimServer, http: aiohttp.ClientSession) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "system": "terse",
        "messages": [{"role": "user", "content": long_text(80)}],
    }
    async with http.post(f"{stored.url}/v1/messages", json=body) as r:
        first = await r.json()
    assert first["type"] == "message" and first["content"][0]["type"] == "text"
    assert first["usage"]["cache_read_input_tokens"] == 0
    async with http.post(f"{stored.url}/v1/messages/count_tokens", json=body) as r:
        n = (await r.json())["input_tokens"]
    assert n == first["usage"]["input_tokens"]
    events = []
    async with http.post(f"{stored.url}/v1/messages", json={**body, "stream": True}) as r:
        raw = (await r.read()).decode()
    for block in raw.strip().split("\n\n"):
        events.append(block.split("\n")[0].removeprefix("event: "))
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert '"cache_read_input_tokens":' in raw and "[DONE]" not in raw
    bad = {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    async with http.post(f"{stored.url}/v1/messages", json=bad) as r:
        assert r.status == 404
        assert await r.json() == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "The model `nope` does not exist."},
        }


async def test_runtime_lora_adapters(stored: SimServer, http: aiohttp.ClientSession) -> None:
    async def models() -> dict[str, dict[str, object]]:
        async with http.get(f"{stored.url}/v1/models") as r:
            return {m["id"]: m for m in (await r.json())["data"]}

    async with http.post(
        f"{stored.url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/a/sql"}
    ) as r:
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'sql' added successfully."
    card = (await models())["sql"]
    assert card["parent"] == MODEL and card["root"] == "/a/sql"
    async with http.post(
        f"{stored.url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/b"}
    ) as r:
        assert r.status == 400 and "already been loaded" in (await r.json())["error"]["message"]
    body = {"model": "sql", "prompt": "select", "max_tokens": 2}
    async with http.post(f"{stored.url}/v1/completions", json=body) as r:
        assert r.status == 200
    async with http.post(f"{stored.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
        assert r.status == 200
    assert "sql" not in await models()
    async with http.post(f"{stored.url}/v1/completions", json=body) as r:
        assert r.status == 404
    async with http.post(f"{stored.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"
    async with (
        running(instance_config(runtime_lora=False)) as plain,
        http.post(f"{plain.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "b"}) as r,
    ):
        assert r.status == 404 and await r.json() == {"detail": "Not Found"}


async def test_pooling_routes_cache_their_prompts(http: aiohttp.ClientSession) -> None:
    async with running(instance_config(pooling=True)) as s:
        text = long_text(120)
        async with http.post(f"{s.url}/v1/embeddings", json={"model": MODEL, "input": text}) as r:
            emb = await r.json()
        assert emb["object"] == "list" and len(emb["data"][0]["embedding"]) == 8
        tok, _ = shared_tokenizer()
        assert s.instance.ranks[0].engine.cached_prefix_blocks(tok.encode_prompt(text)) > 0
        for path, body in (
            ("/score", {"model": MODEL, "text_1": "q", "text_2": ["a", "b"]}),
            ("/v2/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b", "c"], "top_n": 2}),
            ("/classify", {"model": MODEL, "input": ["x"]}),
        ):
            async with http.post(f"{s.url}{path}", json=body) as r:
                assert r.status == 200, path
                got = await r.json()
            assert ("results" in got and len(got["results"]) == 2) or len(got["data"]) >= 1
    async with running(instance_config()) as generative:
        url = f"{generative.url}/v1/embeddings"
        async with http.post(url, json={"model": MODEL, "input": "x"}) as r:
            assert r.status == 404


async def test_transcription_reads_the_upload_as_it_arrives(http: aiohttp.ClientSession) -> None:
    async with running(instance_config(pooling=True)) as s:
        first_seen = asyncio.Event()

        async def audio() -> AsyncIterator[bytes]:
            yield b"\0" * (1 << 20)
            await until(lambda: s.instance.audio_bytes_seen > 0)
            first_seen.set()
            yield b"\1" * (1 << 20)

        form = aiohttp.FormData()
        form.add_field("model", MODEL)
        form.add_field("file", audio(), filename="a.wav", content_type="audio/wav")
        async with http.post(f"{s.url}/v1/audio/transcriptions", data=form) as r:
            assert r.status == 200
            assert (await r.json())["text"].endswith(f"({2 << 20} bytes)")
        assert first_seen.is_set()
