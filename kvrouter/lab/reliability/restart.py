"""The router restarts under load: it comes back warm (snapshot, then replay of what it missed) and never
routes worse than least-loaded while warming.

::

    gateway A (port P) ── fills the caches; background load runs throughout ──▶ WarmRestart.stop: snapshot
    gateway B (port P) ── restore(snapshot) before subscribing ──▶ serve ──▶ on connect: replay from last
    gateway C (port Q) ── no snapshot: cold, replays each engine's buffer from 0
    probes on B and C the moment they serve: /v1/route/explain for a new question on every cached prefix;
    the true cached blocks of each choice (from the engines) against the best target's and least-loaded's

Both gateways run the fleet file's ``snapshot: {path: ...}``: the gateway restores before subscribing and
takes a last snapshot when it stops (``Gateway.start``/``stop``), exactly as ``kvrouter serve`` does.
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

from indexer import SourceKey, Trust
from kvrouter.lab.reliability.driver import Shot, one
from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_least, exactly
from kvrouter.lab.reliability.stack import (
    MODEL,
    GatewayProc,
    Resources,
    ScenarioError,
    client,
    completion,
    until,
)
from kvrouter.lab.sim.server.fleet import SimFleet


class RestartConfig(msgspec.Struct, frozen=True):
    instances: int = 3
    groups: int = 9
    """Shared prefixes (system prompts) cached before the restart."""
    prefix_tokens: int = 480
    background_rate: float = 20.0
    seed: int = 0


class ProbeScore(msgspec.Struct):
    probes: int = 0
    best: int = 0
    """Choices holding as many cached blocks as the best target."""
    not_worse_than_ll: int = 0
    """Choices holding at least what least-loaded's choice holds."""
    trusted: int = 0
    """Sources already exact or partial when probed."""


async def probe(
    s: aiohttp.ClientSession, g: GatewayProc, fleet: SimFleet, prompts: list[list[int]]
) -> ProbeScore:
    out = ProbeScore()
    truth = {srv.name: srv.instance.ranks[0].engine for srv in fleet.servers}
    out.trusted = sum(g.gateway.indexer.trust(SourceKey(srv.name, 0)).usable for srv in fleet.servers)
    for tokens in prompts:
        async with s.post(f"{g.base}/v1/route/explain", json={"model": MODEL, "prompt": tokens}) as r:
            d: dict[str, Any] = await r.json()
        held = {name: e.cached_prefix_blocks(tokens) for name, e in truth.items()}
        chosen = held.get(d["choice"], 0)
        ll = held.get(d["shadow"]["least-loaded"]["target"], 0)
        out.probes += 1
        out.best += chosen == max(held.values())
        out.not_worse_than_ll += chosen >= ll
    return out


