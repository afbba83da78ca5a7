"""vLLM's API server in front of a simulated engine: the renderer's FIFO workers against a reference model,
the costs' shape, and the measured constants against the committed measurement."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.lab.sim.engine import (
    NO_FRONTEND,
    VLLM_033_FRONTEND,
    FrontEnd,
    FrontendCosts,
    LinearCost,
    SimConfigError,
    get_profile,
)
from kvrouter.lab.sim.engine.timing import PROMPT_APIS, PromptApi

COSTS = FrontendCosts(
    http_request_s=0.001,
    render_chat=LinearCost(0.002, 1e-5),
    render_completion=LinearCost(0.001, 1e-5),
    render_token_ids=LinearCost(0.0005, 1e-7),
    to_engine=LinearCost(0.0003, 2e-7),
    first_output=LinearCost(0.0001, 5e-7),
    next_output_s=0.00005,
    http_response_s=0.0007,
)
MEASUREMENT = Path(__file__).resolve().parents[5] / "tools" / "frontend_costs.json"


def reference(
    costs: FrontendCosts, workers: int, requests: list[tuple[float, int, PromptApi]]
) -> list[float]:
    """When the engine has each request: requests in order, each rendered by the worker that frees first
    (a plain list of free times, scanned), never before it reached the renderer."""
    free = [float("-inf")] * workers
    out = []
    for now, tokens, api in requests:
        w = min(range(workers), key=lambda i: free[i])
        start = max(now + costs.http_request_s, free[w])
        free[w] = start + costs.render_s(api, tokens)
        out.append(free[w] + costs.to_engine.at(tokens))
    return out


requests_st = st.lists(
    st.tuples(
        st.floats(0, 0.5, allow_nan=False),
        st.integers(1, 40_000),
        st.sampled_from(PROMPT_APIS),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(requests_st, st.integers(1, 4))
def test_arrivals_match_the_reference_queue(raw: list[tuple[float, int, PromptApi]], workers: int) -> None:
    gaps = [g for g, _, _ in raw]
    times = [sum(gaps[: i + 1]) for i in range(len(gaps))]  # arrivals in order
    reqs = [(t, n, api) for t, (_, n, api) in zip(times, raw, strict=True)]
    fe = FrontEnd(COSTS, workers=workers)
    got = [fe.arrive(t, n, api) for t, n, api in reqs]
    assert got == pytest.approx(reference(COSTS, workers, reqs))
    assert fe.rendered == len(reqs)
    # nothing reaches the engine sooner than its own path through an idle front end
    for (t, n, api), ready in zip(reqs, got, strict=True):
        own = COSTS.http_request_s + COSTS.render_s(api, n) + COSTS.to_engine.at(n)
        assert ready >= t + own - 1e-12


def test_one_worker_renders_a_burst_one_after_the_other() -> None:
    fe = FrontEnd(COSTS)
    n = 8000
    render = COSTS.render_s("chat", n)
    ready = [fe.arrive(0.0, n, "chat") for _ in range(4)]
    gaps = [b - a for a, b in itertools.pairwise(ready)]
    assert gaps == pytest.approx([render] * 3)
    assert fe.queued_s == pytest.approx(render * (1 + 2 + 3))
    # an idle front end again: the next request waits for nobody
    later = fe.arrive(10.0, n, "chat")
    assert later == pytest.approx(10.0 + COSTS.http_request_s + render + COSTS.to_engine.at(n))


def test_speed_divides_every_duration() -> None:
    slow, fast = FrontEnd(COSTS), FrontEnd(COSTS, speed=4.0)
    assert fast.arrive(1.0, 5000, "completion") - 1.0 == pytest.approx(
        (slow.arrive(1.0, 5000, "completion") - 1.0) / 4
    )
    assert fast.first_output_delay(5000) == pytest.approx(slow.first_output_delay(5000) / 4)
    assert fast.output_delay() == pytest.approx(slow.output_delay() / 4)


def test_no_frontend_costs_nothing() -> None:
    fe = FrontEnd(NO_FRONTEND)
    assert [fe.arrive(2.5, n, "chat") for n in (1, 30_000)] == [2.5, 2.5]
    assert fe.first_output_delay(30_000) == 0.0 and fe.output_delay() == 0.0
    assert get_profile("test").frontend == NO_FRONTEND


def test_the_way_back() -> None:
    fe = FrontEnd(COSTS)
    assert fe.delay(True, 1000) == pytest.approx(COSTS.first_output.at(1000) + COSTS.http_response_s)
    assert (
        fe.delay(False, 1000)
        == fe.output_delay()
        == pytest.approx(COSTS.next_output_s + COSTS.http_response_s)
    )


def test_invalid_costs_are_refused() -> None:
    with pytest.raises(SimConfigError):
        FrontEnd(FrontendCosts(render_chat=LinearCost(-1.0)))
    with pytest.raises(SimConfigError):
        FrontEnd(FrontendCosts(renderer_workers=0))
    with pytest.raises(SimConfigError):
        FrontEnd(COSTS, speed=0)
    with pytest.raises(SimConfigError):
        FrontEnd(COSTS, workers=0)


@pytest.mark.parametrize("name", ["llama-3.1-70b-8xh100", "qwen3-32b-2xh100"])
def test_real_profiles_pay_vllms_front_end(name: str) -> None:
    c = get_profile(name).frontend
    assert c == VLLM_033_FRONTEND and c.renderer_workers == 1
    # tokenization dominates long prompts: an 8k chat costs tens of ms before the engine, a token-id
    # prompt far less; the first token's way back grows with the prompt, later ones do not
    assert 0.01 < c.render_s("chat", 8000) < 0.05
    assert c.render_s("token_ids", 8000) < c.render_s("completion", 8000) / 5
    assert c.render_s("chat", 100) > c.render_s("completion", 100)  # the template's fixed cost
    assert c.first_output_s(32_000) > 5 * c.first_output_s(100)
    assert c.output_s() < c.first_output_s(100)


def test_constants_are_the_committed_measurement() -> None:
    """VLLM_033_FRONTEND's rendering, hop and way-back costs are the pooled fits of tools/frontend_costs.py's
    sessions (to 10 %, or 20 us where a cost is near zero)."""
    stages = json.loads(MEASUREMENT.read_text())["pooled"]["stages"]
    c = VLLM_033_FRONTEND
    pairs = {
        "render_chat": c.render_chat,
        "render_completion": c.render_completion,
        "render_token_ids": c.render_token_ids,
        "to_engine": c.to_engine,
        "first_output": c.first_output,
    }
    for name, cost in pairs.items():
        fitted = stages[name]
        assert cost.fixed_s * 1e3 == pytest.approx(fitted["a_ms"], rel=0.1, abs=0.02), name
        assert cost.per_token_s * 1e6 == pytest.approx(fitted["b_us_per_token"], rel=0.1, abs=0.02), name
    assert c.next_output_s * 1e3 == pytest.approx(stages["next_output"]["a_ms"], rel=0.1, abs=0.02)
