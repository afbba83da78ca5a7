"""Predicted cached tokens (``x-kvrouter-cached-tokens``) against the ``cached_tokens`` real vLLM reports, on
every API that renders a prompt: completions, chats with tools and tool calls, the Responses API with vLLM's
store (``previous_response_id``) and the Messages API; before and after vLLM evicts."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import aiohttp

from tests.real.conftest import FIGURES, RealFleet
from tests.support.real_gateway import Served, Tally, fleet_file, reset_caches, run_calls, send
from tests.support.real_vllm import MODEL
from tests.support.real_workload import TOOLS, AgentWorkload, text

SYSTEM = "You are the operations agent. " + text(random.Random(11), 260)

ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


def chat_calls(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(4):
        msgs.append({"role": "user", "content": text(rng, 40)})
        out.append(
            (
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": list(msgs),
                    "tools": TOOLS,
                    "tool_choice": "none",
                    "max_tokens": 3,
                },
            )
        )
        cid = f"call_{turn}"
        args = json.dumps({"city": text(rng, 1)})
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": args}}
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": cid, "content": text(rng, 30)})
        msgs.append({"role": "assistant", "content": text(rng, 20)})
    return out


def completion_calls(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("/v1/completions", {"model": MODEL, "prompt": SYSTEM + "\n\nQ: " + text(rng, 50), "max_tokens": 3})
        for _ in range(3)
    ]


def message_calls(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    msgs: list[dict[str, Any]] = []
    out = []
    for turn in range(3):
        msgs.append({"role": "user", "content": text(rng, 40)})
        body = {
            "model": MODEL,
            "system": SYSTEM,
            "messages": list(msgs),
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "none"},
            "max_tokens": 3,
        }
        out.append(("/v1/messages", body))
        tid = f"toolu_{turn}"
        msgs.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": tid, "name": "get_weather", "input": {"city": "x"}}],
            }
        )
        msgs.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tid, "content": text(rng, 20)}],
            }
        )
    return out


async def responses_chain(base: str, rng: random.Random, first: Tally, later: Tally, turns: int = 3) -> None:
    """A stored conversation: each turn continues the last by ``previous_response_id`` (the gateway sends
    it to the instance that stored it).  The first turn is counted in ``first``, the others in ``later``."""
    prev: str | None = None
    async with aiohttp.ClientSession() as s:
        for _ in range(turns):
            body: dict[str, Any] = {
                "model": MODEL,
                "instructions": SYSTEM,
                "input": text(rng, 40),
                "max_output_tokens": 3,
                "store": True,
            }
            if prev:
                body["previous_response_id"] = prev
            o = await send(s, base, "/v1/responses", body)
            t = later if prev else first
            t.add(t.requests, o)
            prev = o.body["id"]


async def _run_kinds(base: str, rng: random.Random) -> dict[str, Tally]:
    out = {
        "completions": await run_calls(base, completion_calls(rng), health=base + "/health"),
        "chat with tools and tool calls": await run_calls(base, chat_calls(rng), health=base + "/health"),
        "messages": await run_calls(base, message_calls(rng), health=base + "/health"),
    }
    out["responses (store), first turns"] = Tally()
    await responses_chain(base, rng, out["responses (store), first turns"], Tally())
    return out


async def test_every_api_predicts_what_vllm_reports(fleet: RealFleet, tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, fleet.servers)
    gw = await Served(fleet_file(tmp_path / "f.yaml", fleet.servers), fleet.log_dir).start()
    rng = random.Random(5)
    try:
        before = await _run_kinds(gw.url, rng)
        await run_calls(
            gw.url, AgentWorkload(seed=9, systems=8).calls(40), health=gw.url + "/health"
        )  # fills and evicts every cache
        after = await _run_kinds(gw.url, rng)
    finally:
        gw.stop()
    for phase, tallies in (("before evictions", before), ("after evictions", after)):
        for kind, t in tallies.items():
            FIGURES[f"{kind}, {phase}"] = t.summary()
    bad = {
        f"{k} {p}": t.summary()
        for p, ts in (("before", before), ("after", after))
        for k, t in ts.items()
        if t.misses
    }
    assert not bad, bad


async def test_responses_continuations_predict_what_vllm_reports(fleet: RealFleet, tmp_path: Path) -> None:
    """previous_response_id: the router keeps what vLLM stored for each answer it forwarded (the messages it
    rendered, the output items), so a continuation is tokenized as vLLM renders it."""
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, fleet.servers)
    gw = await Served(fleet_file(tmp_path / "f.yaml", fleet.servers), fleet.log_dir).start()
    first, later = Tally(), Tally()
    try:
        await responses_chain(gw.url, random.Random(12), first, later, turns=3)
    finally:
        gw.stop()
    FIGURES["responses continuations (previous_response_id)"] = later.summary()
    assert first.misses == [], first.summary()
    assert later.misses == [], later.summary()
