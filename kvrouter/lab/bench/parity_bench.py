"""What token-parity checking costs the router: the sampling decision every routed request pays, and the
CPU of one check (a sampled request, a shortfall or a probe) in the router's process.

A simulated instance runs in a process of its own (``kvrouter sim``), so the CPU measured here is the
router's alone: converting the request's ids, the ``POST /tokenize`` call and its answer, the comparison.
Requests are agent-shaped chats (a ~2,000-token system prompt, tools, a growing history).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry

from indexer import Indexer
from indexer.config import load_yaml, parse_fleet
from kvrouter.api.requests import parse_body
from kvrouter.config import RouterFleetConfig
from kvrouter.gateway.parity_probe import ParityProber
from kvrouter.gateway.upstream import UpstreamPool
from kvrouter.lab.workloads.text import WORDS
from kvrouter.percentiles import summary_us
from kvrouter.pipeline import FleetTokens, PipelineMetrics, RequestPipeline
from kvrouter.pipeline.parity import ProbeCase, tokenize_body
from kvrouter.routing import Router

MODEL = "sim-model"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--checks", type=int, default=200)
    ap.add_argument("--routed", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=5)


def _bodies(rng: random.Random, n: int) -> list[bytes]:
    system = " ".join(rng.choice(WORDS) for _ in range(1500))
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    out, history = [], [{"role": "system", "content": system}]
    for i in range(n):
        history = [*history, {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(30))}]
        out.append(
            msgspec.json.encode({"model": MODEL, "messages": history, "tools": [tool], "max_tokens": 8})
        )
        history = [*history, {"role": "assistant", "content": f"answer {i}"}]
        if len(history) > 24:
            history = history[:1] + history[-12:]
    return out


async def _measure(a: argparse.Namespace, fleet_path: str) -> dict[str, Any]:
    cfg = parse_fleet(load_yaml(fleet_path), RouterFleetConfig)
    router = Router(Indexer(cfg.block_size), cfg.router_config())
    tokens = FleetTokens.from_config(cfg)
    pool = UpstreamPool(cfg.instances, router.load)
    pipeline = RequestPipeline(cfg, router, pool, tokens, PipelineMetrics(CollectorRegistry()))
    prober = ParityProber(pipeline, pool)
    rng = random.Random(a.seed)
    reqs = [parse_body(b, "chat") for b in _bodies(rng, a.checks)]
    ids = [await tokens.tokens(r) for r in reqs]
    name = cfg.instances[0].name
    # every routed request: the sampling decision (1 %)
    t0 = time.perf_counter()
    for i in range(a.routed):
        pipeline.parity.routed(reqs[i % len(reqs)], ids[i % len(ids)], name)
    decide_s = (time.perf_counter() - t0) / a.routed
    pipeline.parity.take()
    async with aiohttp.ClientSession() as session:
        prober.session = session
        wall: list[float] = []
        cpu0 = time.process_time()
        results = []
        for r, ours in zip(reqs, ids):
            t = time.perf_counter()
            body = tokenize_body(r)
            assert body is not None and ours is not None
            case = ProbeCase(r.model, body, [int(x) for x in ours], "sample", name)
            results.append(await prober._check(case))
            wall.append(time.perf_counter() - t)
        cpu = (time.process_time() - cpu0) / len(reqs)
    tokens.close()
    return {
        "prompt_tokens_mean": round(sum(0 if x is None else len(x) for x in ids) / len(ids)),
        "sampling_decision_per_routed_request_us": round(decide_s * 1e6, 3),
        "check_cpu_per_sampled_request_us": round(cpu * 1e6, 1),
        "check_wall": summary_us(wall),
        "results": {k: results.count(k) for k in set(results)},
        "cpu_per_routed_request_at_1pct_us": round(decide_s * 1e6 + 0.01 * cpu * 1e6, 2),
    }


def main(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        fleet = os.path.join(tmp, "fleet.yaml")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvrouter.cli",
                "--log-level",
                "WARNING",
                "sim",
                "--instances",
                "1",
                "--profile",
                "test",
                "--fleet-out",
                fleet,
                "--base-port",
                "0",
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(fleet):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvrouter sim did not start")
                time.sleep(0.2)
            return asyncio.run(_measure(a, fleet))
        finally:
            proc.terminate()
            proc.wait(30)
