"""An instance that hangs (accepts, never answers): timeouts free the client and the slot, and no queue
builds behind it.

::

    phase 1  victim: latency_s = 1 h (the request is read, the answer never starts)
             requests through the gateway (round-robin, per-instance cap max_in_flight)
             ──▶ first_byte_timeout ──▶ retried on another instance ──▶ 200
    phase 2  victim: engine stalled mid-stream (stall_s) ──▶ chunk_timeout ──▶ SSE error event + [DONE]
    after    in flight 0 on every target, capacity queue empty, the victim's handlers cancelled

Sampled every 10 ms meanwhile: the gateway's capacity queue and what it counts in flight per target.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from kvrouter.lab.reliability.crash import StreamOutcome, parse_sse
from kvrouter.lab.reliability.driver import Shot, one
from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_most, exactly
from kvrouter.lab.reliability.procs import metric
from kvrouter.lab.reliability.stack import MODEL, Resources, cancel_all, client, set_faults, until
from kvrouter.percentiles import quantile
from kvrouter.types import TargetKey


class HangConfig(msgspec.Struct, frozen=True):
    instances: int = 3
    requests: int = 40
    concurrency: int = 8
    first_byte_timeout_s: float = 1.0
    chunk_timeout_s: float = 1.0
    max_in_flight: int = 4
    """Per-instance cap: a hung instance holding its slots must not stall the others."""
    ejection_s: float = 1.0
    """The victim's /health keeps passing: its timeouts eject it for this long (``gateway.ejection_s``)."""


async def hang(res: Resources, cfg: HangConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    over = {
        "routing": {"policy": "round-robin"},
        "limits": {"max_in_flight": cfg.max_in_flight, "queue_size": 64, "queue_timeout_s": 30},
        "gateway": {
            "first_byte_timeout_s": cfg.first_byte_timeout_s,
            "chunk_timeout_s": cfg.chunk_timeout_s,
            "max_retries": 2,
            "ejection_s": cfg.ejection_s,
        },
    }
    fleet = res.fleet(cfg.instances)
    async with fleet:
        g = await res.gateway(fleet, over)
        async with g, client(timeout_s=60) as s:
            gw = g.gateway
            victim = fleet.servers[0]
            vkey = TargetKey(victim.name)
            waiting: list[int] = []
            victim_in_flight: list[int] = []

            async def sample() -> None:
                while True:
                    waiting.append(gw.pipeline.gate.waiting)
                    victim_in_flight.append(gw.router.load.get(vkey).in_flight)
                    await asyncio.sleep(0.01)

            sampler = asyncio.create_task(sample())
            try:
                # Phase 1: the victim accepts requests and never answers them.
                await set_faults(s, victim.url, latency_s=3600.0)
                shots = [Shot(sent=0.0) for _ in range(cfg.requests)]
                queue = list(range(cfg.requests))
                body = {"model": MODEL, "prompt": "is anybody there", "max_tokens": 2}

                async def worker() -> None:
                    while queue:
                        await one(s, f"{g.base}/v1/completions", body, shots[queue.pop()])

                await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
                await until(lambda: gw.router.load.total_in_flight() == 0, 5, "slots freed")
                retries = await metric(s, g.base, "kvrouter_retries_total")
                excused = await metric(s, g.base, "kvrouter_upstream_failures_excused_total")
                threshold = gw.pool.failure_threshold
                ejected = gw.pool.upstreams[victim.name].ejections
                await set_faults(s, victim.url, latency_s=0.0)
                await until(lambda: gw.pool.upstreams[victim.name].healthy, 5, "victim back in rotation")
                # Phase 2: a stream on the victim freezes (the engine stops stepping).
                outcome = await _stalled_stream(s, g.base, victim.url, victim.name, cfg)
                await until(lambda: gw.router.load.total_in_flight() == 0, 5, "stream slot freed")
                await set_faults(s, victim.url, stall_s=0.0)
                handlers = await _victim_requests(s, victim.url)
            finally:
                await cancel_all([sampler])
    lat = [sh.latency_s for sh in shots]
    bound = cfg.first_byte_timeout_s * 3 + 1.0
    figures: list[Figure] = [
        exactly(
            f"requests answered 200 (of {cfg.requests})", sum(sh.status == 200 for sh in shots), cfg.requests
        ),
        at_most("slowest request (a timeout, then a retry)", max(lat), bound, unit="s", fmt="{:.2f}"),
        Figure("latency p50 / p99", f"{quantile(lat, 0.5):.3f} / {quantile(lat, 0.99):.3f} s", "", None),
        Figure("retries on another instance after a timeout", str(int(retries)), "", None),
        # A timeout while the gateway's own loop stood still is excused (not the victim's fault): on a
        # loaded machine enough of them leave fewer than ``failure_threshold`` counted in a row.
        exactly(
            "victim ejected by its timeouts while its /health passed",
            ejected >= 1 or (excused > 0 and retries - excused < threshold),
            True,
        ),
        Figure("timeouts excused (the gateway's loop stood still)", str(int(excused)), "", None),
        at_most(
            "victim's slots held at once", max(victim_in_flight, default=0), cfg.max_in_flight, fmt="{:.0f}"
        ),
        exactly("requests waiting in the capacity queue (max)", max(waiting, default=0), 0),
        exactly(
            "stalled stream: error event + [DONE]",
            outcome.error_event and outcome.done and outcome.well_formed,
            True,
        ),
        exactly("requests still running on the victim afterwards", handlers, 0),
    ]
    return ScenarioResult(
        "hang", "Faults", "Instance hangs (accepts, never answers)", figures, time.perf_counter() - t_start
    )


async def _stalled_stream(
    s: aiohttp.ClientSession, base: str, victim_url: str, victim: str, cfg: HangConfig
) -> StreamOutcome:
    out = StreamOutcome()
    body = {
        "model": MODEL,
        "prompt": "stream then freeze",
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    for _ in range(cfg.instances * 4):  # round-robin: a few tries until the victim is chosen
        async with s.post(f"{base}/v1/completions", json=body) as r:
            if r.headers.get("x-kvrouter-instance") != victim:
                r.close()
                continue
            first = await r.content.readany()
            await set_faults(s, victim_url, stall_s=3600.0)
            t0 = time.monotonic()
            rest = await asyncio.wait_for(r.read(), cfg.chunk_timeout_s * 5 + 5)
            out.instance = victim
            parse_sse(first + rest, out)
            if time.monotonic() - t0 > cfg.chunk_timeout_s * 3 + 2:
                out.done = False  # it ended, but not because of the chunk timeout
            return out
    return out


async def _victim_requests(s: aiohttp.ClientSession, url: str) -> int:
    """Requests the victim's engines still hold (its handlers were cancelled when the gateway let go)."""
    await asyncio.sleep(0.3)
    async with s.get(f"{url}/sim/state") as r:
        state = await r.json()
    return sum(int(rank["in_flight"]) for rank in state["ranks"])
