"""A gap older than the replay buffer: the instance is marked degraded within a second, routing falls back
to load for it alone, and it recovers when the engine clears its cache or restarts.

::

    victim:  blocks of prompt A ─▶ drop every batch for > buffer_steps steps ─▶ one more batch (the gap)
             └─ replay from last+1 finds the buffer already past it ─▶ degraded (explain: no cache credit)
    others:  blocks of prompt B, trust exact, routed on cache as before
    then:    POST /reset_prefix_cache ─▶ AllBlocksCleared ─▶ exact;   crash + restart ─▶ seq 0 ─▶ exact

The simulated instance has no knob for its replay buffer's size, so the victim's buffer is shrunk in place
(the default keeps 10,000 batches, more than a test can outrun quickly).
"""

from __future__ import annotations

import collections
import random
import time
from typing import Any

import aiohttp
import msgspec

from indexer import SourceKey, Trust
from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_least, at_most, exactly
from kvrouter.lab.reliability.stack import (
    MODEL,
    GatewayProc,
    Resources,
    ScenarioError,
    client,
    completion,
    set_faults,
    subscribed,
    until,
)
from kvrouter.lab.sim.server.fleet import SimFleet
from kvrouter.lab.sim.server.server import SimServer


class GapConfig(msgspec.Struct, frozen=True):
    instances: int = 3
    buffer_steps: int = 8
    """The victim's replay buffer, in batches."""
    lost_requests: int = 14
    """Requests (each at least one batch) whose events are all dropped: more than the buffer holds."""
    degrade_within_s: float = 1.0
    seed: int = 0


def _shrink_replay_buffer(server: SimServer, steps: int) -> None:
    for rank in server.instance.ranks:
        pub = rank.publisher
        if pub is None:
            raise ScenarioError("the victim publishes no events")
        pub._buffer = collections.deque(pub._buffer, maxlen=steps)  # no public knob: see the module doc


async def _explain(s: aiohttp.ClientSession, base: str, tokens: list[int]) -> dict[str, Any]:
    async with s.post(f"{base}/v1/route/explain", json={"model": MODEL, "prompt": tokens}) as r:
        data: dict[str, Any] = await r.json()
        return data


def _cand(explain: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in explain["candidates"] if c["instance"] == name)


async def gap(res: Resources, cfg: GapConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    rng = random.Random(cfg.seed)

    def prompt(n: int = 200) -> list[int]:
        return [rng.randrange(100, 30_000) for _ in range(n)]

    figures: list[Figure] = []
    fleet: SimFleet = res.fleet(cfg.instances, seed=cfg.seed)
    async with fleet:
        g = await res.gateway(fleet)
        async with g, client() as s:
            gw = g.gateway
            victim, other = fleet.servers[0], fleet.servers[1]
            vsrc = SourceKey(victim.name, 0)
            await until(lambda: subscribed(g), 10, "subscriptions")
            a, b = prompt(), prompt()
            # Place A on the victim and B on another instance, straight to the engines.
            for srv, p in ((victim, a), (other, b)):
                st, _, _ = await completion(s, srv.url, p, max_tokens=2)
                if st != 200:
                    raise ScenarioError(f"warm-up request to {srv.name} failed: {st}")
            await until(lambda: _held(g, a, victim.name) > 0 and _held(g, b, other.name) > 0, 5, "warm index")
            _shrink_replay_buffer(victim, cfg.buffer_steps)
            # Lose more batches than the buffer keeps, then one batch gets through: the gap shows.
            await set_faults(s, victim.url, drop_rate=1.0)
            for _ in range(cfg.lost_requests):
                await completion(s, victim.url, prompt(48), max_tokens=1)
            await set_faults(s, victim.url, drop_rate=0.0)
            t0 = time.monotonic()
            await completion(s, victim.url, prompt(48), max_tokens=1)
            dt = await until(lambda: gw.indexer.trust(vsrc) is Trust.DEGRADED, 5, "degraded")
            dt = time.monotonic() - t0
            figures.append(
                at_most(
                    "gap older than the buffer: degraded after",
                    dt * 1e3,
                    cfg.degrade_within_s * 1e3,
                    unit="ms",
                    fmt="{:.0f}",
                )
            )
            ea, eb = await _explain(s, g.base, a), await _explain(s, g.base, b)
            va = _cand(ea, victim.name)
            others_exact = all(
                gw.indexer.trust(SourceKey(x.name, 0)) is Trust.EXACT
                for x in fleet.servers
                if x is not victim
            )
            figures.append(
                exactly("degraded instance: cache credit on its own blocks", va["cached_tokens"], 0)
            )
            figures.append(exactly("other instances: trust exact", others_exact, True))
            figures.append(
                exactly(
                    "other instance still routed on its cache",
                    (eb["choice"], eb["reason"]),
                    (other.name, "cache"),
                )
            )
            _, h, _ = await completion(s, g.base, b + prompt(8), max_tokens=1)
            figures.append(
                exactly(
                    "a request for B through the gateway: its holder",
                    h.get("x-kvrouter-instance"),
                    other.name,
                )
            )
            # Recovery 1: the engine clears its cache (AllBlocksCleared).
            t1 = time.monotonic()
            async with s.post(f"{victim.url}/reset_prefix_cache") as r:
                await r.read()
            # vLLM publishes the reset's AllBlocksCleared with its next step only: one sub-block request
            await completion(s, victim.url, [1], max_tokens=1)
            await until(lambda: gw.indexer.trust(vsrc) is Trust.EXACT, 5, "exact after clear")
            figures.append(
                at_most(
                    "recovered (exact) after the engine cleared",
                    (time.monotonic() - t1) * 1e3,
                    1000,
                    unit="ms",
                    fmt="{:.0f}",
                )
            )
            await completion(s, victim.url, a, max_tokens=2)
            await until(lambda: _held(g, a, victim.name) > 0, 5, "victim indexed again")
            va = _cand(await _explain(s, g.base, a), victim.name)
            figures.append(
                at_least("victim's cache credited again (tokens)", va["cached_tokens"], 1, fmt="{:.0f}")
            )
            # Recovery 2: degrade again, then the engine restarts (sequence from 0, empty cache).
            _shrink_replay_buffer(victim, cfg.buffer_steps)
            await set_faults(s, victim.url, drop_rate=1.0)
            for _ in range(cfg.lost_requests):
                await completion(s, victim.url, prompt(48), max_tokens=1)
            await set_faults(s, victim.url, drop_rate=0.0)
            await completion(s, victim.url, prompt(48), max_tokens=1)
            await until(lambda: gw.indexer.trust(vsrc) is Trust.DEGRADED, 5, "degraded again")
            t2 = time.monotonic()
            await set_faults(s, victim.url, crash=True, down_s=0.2)
            await until(lambda: not victim.instance.faults.crashed, 5, "victim restarted")
            await completion(s, victim.url, prompt(48), max_tokens=1)  # its first batch, seq 0
            await until(lambda: gw.indexer.trust(vsrc) is Trust.EXACT, 5, "exact after restart")
            figures.append(
                at_most(
                    "recovered (exact) after the engine restarted",
                    (time.monotonic() - t2) * 1e3,
                    2000,
                    unit="ms",
                    fmt="{:.0f}",
                )
            )
    return ScenarioResult(
        "gap", "Faults", "Gap older than the replay buffer", figures, time.perf_counter() - t_start
    )


def _held(g: GatewayProc, tokens: list[int], instance: str) -> int:
    res = g.gateway.indexer.lookup(tokens)
    return next((m.matched_blocks for m in res.instances if m.instance == instance), 0)
