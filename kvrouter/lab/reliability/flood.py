"""Event floods: a source publishing far faster than the indexer applies cannot starve the others or grow
its memory without bound (bounded queues, counted drops, then replay).

::

    flooder (process) ──PUB 100k+ batches/s──┐
    calm-0, calm-1 (this process, 1 block    ├──▶ kvrouter indexer (process) ◀── POST /v1/cache/lookup
       per batch, closed loop)  ─────────────┘       RSS sampled from /proc     (how long until a calm
                                                                                 source's block is seen)
    phases: baseline (no flood) ── flood ── after

Lag of a calm source = time from its publish to the lookup that first sees the block, through the
indexer's own HTTP API (so a starved event loop shows up as lag too).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_most, exactly, fig
from kvrouter.lab.reliability.procs import ServeProcess, metric, rss_mb, slope_per_min
from kvrouter.lab.reliability.stack import ScenarioError, free_port
from kvrouter.lab.sim.engine.events import BlockStored
from kvrouter.lab.sim.engine.types import BlockHash
from kvrouter.lab.sim.server.publisher import EventPublisher, PublisherConfig
from kvrouter.percentiles import quantile


class FloodConfig(msgspec.Struct, frozen=True):
    seconds: float = 30.0
    """Length of the flood."""
    baseline_s: float = 4.0
    cap: int = 200_000
    """``indexer.max_blocks_per_source``: the flooded source's blocks stop there (refusals counted)."""
    distinct: int = 30_000
    """Distinct flood batches (8 new blocks each) before they repeat: 240k blocks, above the cap."""
    lag_within_s: float = 0.5
    """A calm source's block must be visible this soon, p99, during the flood."""
    rss_slope_mb_min: float = 30.0
    """Allowed RSS growth over the second half of the flood (the cap makes it plateau)."""
    seed: int = 0


class Lags(msgspec.Struct):
    samples: list[float] = []
    missed: int = 0
    """Blocks not seen within 5 s."""


async def _calm(
    s: aiohttp.ClientSession,
    base: str,
    pub: EventPublisher,
    name: str,
    rng: random.Random,
    stop: asyncio.Event,
    lags: Lags,
) -> None:
    """Publish one new block, wait until the indexer shows it, record the lag; again until ``stop``."""
    while not stop.is_set():
        tokens = [rng.randrange(1, 30_000) for _ in range(16)]
        pub.publish([BlockStored([BlockHash(rng.getrandbits(63))], None, tokens, 16)])
        t0 = time.monotonic()
        while True:
            async with s.post(f"{base}/v1/cache/lookup", json={"token_ids": tokens}) as r:
                d = await r.json()
            if any(m["instance"] == name and m["matched_blocks"] for m in d["instances"]):
                lags.samples.append(time.monotonic() - t0)
                break
            if time.monotonic() - t0 > 5.0:
                lags.missed += 1
                break
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.02)


async def _phase(
    s: aiohttp.ClientSession, base: str, pubs: list[EventPublisher], seconds: float, rng: random.Random
) -> Lags:
    lags = Lags()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_calm(s, base, p, f"calm-{i}", rng, stop, lags)) for i, p in enumerate(pubs)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    return lags


