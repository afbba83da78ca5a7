"""Live path against simulation: one small workload through real HTTP and ZeroMQ, and through
``VirtualFleet``, under the same fleet parameters; do their cache hit rates agree?

::

    make_workload(chat form) ──materialize(fleet tokenizer)──▶ the exact prompt token ids
        │                                                        │
        ▼ live: SimFleet (N instances, KV events over ZeroMQ)    ▼ simulated: VirtualFleet(same instances,
          + Gateway (kv-aware, subscribed) on 127.0.0.1            profile, capacity, batch limits,
          + load generator (HTTP, streaming, include_usage)       kv-aware), the same Router and Indexer
        │ vLLM-reported cached_tokens                            │ engine-reported cached tokens
        └───────────────── hit rates, and their difference ─────┘

Everything live runs in this process on one event loop (the fleet, the gateway, the clients): nothing to
spawn, and hit rates depend on routing and caching, not on how fast the loop turns.  The live fleet runs
``speed`` times faster than its timing profile while HTTP, tokenization and ZeroMQ do not, so the virtual
fleet's event delay and network latency are the live path's (assumed) overheads times ``speed``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from kvrouter.lab.evaluation.compare import summarize
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig, VirtualFleet
from kvrouter.lab.loadgen import LiveRecord, drive
from kvrouter.lab.workloads import make_workload, materialize, tokenize_with
from kvrouter.lab.workloads.spec import Workload
from kvrouter.routing import KV_AWARE, RouterConfig

DEFAULT_OVERRIDES: Mapping[str, Any] = MappingProxyType(
    {
        "form": "chat",
        "seed": 7,
        "num_groups": 12,
        "prompts_per_group": 12,
        "system_len": 2000,
        "question_len": 120,
        "output_len": 24,
    }
)


class AgreementConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One agreement check."""

    workload: str = "sglang-gsp"
    """A registered workload, in chat or text form (it is materialized with the fleet's tokenizer)."""
    overrides: dict[str, Any] = msgspec.field(default_factory=lambda: dict(DEFAULT_OVERRIDES))
    """Workload parameters (default: 12 shared 2000-token system prompts x 12 questions, chat form)."""
    concurrency: int = 12
    """Closed-loop clients, live and simulated."""
    instances: int = 4
    profile: str = "qwen3-32b-2xh100"
    speed: float = 4.0
    """The live fleet runs this many times faster than the profile (as ``kvrouter demo``)."""
    capacity_blocks: int | None = None
    """KV blocks per instance, both sides (None: the profile's)."""
    policy: str = KV_AWARE
    live_event_delay_s: float = 0.003
    """Assumed engine-step-to-index delay on the live path (ZeroMQ, decode, apply), real seconds."""
    live_net_latency_s: float = 0.002
    """Assumed one-way gateway-to-engine overhead on the live path (HTTP, proxying), real seconds."""
    tolerance: float = 0.02
    """Largest accepted |live - simulated| hit rate (fraction of prompt tokens)."""
    workers: int = 0
    """0: the gateway in this process.  N >= 1: ``kvrouter serve --workers N`` as a process tree, every
    request on a fresh connection (the kernel picks its worker: requests sharing a prefix meet in different
    workers, which must agree on load and speculative entries as one process does)."""


class AgreementResult(msgspec.Struct, kw_only=True):
    requests: int
    live_hit_rate: float
    sim_hit_rate: float
    difference: float
    """live - simulated (fraction of prompt tokens)."""
    within_tolerance: bool
    live_errors: int
    prompt_token_mismatches: int
    """Requests whose live prompt length differs from the materialized one (tokenization parity)."""
    same_cached_tokens: float
    """Fraction of requests with exactly the same cached tokens live and simulated."""
    live_wall_s: float
    sim_wall_s: float
    config: AgreementConfig
    per_worker: dict[str, int] | None = None
    """With ``config.workers``: the requests each worker answered (by worker number)."""


def workload_for(cfg: AgreementConfig) -> Workload:
    """The workload, closed loop with ``cfg.concurrency`` clients (not yet materialized)."""
    over = {**cfg.overrides, "arrival": {"type": "closed-loop", "concurrency": cfg.concurrency}}
    return make_workload(cfg.workload, **over)


def sim_fleet_config(cfg: AgreementConfig) -> FleetSimConfig:
    """The virtual fleet matching the live one; fixed live overheads scaled into the profile's time."""
    return FleetSimConfig(
        instances=cfg.instances,
        profile=cfg.profile,
        capacity_blocks=cfg.capacity_blocks,
        event_delay_s=cfg.live_event_delay_s * cfg.speed,
        net_latency_s=cfg.live_net_latency_s * cfg.speed,
    )


