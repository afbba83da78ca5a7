"""``kvrouter demo``: the main job on the embedded default (simulated fleet, embedded indexer)."""

from __future__ import annotations

import argparse
import asyncio
import json

import msgspec

from kvrouter.lab.demo import POLICIES, DemoConfig, run_demo


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--instances", type=int, default=d.instances)
    p.add_argument("--profile", default=d.profile)
    p.add_argument("--speed", type=float, default=d.speed)
    p.add_argument("--capacity-blocks", type=int, default=d.capacity_blocks, help="KV blocks per instance")
    p.add_argument("--agent-turns", type=int, default=d.agent_turns, help="Responses API agent session turns")
    p.add_argument("--groups", type=int, default=d.groups)
    p.add_argument("--per-group", type=int, default=d.per_group)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", dest="json_out", default=None, help="also write the figures as JSON here")


def run(a: argparse.Namespace) -> int:
    cfg = DemoConfig(
        instances=a.instances,
        profile=a.profile,
        speed=a.speed,
        capacity_blocks=a.capacity_blocks,
        agent_turns=a.agent_turns,
        groups=a.groups,
        per_group=a.per_group,
        system_tokens=a.system_tokens,
        output_tokens=a.output_tokens,
        concurrency=a.concurrency,
        policies=tuple(x for x in a.policies.split(",") if x),
    )
    results = asyncio.run(run_demo(cfg))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"config": msgspec.to_builtins(cfg), "results": results}, f, indent=1)
    return 0 if all(r.get("errors", 0) == 0 for r in results.values()) else 1
