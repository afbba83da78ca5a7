"""A live simulated instance waits out vLLM's API server like the evaluator: the request reaches the engine
after its front-end path (counted from arrival), and each streamed output after its way back."""

from __future__ import annotations

import time

import aiohttp

from kvrouter.lab.sim.engine import VLLM_033_FRONTEND, EngineConfig, FrontEnd, FrontendCosts, LinearCost
from kvrouter.lab.sim.server.instance import SimInstance
from tests.support.sim_server import instance_config, running, shared_tokenizer, sse_events

# Large enough to stand out of a loaded machine's noise; the test profile's steps take about a millisecond.
SLOW = FrontendCosts(
    http_request_s=0.05,
    render_chat=LinearCost(0.10, 0.0),
    render_completion=LinearCost(0.10, 0.0),
    to_engine=LinearCost(0.05, 0.0),
    first_output=LinearCost(0.10, 0.0),
    next_output_s=0.0,
    http_response_s=0.0,
)


async def first_and_last(url: str, path: str, body: dict[str, object]) -> tuple[float, float, float]:
    """(sent, first data event, last data event) times of one streamed request."""
    async with aiohttp.ClientSession() as s:
        sent = time.monotonic()
        async with s.post(f"{url}{path}", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            times = [t async for t, data in sse_events(resp) if data != "[DONE]"]
    return sent, times[0], times[-1]


async def test_the_first_token_waits_out_the_front_end() -> None:
    async with running(instance_config()) as server:
        inst = server.instance
        assert inst.frontend.costs == FrontendCosts()  # the test profile has none
        body = {"model": "sim-model", "prompt": "hello world " * 20, "max_tokens": 4, "ignore_eos": True}
        sent, first, _ = await first_and_last(server.url, "/v1/completions", body)
        fast = first - sent
        inst.frontend = FrontEnd(SLOW)
        sent, first, last = await first_and_last(server.url, "/v1/completions", body)
        # in: 0.05 + 0.10 + 0.05 before the engine; back: 0.10 for the first token (sleeps never end early)
        assert first - sent >= 0.30
        assert first - sent > fast + 0.25
        assert last >= first  # later tokens keep their order behind the first
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        sent, first, _ = await first_and_last(server.url, "/v1/chat/completions", chat)
        assert first - sent >= 0.30
        assert inst.frontend.rendered == 2


def test_instances_take_their_profiles_front_end_at_their_speed() -> None:
    tok, vocab = shared_tokenizer()
    cfg = instance_config(dp_size=2, events=False, engine=EngineConfig(profile="qwen3-32b-2xh100", speed=4.0))
    inst = SimInstance(cfg, tok, vocab=vocab)
    assert inst.frontend.costs == VLLM_033_FRONTEND
    assert inst.frontend.speed == 4.0
    # one API server per data-parallel rank, as vllm serve starts them
    assert inst.frontend.workers == 2
