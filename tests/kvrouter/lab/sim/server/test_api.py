"""One simulated instance over real HTTP: the OpenAI API as vLLM serves it (with the real ``openai`` client),
exact cached tokens, chunk-by-chunk streaming, vLLM's 400s, and the extra routes."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.lab.sim.server.server import SimServer
from tests.support.sim_server import BS, instance_config, long_text, running, shared_tokenizer, sse_events
from tests.support.tokenizers import chat_ids
from tests.support.wait import until

MODEL = "sim-model"


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    async with running(instance_config()) as s:
        yield s


@pytest.fixture
async def client(server: SimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def expected_cached(server: SimServer, tokens: list[int], rank: int = 0) -> int:
    """The engine's truth: leading cached blocks, less the last prompt token vLLM always computes."""
    engine = server.instance.ranks[rank].engine
    return min(engine.cached_prefix_blocks(tokens), (len(tokens) - 1) // BS) * BS


async def test_completion_text_usage_and_cached_tokens(server: SimServer, client: openai.AsyncOpenAI) -> None:
    tok, _vocab = shared_tokenizer()
    prompt = long_text(300)
    tokens = tok.encode_prompt(prompt).tokens
    r1 = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=7)
    assert r1.object == "text_completion" and r1.model == MODEL
    assert r1.choices[0].finish_reason == "length"
    assert r1.usage is not None and r1.usage.prompt_tokens == len(tokens)
    assert r1.usage.completion_tokens == 7 and r1.usage.total_tokens == len(tokens) + 7
    assert r1.usage.prompt_tokens_details is not None and r1.usage.prompt_tokens_details.cached_tokens == 0
    # The text is the detokenized answer: whole words that re-tokenize to 7 tokens.
    assert len(tok.encode_prompt(r1.choices[0].text).tokens) == 7
    want = expected_cached(server, tokens)
    assert want >= len(tokens) - 2 * BS  # the whole prompt stayed cached
    r2 = await client.completions.create(model=MODEL, prompt=prompt + " and a new tail", max_tokens=3)
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens == want
    # Token-id prompts pass through unchanged; the same ids hit the same blocks.
    r3 = await client.completions.create(model=MODEL, prompt=tokens, max_tokens=1)
    assert r3.usage is not None and r3.usage.prompt_tokens == len(tokens)
    assert r3.usage.prompt_tokens_details is not None
    assert r3.usage.prompt_tokens_details.cached_tokens == expected_cached(server, tokens)


async def test_same_seed_same_answer_and_eos(server: SimServer, client: openai.AsyncOpenAI) -> None:
    a = await client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, seed=5)
    b = await client.completions.create(model=MODEL, prompt="something else", max_tokens=12, seed=5)
    assert a.choices[0].text == b.choices[0].text
    # Without max_tokens, a simulated answer ends with EOS after ~answer_tokens (128..384 by default).
    c = await client.completions.create(model=MODEL, prompt="hello", seed=1)
    assert c.choices[0].finish_reason == "stop" and c.usage is not None
    assert 128 <= c.usage.completion_tokens <= 384
    d = await client.completions.create(
        model=MODEL, prompt="hello", seed=1, max_tokens=400, extra_body={"ignore_eos": True}
    )
    assert d.choices[0].finish_reason == "length" and d.usage is not None and d.usage.completion_tokens == 400


