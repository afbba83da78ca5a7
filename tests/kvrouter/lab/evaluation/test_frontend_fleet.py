"""The virtual fleet puts vLLM's API server around every engine: on an idle fleet each request's time to
first token grows by exactly its front-end path, the prompt's form decides the render, and the renderer
queues a burst."""

from __future__ import annotations

import argparse

import pytest

from kvrouter.lab.commands import eval as eval_command
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig, RequestRecord, VirtualFleet
from kvrouter.lab.sim.engine import SimConfigError, get_profile
from kvrouter.lab.sim.engine.timing import PromptApi
from kvrouter.lab.workloads.spec import ChatMessage, OpenLoop, Request, Segment, TokenSpace, Workload
from kvrouter.routing import RouterConfig

PROFILE = "llama-3.1-70b-8xh100"
LENGTHS = (120, 900, 4000, 8000, 16000)


def workload(gap_s: float, lengths: tuple[int, ...] = LENGTHS, **kw: object) -> Workload:
    reqs = [
        Request(
            id=f"r{i}",
            arrival_s=i * gap_s,
            max_output_tokens=3,
            num_prompt_tokens=n,
            segments=(Segment(1000 + i, n),),  # nothing shared: every prompt is computed in full
            **kw,  # type: ignore[arg-type]
        )
        for i, n in enumerate(lengths)
    ]
    return Workload(name="t", requests=reqs, mode=OpenLoop(), token_space=TokenSpace(), metadata={})


def run(w: Workload, **cfg: object) -> dict[str, RequestRecord]:
    fleet = FleetSimConfig(**{"instances": 2, "profile": PROFILE, "events": False, **cfg})  # type: ignore[arg-type]
    out = VirtualFleet(w, fleet, RouterConfig(policy="round-robin", shadow=False)).run()
    return {r.id: r for r in out.records}


def ttft(r: RequestRecord) -> float:
    assert r.first_token_s is not None
    return r.first_token_s - r.arrival_s


@pytest.mark.parametrize("api", ["chat", "completion", "token_ids"])
def test_idle_fleet_ttft_grows_by_the_front_end_path(api: PromptApi) -> None:
    w = workload(gap_s=30.0)  # each request alone in the fleet
    off, on = run(w, frontend=False), run(w, prompt_api=api)
    c = get_profile(PROFILE).frontend
    for rid, r in on.items():
        n = r.prompt_tokens
        path = (
            c.http_request_s
            + c.render_s(api, n)
            + c.to_engine.at(n)
            + c.first_output.at(n)
            + c.http_response_s
        )
        assert r.instance == off[rid].instance
        assert ttft(r) - ttft(off[rid]) == pytest.approx(path, abs=1e-9)
        assert r.finish_s is not None and r.finish_s >= r.first_token_s  # type: ignore[operator]
    # a 16k-token chat pays tens of milliseconds before its prefill starts
    if api == "chat":
        assert ttft(on["r4"]) - ttft(off["r4"]) > 0.03


def test_requests_with_messages_are_chat_whatever_prompt_api_says() -> None:
    msgs = (ChatMessage(role="user", content="hello there"),)
    w = workload(gap_s=30.0, messages=msgs)
    as_ids, as_chat = run(w, prompt_api="token_ids"), run(w, prompt_api="chat")
    assert [ttft(r) for r in as_ids.values()] == pytest.approx([ttft(r) for r in as_chat.values()])


def test_a_burst_of_long_prompts_queues_on_the_renderer() -> None:
    n = 16000
    burst = workload(gap_s=0.0, lengths=(n,) * 4)
    fleet = FleetSimConfig(instances=1, profile=PROFILE, events=False)
    vf = VirtualFleet(burst, fleet, RouterConfig(policy="round-robin", shadow=False))
    recs = vf.run().records
    render = get_profile(PROFILE).frontend.render_s("chat", n)
    # the k-th request of the burst waited for the k renders before it, one worker
    assert vf.frontends[0].queued_s == pytest.approx(render * (1 + 2 + 3))
    assert vf.frontends[0].rendered == 4
    # here the engine is the bottleneck (a 16k prefill takes far longer than its render): the queue is
    # hidden behind the prefills before it, and first tokens come in arrival order
    firsts = [r.first_token_s for r in recs]
    assert firsts == sorted(firsts)  # type: ignore[type-var]


def test_prompt_api_is_checked() -> None:
    with pytest.raises(SimConfigError):
        VirtualFleet(workload(1.0), FleetSimConfig(prompt_api="grpc"), RouterConfig())  # type: ignore[arg-type]


def test_pooled_bound_has_a_front_end_per_instance_it_stands_for() -> None:
    cfg = FleetSimConfig(instances=1, profile=PROFILE)
    vf = VirtualFleet(workload(0.0, lengths=(8000,) * 4), cfg, RouterConfig(), pooled_of=4)
    # four simultaneous renders: none waits for another
    ready = [vf.frontends[0].arrive(0.0, 8000, "chat") for _ in range(4)]
    assert max(ready) == pytest.approx(min(ready))


def test_eval_command_sets_the_front_end() -> None:
    p = argparse.ArgumentParser()
    eval_command.add_arguments(p)
    default = eval_command.spec_from_args(p.parse_args(["--workload", "short-chat"]))
    assert default.fleet.frontend and default.fleet.prompt_api == "chat"
    off = eval_command.spec_from_args(
        p.parse_args(["--workload", "short-chat", "--no-frontend", "--prompt-api", "token_ids"])
    )
    assert not off.fleet.frontend and off.fleet.prompt_api == "token_ids"