async def flood(cfg: FloodConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    rng = random.Random(cfg.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvrouter-rel-flood-"))
    log = (workdir / "processes.log").open("wb")
    ports = {k: free_port() for k in ("flood", "flood_r", "c0", "c0_r", "c1", "c1_r")}
    pubs = [
        EventPublisher(
            PublisherConfig(
                endpoint=f"tcp://127.0.0.1:{ports[f'c{i}']}",
                replay_endpoint=f"tcp://127.0.0.1:{ports[f'c{i}_r']}",
            )
        )
        for i in range(2)
    ]
    fleet: dict[str, Any] = {
        "block_size": 16,
        "instances": [
            {
                "name": "flood",
                "events": f"tcp://127.0.0.1:{ports['flood']}",
                "replay": f"tcp://127.0.0.1:{ports['flood_r']}",
            },
            *(
                {
                    "name": f"calm-{i}",
                    "events": f"tcp://127.0.0.1:{ports[f'c{i}']}",
                    "replay": f"tcp://127.0.0.1:{ports[f'c{i}_r']}",
                }
                for i in range(2)
            ),
        ],
        "indexer": {"max_blocks_per_source": cfg.cap},
    }
    ix = ServeProcess("indexer", fleet, workdir, log, "indexer")
    flooder: subprocess.Popen[bytes] | None = None
    rss: list[tuple[float, float]] = []
    try:
        for p in pubs:
            await p.start()
        await ix.start(health="/health")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            await _wait_connected(s, ix.base)
            base_rss = rss_mb(ix.proc.pid)
            baseline = await _phase(s, ix.base, pubs, cfg.baseline_s, rng)
            batches0 = await metric(s, ix.base, "kvrouter_indexer_batches_total")
            argv = [
                sys.executable, "-m", "kvrouter.lab.reliability.flooder",
                "--endpoint", f"tcp://127.0.0.1:{ports['flood']}", "--replay", f"tcp://127.0.0.1:{ports['flood_r']}",
                "--seconds", str(cfg.seconds), "--distinct", str(cfg.distinct), "--seed", str(cfg.seed),
            ]  # fmt: skip
            flooder = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
            t0 = time.monotonic()

            async def sample() -> None:
                while True:
                    rss.append((time.monotonic() - t0, rss_mb(ix.proc.pid)))
                    await asyncio.sleep(0.5)

            sampler = asyncio.create_task(sample())
            await asyncio.sleep(2.0)  # the flooder builds its payloads, then floods
            during = await _phase(s, ix.base, pubs, max(1.0, cfg.seconds - 2.0), rng)
            out, _ = await asyncio.to_thread(flooder.communicate, timeout=cfg.seconds + 60)
            flood_s = time.monotonic() - t0
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            rep = json.loads(out.decode().strip().splitlines()[-1])
            applied = await metric(s, ix.base, "kvrouter_indexer_batches_total") - batches0
            await asyncio.sleep(2.0)
            after = await _phase(s, ix.base, pubs, cfg.baseline_s, rng)
            async with s.get(f"{ix.base}/v1/fleet") as r:
                sources = {x["instance"]: x for x in (await r.json())["sources"]}
            over_cap = await metric(
                s, ix.base, "kvrouter_indexer_event_errors_total", 'reason="source_over_capacity"'
            )
            alive = ix.proc.alive()
            end_rss = rss_mb(ix.proc.pid)
    finally:
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
        ix.stop()
        for p in pubs:
            await p.stop()
        log.close()
    half = [(t, v) for t, v in rss if t >= flood_s / 2]
    calm = [sources[f"calm-{i}"] for i in range(2)]
    fl = sources["flood"]
    flood_blocks = sum(fl["blocks"].values())
    figures: list[Figure] = [
        fig(
            "flood published / applied by the indexer",
            f"{rep['batches'] / rep['seconds']:,.0f} / {applied / flood_s:,.0f} batches/s",
        ),
        Figure(
            "calm sources' lag p50 / p99: before / during / after the flood",
            " / ".join(
                f"{quantile(x.samples, 0.5) * 1e3:.0f}-{quantile(x.samples, 0.99) * 1e3:.0f} ms"
                for x in (baseline, during, after)
            ),
            "",
        ),
        at_most(
            "calm sources' lag p99 during the flood",
            quantile(during.samples, 0.99) * 1e3,
            cfg.lag_within_s * 1e3,
            unit="ms",
            fmt="{:.0f}",
        ),
        exactly(
            "calm blocks never seen (of all published)", baseline.missed + during.missed + after.missed, 0
        ),
        exactly(
            "calm sources: trust / unfilled gaps",
            [(c["trust"], c["unfilled_gaps"]) for c in calm],
            [("exact", 0), ("exact", 0)],
        ),
        fig(
            "flooded source: gaps / replays / dropped while replaying / over the cap",
            f"{fl['gaps']} / {fl['replays']} / {fl['dropped_pending']} / {int(over_cap)} ({fl['trust']})",
        ),
        at_most("flooded source's blocks (cap)", flood_blocks, cfg.cap, fmt="{:,.0f}"),
        fig(
            "indexer RSS: before / peak / end",
            f"{base_rss:.0f} / {max(v for _, v in rss):.0f} / {end_rss:.0f} MB",
        ),
        at_most(
            "RSS growth over the flood's second half",
            slope_per_min(half),
            cfg.rss_slope_mb_min,
            unit="MB/min",
            fmt="{:.1f}",
        ),
        exactly("indexer alive", alive, True),
    ]
    return ScenarioResult(
        "flood", "Faults", f"Event flood ({cfg.seconds:.0f} s)", figures, time.perf_counter() - t_start
    )


async def _wait_connected(s: aiohttp.ClientSession, base: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        async with s.get(f"{base}/v1/fleet") as r:
            src = (await r.json())["sources"]
        if src and all(x["connected"] for x in src if x["instance"].startswith("calm")):
            return
        await asyncio.sleep(0.05)
    raise ScenarioError("the indexer did not connect to the calm sources")