async def test_chat_nonstream_with_tools_and_kwargs(server: SimServer, client: openai.AsyncOpenAI) -> None:
    tok, _ = shared_tokenizer()
    msgs: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": long_text(200)}]
    tools: list[Any] = [
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    ]
    r = await client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        tools=tools,
        max_tokens=4,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    want = chat_ids(tok, msgs, tools, {"thinking": True})
    assert r.usage is not None and r.usage.prompt_tokens == len(want)
    assert want != chat_ids(tok, msgs, tools), "chat_template_kwargs change the prompt"
    # The next turn quotes the answer: its prefix, answer included, is cached.
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "ok"},
    ]
    tokens2 = chat_ids(tok, msgs2, tools, {"thinking": True})
    cached = expected_cached(server, tokens2)
    r2 = await client.chat.completions.create(
        model=MODEL,
        messages=msgs2,
        tools=tools,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens == cached >= len(want) - BS


async def test_chat_stream_chunks_arrive_as_the_engine_steps(
    server: SimServer, http: aiohttp.ClientSession
) -> None:
    server.instance.faults.slowdown = 40.0  # ~20-40 ms per step: chunk spacing is measurable
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = [(t, d) async for t, d in sse_events(resp)]
    assert events[-1][1] == "[DONE]"
    chunks = [msgspec.json.decode(d) for _, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 8  # one chunk per generated token
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 7 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    # First token long before the last: each arrived when its step ended.
    arrivals = [t - t0 for t, _ in events[1:9]]
    assert arrivals[-1] - arrivals[0] > 0.1
    assert all(b >= a for a, b in itertools.pairwise(arrivals))


async def test_completion_stream_with_openai_client(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    texts, finish, use = [], None, None
    async for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            use = chunk.usage
    assert len(texts) == 5 and finish == "length"
    assert use is not None and use.completion_tokens == 5 and use.prompt_tokens_details is not None


async def test_client_disconnect_aborts_in_engine(server: SimServer, http: aiohttp.ClientSession) -> None:
    server.instance.faults.slowdown = 20.0
    engine = server.instance.ranks[0].engine
    body = {"model": MODEL, "prompt": "go", "max_tokens": 500, "stream": True}
    async with http.post(f"{server.url}/v1/completions", json=body) as resp:
        n = 0
        async for _ in sse_events(resp):
            n += 1
            if n == 3:
                break
        assert engine.has_work()
        resp.close()
    await until(lambda: not engine.has_work(), what="the engine dropped the request")
    assert server.instance.stats[0].finished["abort"] == 1


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", {"model": MODEL}, "'prompt' is required"),
        ("/v1/completions", {"prompt": ""}, "prompt cannot be empty"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be at least 1"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, "'max_tokens' must be an int"),
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ("/v1/completions", {"prompt": "x", "cache_salt": 7}, "cache_salt"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream=True"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "n=1"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "vocabulary"),
        ("/v1/completions", {"prompt": "x " * 9000, "max_tokens": 10}, "maximum context length is"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, "maximum context length is"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "banana", "content": "x"}]},
            "unsupported message role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "continue_final_message",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"},
            "untrusted",
        ),
    ],
)
async def test_bad_requests_get_vllm_400s(
    server: SimServer, http: aiohttp.ClientSession, path: str, body: object, needle: str
) -> None:
    kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(f"{server.url}{path}", **kw) as r:
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert needle in err["message"]
    assert not server.instance.ranks[0].engine.has_work()


async def test_unknown_model_404_and_openai_client_error(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": ""})


async def test_cache_salt_separates_prefixes(server: SimServer, client: openai.AsyncOpenAI) -> None:
    prompt = long_text(200, seed=3)
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    r = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "b"}
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    r = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"}
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens > 0


