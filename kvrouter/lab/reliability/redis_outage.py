"""Redis disappears and returns under two router replicas: routing continues on local state, and the
replicas resynchronise when it is back.

::

    gateway A ─┐ SharedState (50 ms round trips)  ┌─ redis-server (killed, then restarted empty)
    gateway B ─┴──────────────────────────────────┘
    burst: a new prefix to A, then 150 ms later B is asked (explain) and sent the same prefix while A's
           request is still queued at its instance (latency fault): only A's shared speculative entry can
           make B choose A's instance for its cache

Each gateway runs the fleet file's ``replicas: {redis_url: ...}`` (``Gateway.shared``), as ``kvrouter serve``
does.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

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
from kvrouter.replicas import SharedState


class RedisOutageConfig(msgspec.Struct, frozen=True):
    instances: int = 3
    bursts: int = 12
    """Bursts per phase (Redis up, down, back)."""
    queue_delay_s: float = 0.5
    """Latency fault on every instance: a request waits this long before its prefill (and its events)."""
    interval_s: float = 0.05
    resync_within_s: float = 2.0
    seed: int = 0


class PhaseResult(msgspec.Struct):
    together: int = 0
    """Bursts where B chose A's instance for the reason "cache" (A's shared speculative entry)."""
    bursts: int = 0
    failed: int = 0


async def _bursts(
    s: aiohttp.ClientSession, a: GatewayProc, b: GatewayProc, n: int, rng: random.Random
) -> PhaseResult:
    """A new prefix to A; 150 ms later (A's request still queued) B is asked where it would send the same
    prefix (explain), then sent it.  Only A's shared speculative entry can give B a cache reason."""
    out = PhaseResult()
    for _ in range(n):
        prefix = [rng.randrange(100, 30_000) for _ in range(256)]
        first = asyncio.create_task(completion(s, a.base, [*prefix, 1], max_tokens=1))
        await asyncio.sleep(0.15)
        async with s.post(f"{b.base}/v1/route/explain", json={"model": MODEL, "prompt": [*prefix, 2]}) as r:
            ex = await r.json()
        sb, _, _ = await completion(s, b.base, [*prefix, 2], max_tokens=1)
        sa, ha, _ = await first
        out.bursts += 1
        out.failed += (sa != 200) + (sb != 200)
        out.together += ex["reason"] == "cache" and ex["choice"] == ha.get("x-kvrouter-instance")
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
                up = await _bursts(s, a, b, cfg.bursts, rng)
                redis.kill()
                t_kill = time.monotonic()
                detect_s = await until(lambda: not any(x.status()["up"] for x in states), 5, "outage seen")
                down = await _bursts(s, a, b, cfg.bursts, rng)
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
                back = await _bursts(s, a, b, cfg.bursts, rng)
                for srv in fleet.servers:
                    await set_faults(s, srv.url, latency_s=0.0)
                outage_s = t_back - t_kill
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
        at_most("resynchronised after Redis returned", resync_s, cfg.resync_within_s, unit="s", fmt="{:.2f}"),
        Figure("outage length", f"{outage_s:.1f} s", ""),
    ]
    return ScenarioResult(
        "redis", "Faults", "Redis gone and back (2 replicas)", figures, time.perf_counter() - t_start
    )
