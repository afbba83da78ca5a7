"""CPU per request of the reliability suite's open-loop driver: aiohttp's client against the lean one.

Starts ``kvrouter sim`` (two instances, the ``test`` profile, no answer tokens), sends RATE completions per
second for 4 s straight to its first instance, alternately through aiohttp's ``ClientSession`` (the driver
before) and ``UpstreamHttp`` (the driver now), three rounds, and prints this process's CPU time per
request for each phase (one JSON line a phase).  Usage: ``python tools/driver_cost.py [RATE]`` (300).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import uvloop

from kvrouter.gateway.upstream_http import UpstreamHttp
from kvrouter.lab.reliability.driver import PromptMix, Shot, lean_one, one
from kvrouter.lab.reliability.procs import SimProcess


async def phase(kind: str, url: str, mix: PromptMix, rate: float, seconds: float) -> dict[str, object]:
    n = int(rate * seconds)
    shots: list[Shot] = []
    tasks: list[asyncio.Task[None]] = []
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30)
    )
    lean = UpstreamHttp(max_idle_per_host=4000)
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        delay = i / rate - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        shot = Shot(sent=0.0)
        shots.append(shot)
        if kind == "aiohttp":
            tasks.append(asyncio.create_task(one(session, url, mix.body(), shot)))
        else:
            tasks.append(asyncio.create_task(lean_one(lean, url, mix.body(), shot)))
    await asyncio.gather(*tasks)
    cpu = time.process_time() - c0
    await session.close()
    lean.close()
    lat = sorted(s.latency_s for s in shots)
    ok = sum(1 for s in shots if s.status == 200)
    return {
        "client": kind,
        "n": n,
        "ok": ok,
        "cpu_us": round(cpu / n * 1e6, 1),
        "p50_ms": round(lat[n // 2] * 1e3, 2),
    }


async def main(rate: float) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="driver-cost-"))
    with (workdir / "sim.log").open("wb") as log:
        sim = SimProcess(workdir, log, "--instances", "2", "--profile", "test", "--answer-tokens", "0")
        fleet = await sim.start()
        url = fleet["instances"][0]["url"] + "/v1/completions"
        mix = PromptMix(1)
        try:
            await phase("lean", url, mix, 100, 1)  # warm-up: connections, code paths
            for _ in range(3):
                for kind in ("aiohttp", "lean"):
                    print(json.dumps(await phase(kind, url, mix, rate, 4)), flush=True)
        finally:
            sim.stop()


if __name__ == "__main__":
    uvloop.run(main(float(sys.argv[1]) if len(sys.argv) > 1 else 300.0))