async def test_metrics_names_labels_and_values(
    server: SimServer, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    prompt = long_text(100)
    for _ in range(2):
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    async with http.get(f"{server.url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    samples = {
        s.name: s
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if "created" not in s.name
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_success_total",
    ):
        assert name in samples, name
        assert samples[name].labels["model_name"] == MODEL and samples[name].labels["engine"] == "0"
    assert samples["vllm:generation_tokens_total"].value == 6
    assert samples["vllm:time_to_first_token_seconds_count"].value == 2
    assert samples["vllm:prefix_cache_hits_total"].value > 0


async def test_tokenize_detokenize_models_health_version(
    server: SimServer, http: aiohttp.ClientSession
) -> None:
    tok, _ = shared_tokenizer()
    text = "Tokenize me, please: 数据 🙂"
    async with http.post(f"{server.url}/tokenize", json={"prompt": text}) as r:
        got = await r.json()
    assert got["tokens"] == tok.encode_prompt(text).tokens and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == server.instance.max_model_len
    msgs = [{"role": "user", "content": text}]
    async with http.post(f"{server.url}/tokenize", json={"messages": msgs}) as r:
        assert (await r.json())["tokens"] == chat_ids(tok, msgs)
    async with http.post(f"{server.url}/detokenize", json={"tokens": tok.encode_prompt(text).tokens}) as r:
        assert (await r.json())["prompt"] == text
    async with http.get(f"{server.url}/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    card = models["data"][0]
    assert card["owned_by"] == "vllm" and card["max_model_len"] > 0 and card["root"] == MODEL
    assert card["permission"][0]["object"] == "model_permission"
    async with http.get(f"{server.url}/health") as r, http.post(f"{server.url}/ping") as p:
        assert r.status == 200 and p.status == 200
    async with http.get(f"{server.url}/version") as r:
        assert (await r.json())["version"] == "0.33.0"


async def test_reset_prefix_cache(
    server: SimServer, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    prompt = long_text(100, seed=9)
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    async with http.post(f"{server.url}/reset_prefix_cache") as r:
        assert r.status == 200 and r.headers["X-Sim-Prefix-Cache-Reset"] == "true"
    r2 = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens == 0


async def test_data_parallel_rank_header_and_balancing(http: aiohttp.ClientSession) -> None:
    async with running(instance_config(dp_size=2)) as server:
        ranks = server.instance.ranks
        body = {"model": MODEL, "prompt": long_text(80), "max_tokens": 2}
        for _ in range(3):
            async with http.post(
                f"{server.url}/v1/completions", json=body, headers={"X-data-parallel-rank": "1"}
            ) as r:
                assert r.status == 200
        assert ranks[1].engine.metrics().prompt_tokens_total > 0
        assert ranks[0].engine.metrics().prompt_tokens_total == 0
        async with http.post(
            f"{server.url}/v1/completions", json=body, headers={"X-data-parallel-rank": "2"}
        ) as r:
            assert r.status == 400 and "out of range" in (await r.json())["error"]["message"]
        # Unpinned concurrent requests spread over both ranks (vLLM's waiting*4 + running balancing).
        body["max_tokens"] = 20
        await asyncio.gather(*(_post(http, f"{server.url}/v1/completions", body) for _ in range(6)))
        assert ranks[0].engine.metrics().prompt_tokens_total > 0
        async with http.get(f"{server.url}/metrics") as r:
            text = await r.text()
        engines = {
            s.labels["engine"]
            for fam in text_string_to_metric_families(text)
            if fam.name == "vllm:num_requests_running"
            for s in fam.samples
        }
        assert engines == {"0", "1"}


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with http.post(url, json=body) as r:
        assert r.status == 200
        await r.read()


_FUZZ_VALUES: list[object] = [
    None, True, 0, -1, 3, 2**70, 1.5, "", "x", [], [1, 2, 3], [[1, 2]], ["a", "b"], {}, {"a": 1},
    [{"role": "user", "content": "hi"}], [{"role": "user"}], [{"role": 5, "content": "x"}],
    [{"role": "user", "content": None}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"type": "function", "function": {"name": "f"}}], {"include_usage": "yes"}, {"thinking": True},
]  # fmt: skip
_FUZZ_FIELDS = [
    "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "cache_salt",
    "n", "temperature", "top_p", "seed", "ignore_eos", "model", "tools", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "echo", "logprobs", "tokens", "add_special_tokens",
]  # fmt: skip


async def test_random_bodies_never_get_a_500(server: SimServer, http: aiohttp.ClientSession) -> None:
    rng = random.Random(0)  # seed 0; vary it to explore
    seen: dict[int, int] = {}
    for _ in range(300):
        path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
        body: dict[str, object] = {
            f: rng.choice(_FUZZ_VALUES) for f in rng.sample(_FUZZ_FIELDS, rng.randrange(6))
        }
        if rng.random() < 0.5:
            body["prompt"] = rng.choice(["hi", [5, 6, 7], ""])
        if rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": "hi"}]
        for key in ("max_tokens", "max_completion_tokens"):
            if not isinstance(body.get(key), int) or body[key] > 50:  # type: ignore[operator]
                body[key] = 3  # keep generation short
        raw = (
            rng.choice([b"", b"[", b"null", b'"s"', b"\xff"])
            if rng.random() < 0.05
            else msgspec.json.encode(body)
        )
        async with http.post(
            f"{server.url}{path}", data=raw, headers={"Content-Type": "application/json"}
        ) as r:
            await r.read()
            assert r.status < 500, (path, raw)
            seen[r.status] = seen.get(r.status, 0) + 1
    assert seen.get(200, 0) > 20 and seen.get(400, 0) > 100


async def test_lora_adapters_are_served_and_keyed_apart(http: aiohttp.ClientSession) -> None:
    async with running(instance_config(lora_names=["tuned"])) as server:
        async with http.get(f"{server.url}/v1/models") as r:
            cards = {m["id"]: m for m in (await r.json())["data"]}
        assert cards["tuned"]["parent"] == MODEL and cards[MODEL]["parent"] is None
        prompt = long_text(150, seed=5)
        hits = []
        for model in ("tuned", MODEL, "tuned"):
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            async with http.post(f"{server.url}/v1/completions", json=body) as r:
                hits.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert hits[0] == 0 and hits[1] == 0 and hits[2] > 0  # the adapter's blocks are not the base model's
        tok, _ = shared_tokenizer()
        engine = server.instance.ranks[0].engine
        tokens = tok.encode_prompt(prompt).tokens
        assert (
            engine.cached_prefix_blocks(tokens, lora_name="tuned") == engine.cached_prefix_blocks(tokens) > 0
        )