async def run_live(
    cfg: AgreementConfig, workload: Workload
) -> tuple[Workload, list[LiveRecord], float, dict[str, int] | None]:
    """Start the fleet and the gateway, materialize ``workload`` with the fleet's tokenizer, drive it.
    Returns the materialized workload, the records, the wall time of the drive and (``cfg.workers``) the
    requests each worker answered."""
    from aiohttp import web

    from indexer.config import parse_fleet
    from indexer.types import SourceKey
    from kvrouter.config import RouterFleetConfig
    from kvrouter.gateway import Gateway, build_gateway
    from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig
    from kvrouter.pipeline import FleetTokens

    fleet_cfg = SimFleetConfig(
        instances=cfg.instances,
        profile=cfg.profile,
        speed=cfg.speed,
        capacity_blocks=cfg.capacity_blocks,
        answer_tokens=0,  # answers run to max_tokens, as the simulation generates them
    )
    async with SimFleet(fleet_cfg) as fleet:
        tok = fleet.tokenizer
        mat = materialize(workload, tokenize_with(tok.encode_prompt, tok.encode_chat))
        raw = {**fleet.fleet_dict(), "routing": {"policy": cfg.policy, "shadow": False}}
        if cfg.workers:
            from kvrouter.lab.agreement_served import drive_served

            recs, wall, per_worker = await drive_served(
                raw, cfg.workers, mat, fleet_cfg.model, cfg.concurrency
            )
            return mat, recs, wall, per_worker
        gcfg = parse_fleet(raw, RouterFleetConfig)
        gw = Gateway(gcfg, tokens=FleetTokens.from_config(gcfg))
        runner = web.AppRunner(build_gateway(gw), handler_cancellation=True)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            await _until_subscribed(gw, [SourceKey(s.name, 0) for s in fleet.servers])
            t0 = time.perf_counter()
            recs = await drive(
                f"http://{host}:{port}", mat, model=fleet_cfg.model, concurrency=cfg.concurrency
            )
            wall = time.perf_counter() - t0
        finally:
            await runner.cleanup()
            if isinstance(gw.tokens, FleetTokens):
                gw.tokens.close()
    return mat, recs, wall, None


async def _until_subscribed(gw: Any, keys: list[Any], timeout_s: float = 20.0) -> None:
    """Until the gateway's subscriber is connected to every instance (events sent before are lost)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = gw.subscriber.status if gw.subscriber is not None else {}
        if all(k in status and status[k].connected for k in keys):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the gateway did not subscribe to every instance's KV events")
        await asyncio.sleep(0.05)


def check(cfg: AgreementConfig | None = None) -> AgreementResult:
    """Run the workload live, then in the virtual fleet, and compare."""
    cfg = cfg or AgreementConfig()
    mat, recs, live_wall, per_worker = asyncio.run(run_live(cfg, workload_for(cfg)))
    ok = [r for r in recs if r.status == 200 and r.error is None]
    live_prompt = sum(r.prompt_tokens for r in ok)
    live_hit = sum(r.cached_tokens for r in ok) / live_prompt if live_prompt else 0.0
    expected = {r.id: r.num_prompt_tokens for r in mat.requests}
    mismatches = sum(1 for r in ok if r.prompt_tokens != expected.get(r.id))

    t0 = time.perf_counter()
    rcfg = RouterConfig(policy=cfg.policy, shadow=False)
    run = VirtualFleet(mat, sim_fleet_config(cfg), rcfg).run()
    sim_wall = time.perf_counter() - t0
    sim_hit = float(summarize(run)["hit_rate"])
    sim_cached = {r.id: r.cached_tokens for r in run.records}
    same = sum(1 for r in ok if sim_cached.get(r.id) == r.cached_tokens)
    diff = live_hit - sim_hit
    return AgreementResult(
        requests=len(mat.requests),
        live_hit_rate=live_hit,
        sim_hit_rate=sim_hit,
        difference=diff,
        within_tolerance=abs(diff) <= cfg.tolerance and len(ok) == len(recs),
        live_errors=len(recs) - len(ok),
        prompt_token_mismatches=mismatches,
        same_cached_tokens=same / len(ok) if ok else 0.0,
        live_wall_s=live_wall,
        sim_wall_s=sim_wall,
        config=cfg,
        per_worker=per_worker,
    )


def report(res: AgreementResult) -> str:
    """A few lines for the terminal."""
    c = res.config
    verdict = "agree" if res.within_tolerance else "DISAGREE"
    return "\n".join(
        [
            f"{c.workload} ({res.requests} requests, {c.concurrency} clients) on {c.instances} x {c.profile} "
            f"at {c.speed:g}x, policy {c.policy}"
            + (f", kvrouter serve --workers {c.workers}" if c.workers else ""),
            f"  live (HTTP + ZeroMQ)  hit rate {res.live_hit_rate:.2%}  ({res.live_wall_s:.1f} s, "
            f"{res.live_errors} errors, {res.prompt_token_mismatches} prompt-length mismatches)",
            f"  simulated             hit rate {res.sim_hit_rate:.2%}  ({res.sim_wall_s:.1f} s)",
            f"  difference {res.difference * 100:+.2f} points (tolerance {c.tolerance * 100:.1f}): "
            f"{verdict}; same cached tokens on {res.same_cached_tokens:.0%} of requests",
            *([f"  requests answered per worker: {res.per_worker}"] if res.per_worker else []),
        ]
    )
