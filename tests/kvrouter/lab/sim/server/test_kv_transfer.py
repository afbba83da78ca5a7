"""The simulated vLLM in a disaggregated fleet, over real HTTP and ZeroMQ: a prefill leg answers vLLM 0.33's
``kv_transfer_params`` and holds its blocks under a lease; a decode leg pulls them through the prefill
instance's side channel, announces the received blocks, and reports the prefill instance's cached tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from indexer import Indexer, SourceKey
from indexer.subscriber import EventSubscriber
from kvrouter.api.kv_transfer import PrefillAnswerParams, decode_leg_body, prefill_leg_body
from kvrouter.lab.sim.errors import SimConfigError
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig, parse_roles
from kvrouter.lab.sim.server.kv_transfer import KvTransferConfig
from tests.support.sim_server import BS, long_text, shared_tokenizer
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    tok, _ = shared_tokenizer()
    cfg = SimFleetConfig(
        instances=2,
        roles=parse_roles("1P1D"),
        profile="test",
        capacity_blocks=512,
        kv_transfer=KvTransferConfig(lease_s=1.0),
    )
    async with SimFleet(cfg, tokenizer=tok) as f:
        yield f


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
    async with s.post(url, json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status == 200, await r.text()
        data: dict[str, Any] = await r.json()
        return data


async def state(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/sim/state") as r:
        data: dict[str, Any] = await r.json()
        return data


async def test_roles_spec() -> None:
    assert parse_roles("2P2D") == ["prefill", "prefill", "decode", "decode"]
    assert parse_roles("1p3d1B") == ["prefill", "decode", "decode", "decode", "both"]
    for bad in ("", "P2", "2X", "two"):
        with pytest.raises(SimConfigError):
            parse_roles(bad)


async def test_fleet_file_names_the_roles(fleet: SimFleet) -> None:
    inst = fleet.fleet_dict()["instances"]
    assert [(i["name"], i.get("role")) for i in inst] == [
        ("sim-prefill-0", "prefill"),
        ("sim-decode-0", "decode"),
    ]


async def test_both_legs_as_vllm_answers_them(fleet: SimFleet) -> None:
    p_url, d_url = fleet.urls
    prompt = long_text(300, seed=1)
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 6, "stream": False}
    ix = Indexer(BS)
    sub = EventSubscriber(ix, fleet.fleet_config())
    await sub.start()
    try:
        srcs = [SourceKey(s.name, 0) for s in fleet.servers]
        await until(lambda: all(sub.status[s].connected for s in srcs), what="subscribed")
        async with aiohttp.ClientSession() as s:
            # warm the prefill instance with the first half of the prompt: the prefill leg hits it
            warm = {"model": "sim-model", "prompt": prompt[: len(prompt) // 2], "max_tokens": 1}
            await post(s, f"{p_url}/v1/completions", warm, "warm")
            pre = await post(s, f"{p_url}/v1/completions", prefill_leg_body(body, "completions"), "req-1")
            assert pre["id"] == "cmpl-req-1"  # X-Request-Id is the base of vLLM's request id
            assert pre["usage"]["completion_tokens"] == 1
            params = pre["kv_transfer_params"]
            assert list(params) == list(PrefillAnswerParams.__struct_fields__)  # 0.33's fields, its order
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert params["remote_num_tokens"] == pre["usage"]["prompt_tokens"]
            p_cached = pre["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert p_cached > 0 and params["remote_prefill_cached_tokens"] == p_cached
            assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // BS)
            assert (await state(s, p_url))["ranks"][0]["kv_held"] == 1

            dec = await post(s, f"{d_url}/v1/completions", decode_leg_body(body, params), "req-1")
            assert dec["usage"]["completion_tokens"] == 6 and dec["kv_transfer_params"] is None
            # one request's usage: the prefill instance's cache hit, not the decode instance's transfer
            assert dec["usage"]["prompt_tokens_details"]["cached_tokens"] == p_cached
            ps, ds = await state(s, p_url), await state(s, d_url)
            assert ps["ranks"][0]["kv_held"] == 0 and ps["kv_transfer"]["read"] == 1
            assert ds["kv_transfer"]["pulled"] == 1
            # the decode instance computed one token of the prompt, and announced what it received
            d_engine = fleet.servers[1].instance.ranks[0].engine
            tokens = await fleet.tokenizer.aencode_prompt(prompt)
            assert d_engine.cached_prefix_blocks(tokens) == len(tokens) // BS
            await until(
                lambda: (
                    ix.lookup(tokens).instances
                    and {m.instance: m.matched_blocks for m in ix.lookup(tokens).instances}.get(
                        "sim-decode-0"
                    )
                    == len(tokens) // BS
                ),
                what="the decode instance's received blocks in the index",
            )
    finally:
        await sub.stop()


async def test_unread_blocks_expire_with_their_lease(fleet: SimFleet) -> None:
    p_url = fleet.urls[0]
    body = {"model": "sim-model", "prompt": long_text(100, seed=2), "max_tokens": 3}
    async with aiohttp.ClientSession() as s:
        await post(s, f"{p_url}/v1/completions", prefill_leg_body(body, "completions"), "lonely")
        assert (await state(s, p_url))["ranks"][0]["kv_held"] == 1
        before = (await state(s, p_url))["kv_transfer"]["expired"]
        deadline = time.monotonic() + 60
        while (st := await state(s, p_url))["kv_transfer"]["expired"] == before:
            assert time.monotonic() < deadline, "the lease never expired"
            await asyncio.sleep(0.05)
        assert st["ranks"][0]["kv_held"] == 0 and st["kv_transfer"]["expired"] == before + 1


async def test_a_decode_leg_whose_prefill_instance_died_computes_the_prompt(fleet: SimFleet) -> None:
    p_url, d_url = fleet.urls
    body = {"model": "sim-model", "prompt": long_text(200, seed=3), "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        pre = await post(s, f"{p_url}/v1/completions", prefill_leg_body(body, "completions"), "orphan")
        await fleet.servers[0].crash(down_s=0.0)  # back at once, but with a new engine: the blocks are gone
        before = (await state(s, d_url))["kv_transfer"]["pull_failed"]
        dec = await post(
            s, f"{d_url}/v1/completions", decode_leg_body(body, pre["kv_transfer_params"]), "orphan"
        )
        assert dec["usage"]["completion_tokens"] == 4
        assert (await state(s, d_url))["kv_transfer"]["pull_failed"] == before + 1


async def test_a_streamed_decode_leg_and_a_chat(fleet: SimFleet) -> None:
    p_url, d_url = fleet.urls
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": long_text(150, seed=4)}],
        "max_completion_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 2,
    }
    leg = prefill_leg_body(body, "chat")
    assert leg["stream"] is False and leg["max_tokens"] == leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg and body["stream"] is True
    async with aiohttp.ClientSession() as s:
        pre = await post(s, f"{p_url}/v1/chat/completions", leg, "chat-1")
        assert pre["object"] == "chat.completion" and pre["kv_transfer_params"]["do_remote_prefill"]
        chunks = []
        headers = {"X-Request-Id": "chat-1"}
        dbody = decode_leg_body(body, pre["kv_transfer_params"])
        async with s.post(f"{d_url}/v1/chat/completions", json=dbody, headers=headers) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: "):
                    chunks.append(line[6:].strip())
        assert chunks[-1] == b"[DONE]" and b'"usage"' in chunks[-2]


async def test_without_a_connector_the_params_are_ignored() -> None:
    tok, _ = shared_tokenizer()
    cfg = SimFleetConfig(instances=1, profile="test", kv_transfer=KvTransferConfig(enabled=False))
    async with SimFleet(cfg, tokenizer=tok) as f, aiohttp.ClientSession() as s:
        body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 3}
        pre = await post(s, f"{f.urls[0]}/v1/completions", prefill_leg_body(body, "completions"), "x")
        assert pre["kv_transfer_params"] is None
        assert (await state(s, f.urls[0]))["ranks"][0]["kv_held"] == 0


async def test_legs_pinned_to_data_parallel_ranks() -> None:
    tok, _ = shared_tokenizer()
    cfg = SimFleetConfig(
        instances=2, roles=parse_roles("1P1D"), dp_size=2, profile="test", capacity_blocks=256
    )
    async with SimFleet(cfg, tokenizer=tok) as f, aiohttp.ClientSession() as s:
        p_url, d_url = f.urls
        body = {"model": "sim-model", "prompt": long_text(120, seed=9), "max_tokens": 2}
        leg = prefill_leg_body(body, "completions")
        async with s.post(f"{p_url}/v1/completions", json=leg, headers={"X-data-parallel-rank": "1"}) as r:
            params = (await r.json())["kv_transfer_params"]
        assert params["remote_engine_id"].startswith("sim-prefill-0-dp1-")
        headers = {"X-data-parallel-rank": "0"}
        async with s.post(
            f"{d_url}/v1/completions", json=decode_leg_body(body, params), headers=headers
        ) as r:
            assert r.status == 200
        p_ranks = (await state(s, p_url))["ranks"]
        d_ranks = (await state(s, d_url))["ranks"]
        assert [r["kv_held"] for r in p_ranks] == [0, 0]
        assert (await state(s, p_url))["kv_transfer"]["read"] == 1
        assert (
            d_ranks[0]["engine"]["gpu_cached_blocks"] > 0 and d_ranks[1]["engine"]["gpu_cached_blocks"] == 0
        )