async def restart(res: Resources, cfg: RestartConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    rng = random.Random(cfg.seed)
    prefixes = [[rng.randrange(100, 30_000) for _ in range(cfg.prefix_tokens)] for _ in range(cfg.groups)]

    def question(k: int) -> list[int]:
        return [*prefixes[k], *(rng.randrange(100, 30_000) for _ in range(24))]

    snap = Path(tempfile.mkdtemp(prefix="kvrouter-rel-")) / "index.snap"
    warm = {"snapshot": {"path": str(snap), "interval_s": 3600}}
    fleet = res.fleet(cfg.instances, seed=cfg.seed)
    async with fleet:
        a = await res.gateway(fleet, warm)
        port = a.port
        await a.start()
        shots: list[Shot] = []
        phase = {"down": (0.0, 0.0)}
        async with client() as s:
            for k in range(cfg.groups):  # fill: every prefix cached somewhere
                for _ in range(2):
                    st, _, _ = await completion(s, a.base, question(k), max_tokens=2)
                    if st != 200:
                        raise ScenarioError(f"fill request failed: {st}")
            ix_a = a.gateway.indexer
            await until(lambda: all(_held(ix_a, prefixes[k]) for k in range(cfg.groups)), 5, "filled index")
            stop = asyncio.Event()

            async def background() -> None:
                tasks = []
                url = f"http://127.0.0.1:{port}/v1/completions"
                while not stop.is_set():
                    shot = Shot(sent=time.monotonic())
                    shots.append(shot)
                    body = {"model": MODEL, "prompt": question(rng.randrange(cfg.groups)), "max_tokens": 2}
                    tasks.append(asyncio.create_task(one(s, url, body, shot)))
                    await asyncio.sleep(1 / cfg.background_rate)
                await asyncio.gather(*tasks)

            bg = asyncio.create_task(background())
            await asyncio.sleep(2.0)
            # Restart: a last snapshot, stop, a new gateway on the same port restored from it.
            t_down = time.monotonic()
            await a.stop()  # the gateway's last snapshot
            b = await res.gateway(fleet, warm, port=port)
            await b.start()  # restores, then subscribes: replay from each restored position
            t_up = time.monotonic()
            phase["down"] = (t_down, t_up)
            restored = await _restored_sources(s, b)
            c = await res.gateway(fleet)  # the cold comparison, started at the same moment
            await c.start()
            probes = [question(k) for k in range(cfg.groups)]
            warm_score = await probe(s, b, fleet, probes)
            cold_score = await probe(s, c, fleet, probes)
            exact_s = await until(
                lambda: all(
                    b.gateway.indexer.trust(SourceKey(x.name, 0)) is Trust.EXACT for x in fleet.servers
                ),
                10,
                "restored sources exact",
            )
            await asyncio.sleep(2.0)
            stop.set()
            await bg
            await c.stop()
            await b.stop()
    t_down, t_up = phase["down"]
    in_down = [sh for sh in shots if t_down <= sh.sent <= t_up + 0.05]
    outside = [sh for sh in shots if not t_down <= sh.sent <= t_up + 0.05]
    failed_outside = [sh for sh in outside if sh.status != 200 or sh.error]
    before = [sh for sh in outside if sh.sent < t_down and sh.status == 200]
    after = [sh for sh in outside if sh.sent > t_up and sh.status == 200]
    figures: list[Figure] = [
        Figure(
            "restart (last snapshot, stop, restore, subscribe, serve)", f"{(t_up - t_down) * 1e3:.0f} ms", ""
        ),
        exactly("started from the snapshot (restores ok)", restored, 1.0),
        exactly(f"requests failed outside the restart window (of {len(outside)})", len(failed_outside), 0),
        Figure(
            "requests refused during the restart window", str(sum(sh.status != 200 for sh in in_down)), ""
        ),
        exactly(
            f"warm: probes routed to the best-cached target (of {warm_score.probes})",
            warm_score.best,
            warm_score.probes,
        ),
        exactly(
            f"warm: probes no worse than least-loaded (of {warm_score.probes})",
            warm_score.not_worse_than_ll,
            warm_score.probes,
        ),
        exactly(
            f"cold: probes no worse than least-loaded (of {cold_score.probes})",
            cold_score.not_worse_than_ll,
            cold_score.probes,
        ),
        Figure(
            "cold: probes to the best-cached target / sources trusted when probed",
            f"{cold_score.best} of {cold_score.probes} / {cold_score.trusted} of {cfg.instances}",
            "",
        ),
        Figure("restored sources exact (replay of what was missed)", f"{exact_s * 1e3:.0f} ms", ""),
        at_least(
            "cached tokens per request, after the restart / before",
            _hit(after) / max(_hit(before), 1e-9),
            0.9,
            fmt="{:.2f}",
        ),
    ]
    return ScenarioResult(
        "restart", "Faults", "Router restart under load (snapshot)", figures, time.perf_counter() - t_start
    )


async def _restored_sources(s: aiohttp.ClientSession, g: GatewayProc) -> float:
    """Snapshots restored by the new gateway (its metric: 1 when it started from the snapshot)."""
    reg = g.gateway.metrics.registry
    return reg.get_sample_value("kvrouter_index_snapshots_total", {"op": "restore", "result": "ok"}) or 0.0


def _held(ix: Any, tokens: list[int]) -> bool:
    return any(m.matched_blocks for m in ix.lookup(tokens).instances)


def _hit(shots: list[Shot]) -> float:
    """Share of the prefix served from cache (reported by the engines), averaged over requests."""
    return sum(sh.cached_tokens for sh in shots) / max(1, len(shots))
