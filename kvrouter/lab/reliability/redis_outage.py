"""Redis disappears and returns under two router replicas: routing continues on local state, and the
replicas resynchronise when it is back.

::

    gateway A ─┐ SharedState (round trips)  ┌─ redis-server (killed, then restarted empty)
    gateway B ─┴────────────────────────────┘
    burst: a new prefix to A; B is asked (explain) where it would send the same prefix until it names a
           cache reason or ``reach_within_s`` has passed, then sent it, while A's request is still queued
           at its instance (latency fault, longer than ``reach_within_s``): only A's shared speculative
           entry can make B choose A's instance for its cache

B is asked on a condition (its answer), not after a fixed delay; how long A's entry took to reach B is a
figure of its own.  Each gateway runs the fleet file's ``replicas: {redis_url: ...}``
(``Gateway.shared``), as ``kvrouter serve`` does.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_most, exactly
from kvrouter.lab.reliability.procs import RedisProcess, redis_binary
from kvrouter.lab.reliability.stack import (
    MODEL,
    GatewayProc,
    Resources,
    ScenarioError,
    client,
    completion,
    set_faults,
    until,
)
from kvrouter.percentiles import quantile
from kvrouter.replicas import SharedState


class RedisOutageConfig(msgspec.Struct, frozen=True):
    instances: int = 3
    bursts: int = 12
    """Bursts per phase (Redis up, down, back)."""
    queue_delay_s: float = 1.2
    """Latency fault on every instance: a request waits this long before its prefill (and its events)."""
    reach_within_s: float = 0.8
    """How long B is given to route on A's entry (below ``queue_delay_s``: A's events come later)."""
    interval_s: float = 0.05
    resync_within_s: float = 2.0
    seed: int = 0


class PhaseResult(msgspec.Struct):
    name: str
    together: int = 0
    """Bursts where B chose A's instance for the reason "cache" (A's shared speculative entry)."""
    bursts: int = 0
    failed: int = 0
    reached_s: list[float] = []
    """Per burst where B named a cache reason: seconds from A's request being sent to B's answer."""
    failures: list[str] = []
    """Each failed request: which gateway, its status and error message."""


async def _explain(s: aiohttp.ClientSession, b: GatewayProc, prompt: list[int]) -> dict[str, Any]:
    async with s.post(f"{b.base}/v1/route/explain", json={"model": MODEL, "prompt": prompt}) as r:
        if r.status != 200:
            raise ScenarioError(f"explain answered {r.status}: {(await r.text())[:200]}")
        out: dict[str, Any] = await r.json()
        return out


async def _ask_b(
    s: aiohttp.ClientSession, b: GatewayProc, prompt: list[int], since: float, within_s: float
) -> tuple[dict[str, Any], float | None]:
    """B's explain of ``prompt``, asked again until it names a cache reason or ``within_s`` after
    ``since`` (monotonic): the answer, and when it named the cache (None: never)."""
    while True:
        ex = await _explain(s, b, prompt)
        waited = time.monotonic() - since
        if ex["reason"] == "cache":
            return ex, waited
        if waited >= within_s:
            return ex, None
        await asyncio.sleep(0.01)


def _failure(gateway: str, status: int, body: dict[str, Any]) -> str:
    err = body.get("error")
    msg = err.get("message") if isinstance(err, dict) else None
    return f"{gateway}: {status} {msg or ''}".strip()


async def _bursts(
    s: aiohttp.ClientSession,
    a: GatewayProc,
    b: GatewayProc,
    cfg: RedisOutageConfig,
    rng: random.Random,
    name: str,
) -> PhaseResult:
    """A new prefix to A; while A's request is still queued, B is asked where it would send the same
    prefix (explain), then sent it.  Only A's shared speculative entry can give B a cache reason."""
    out = PhaseResult(name)
    for _ in range(cfg.bursts):
        prefix = [rng.randrange(100, 30_000) for _ in range(256)]
        sent = time.monotonic()
        first = asyncio.create_task(completion(s, a.base, [*prefix, 1], max_tokens=1))
        ex, reached = await _ask_b(s, b, [*prefix, 2], sent, cfg.reach_within_s)
        sb, _, bb = await completion(s, b.base, [*prefix, 2], max_tokens=1)
        sa, ha, ba = await first
        out.bursts += 1
        for gw, status, body in (("A", sa, ba), ("B", sb, bb)):
            if status != 200:
                out.failed += 1
                out.failures.append(_failure(gw, status, body))
        if ex["reason"] == "cache" and ex["choice"] == ha.get("x-kvrouter-instance"):
            out.together += 1
            if reached is not None:
                out.reached_s.append(reached)
    return out


async def redis_outage(res: Resources, cfg: RedisOutageConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    if redis_binary() is None:
        return ScenarioResult(
            "redis",
            "Faults",
            "Redis gone and back (replicas)",
            [Figure("skipped", "redis-server not installed", "", None)],
            notes=["install redis-server to run this scenario"],
        )
    if cfg.reach_within_s >= cfg.queue_delay_s:
        raise ScenarioError(
            "reach_within_s must be below queue_delay_s (A's events would explain B's choice)"
        )
    rng = random.Random(cfg.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvrouter-rel-redis-"))
    log = (workdir / "redis.log").open("wb")
    redis = RedisProcess(log, workdir)
    await redis.start()
    states: list[SharedState] = []
    try:
        fleet = res.fleet(cfg.instances, seed=cfg.seed)
        async with fleet:
            rep = {"redis_url": redis.url, "namespace": f"rel{cfg.seed}", "interval_s": cfg.interval_s}
            rep["lease_s"] = 1.0
            a = await res.gateway(fleet, {"replicas": {**rep, "replica_id": "replica-a"}})
            b = await res.gateway(fleet, {"replicas": {**rep, "replica_id": "replica-b"}})
            async with a, b, client() as s:
                for g in (a, b):
                    if g.gateway.shared is None:
                        raise ScenarioError("the gateway did not start shared state")
                    states.append(g.gateway.shared)
                await until(
                    lambda: all(x.status()["peers"] == 1 for x in states), 5, "replicas see each other"
                )
                for srv in fleet.servers:
                    await set_faults(s, srv.url, latency_s=cfg.queue_delay_s)
                up = await _bursts(s, a, b, cfg, rng, "up")
                redis.kill()
                t_kill = time.monotonic()
                detect_s = await until(lambda: not any(x.status()["up"] for x in states), 5, "outage seen")
                down = await _bursts(s, a, b, cfg, rng, "down")
                errors = sum(
                    x.metrics.registry.get_sample_value("kvrouter_shared_state_errors_total", {"reason": r})
                    or 0.0
                    for x in states
                    for r in ("connection", "timeout")
                )
                redis = RedisProcess(log, workdir, port=redis.port)
                await redis.start()
                t_back = time.monotonic()
                resync_s = await until(
                    lambda: all(x.status()["up"] and x.status()["peers"] == 1 for x in states),
                    15,
                    "resynchronised",
                )
                back = await _bursts(s, a, b, cfg, rng, "back")
                for srv in fleet.servers:
                    await set_faults(s, srv.url, latency_s=0.0)
                outage_s = t_back - t_kill
                reached = up.reached_s + back.reached_s
    finally:
        redis.kill()
        log.close()
    figures = [
        exactly("requests failed (Redis up, down, back)", up.failed + down.failed + back.failed, 0),
        Figure(
            "B routes on A's in-flight prefix (shared entry): Redis up / down / back",
            f"{up.together}/{up.bursts} / {down.together}/{down.bursts} / {back.together}/{back.bursts}",
            "",
            None,
        ),
        exactly(
            "... with Redis up and after it returned: every burst",
            up.together + back.together,
            up.bursts + back.bursts,
        ),
        Figure(
            "outage noticed by both replicas",
            f"{detect_s * 1e3:.0f} ms, {int(errors)} failed round trips",
            "",
        ),
        Figure(
            f"A's entry reached B, from A's request sent (B asked for {cfg.reach_within_s:.1f} s at most): "
            "p50 / max, Redis up and back",
            f"{quantile(reached, 0.5) * 1e3:.0f} / {max(reached, default=float('nan')) * 1e3:.0f} ms",
        ),
        at_most("resynchronised after Redis returned", resync_s, cfg.resync_within_s, unit="s", fmt="{:.2f}"),
        Figure("outage length", f"{outage_s:.1f} s", ""),
    ]
    notes = [f"failed request, Redis {p.name}: {f}" for p in (up, down, back) for f in p.failures]
    return ScenarioResult(
        "redis",
        "Faults",
        "Redis gone and back (2 replicas)",
        figures,
        time.perf_counter() - t_start,
        notes=notes,
    )
