"""The issue's scenario, live: two tenants by API key in front of a simulated 2-instance fleet with
``max_in_flight: 2``, through ``kvrouter serve --workers N`` (or ``--replicas R`` such routers sharing a
redis-server, each tenant's clients spread over them); the calm tenant's latency alone and while the
other tenant floods with many concurrent clients, once per fairness mode (``fifo``: one queue in arrival
order, the router before flows; ``work``: fair shares of work; ``work+quiet``: ``work`` with one of the
two instances kept from heavy flows, ``limits.isolation``).

    python -m kvrouter.lab.flows_live [--workers 1] [--replicas 1] [--flood 32] [--requests 40]
                                      [--modes fifo,work]

Prints one line per mode and phase (p50 and p90 of the calm tenant's request latency, the flood's
answers) and, with ``--json``, writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.lab.reliability.procs import RedisProcess
from kvrouter.percentiles import quantile

KEYS = {"sk-calm": {"name": "calm"}, "sk-flood": {"name": "flood"}}


def _nice() -> list[str]:
    return ["nice", "-n", "5"]


async def _until_up(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(1200):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} did not come up")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextlib.asynccontextmanager
async def _serve(fleet: dict[str, Any], tmp: Path, port: int, workers: int) -> AsyncIterator[str]:
    path = tmp / f"fleet-{port}.yaml"
    path.write_text(yaml.safe_dump(fleet))
    cmd = [*_nice(), sys.executable, "-m", "kvrouter.cli", "--log-level", "WARNING", "serve"]
    cmd += ["--fleet", str(path), "--port", str(port), "--workers", str(workers)]
    log = open(tmp / f"serve-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        await _until_up(base + "/livez", proc, "kvrouter serve")
        yield base
    finally:
        _stop(proc)
        log.close()


async def _one(s: aiohttp.ClientSession, base: str, key: str, i: int) -> tuple[int, float]:
    body = {
        "model": "sim-model",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": f"request {i} from {key}: say something"}],
    }
    t0 = time.perf_counter()
    async with s.post(
        base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        await r.read()
        return r.status, time.perf_counter() - t0


async def _calm(bases: list[str], n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            st, dt = await _one(s, bases[i % len(bases)], "sk-calm", i)
            if st == 200:
                out.append(dt)
    return out


async def _phase(bases: list[str], n: int, flood: int) -> dict[str, Any]:
    stop = asyncio.Event()
    statuses: dict[int, int] = {}

    async def flooder(k: int) -> None:
        async with aiohttp.ClientSession() as s:
            i = 0
            while not stop.is_set():
                st, _ = await _one(s, bases[k % len(bases)], "sk-flood", k * 100_000 + i)
                statuses[st] = statuses.get(st, 0) + 1
                i += 1

    tasks = [asyncio.create_task(flooder(k)) for k in range(flood)]
    if flood:
        while sum(statuses.values()) < flood:  # the flood is under way
            await asyncio.sleep(0.05)
    lat = await _calm(bases, n)
    stop.set()
    await asyncio.gather(*tasks)
    heavy = 0.0
    async with aiohttp.ClientSession() as s:
        for b in bases:
            async with s.get(b + "/metrics") as r:
                for fam in text_string_to_metric_families(await r.text()):
                    heavy += sum(x.value for x in fam.samples if x.name == "kvrouter_flow_heavy_total")
    return {
        "heavy_admitted": heavy,
        "calm_answered": len(lat),
        "calm_p50_ms": round(quantile(lat, 0.5) * 1e3, 1),
        "calm_p90_ms": round(quantile(lat, 0.9) * 1e3, 1),
        "flood_statuses": statuses,
    }


async def run(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        redis_url = None
        if a.replicas > 1:  # the replicas' store, killed on the way out
            redis = RedisProcess(stack.enter_context(open(tmp / "redis.log", "wb")), tmp, a.redis_port)
            await redis.start()
            stack.callback(redis.kill)
            redis_url = redis.url
        fleet_file = tmp / "sim.yaml"
        sim_cmd = [*_nice(), sys.executable, "-m", "kvrouter.cli", "sim", "--instances", "2"]
        sim_cmd += ["--profile", a.profile, "--fleet-out", str(fleet_file), "--base-port", str(a.sim_port)]
        sim = subprocess.Popen(sim_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(1200):
                if fleet_file.exists() or sim.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            base_fleet = yaml.safe_load(fleet_file.read_text())
            for k, mode in enumerate(m for m in a.modes.split(",") if m):
                fairness, _, quiet = mode.partition("+")
                limits: dict[str, Any] = {
                    "max_in_flight": 2,
                    "queue_size": 1024,
                    "queue_timeout_s": 60,
                    # both tenants are priority 0: the reserve is kept for a flow with nothing waiting
                    "saturation": {"reserve": a.reserve, "reserved_priority": 0},
                }
                if quiet:  # one of the two instances kept from the flooding tenant once it is heavy
                    limits["isolation"] = {"quiet_share": 0.5}
                fleet = {
                    **base_fleet,
                    "tenants": {"api_keys": KEYS},
                    "limits": limits,
                    "flows": {"fairness": fairness},
                }
                async with contextlib.AsyncExitStack() as routers:
                    bases = []
                    for r in range(a.replicas):
                        if redis_url is not None:
                            ns = f"live-{mode.replace('+', '-')}"
                            rep = {"redis_url": redis_url, "namespace": ns, "replica_id": f"r{r}"}
                            fleet = {**fleet, "replicas": rep}
                        port = a.port + 10 * k + r
                        bases.append(await routers.enter_async_context(_serve(fleet, tmp, port, a.workers)))
                    await _calm(bases, 5)  # warm: tokenizer, connections
                    alone = await _phase(bases, a.requests, 0)
                    flooded = await _phase(bases, a.requests, a.flood)
                out[mode] = {"alone": alone, "flood": flooded}
                ratio = flooded["calm_p90_ms"] / alone["calm_p90_ms"]
                print(
                    f"{mode:<10} calm p90 alone {alone['calm_p90_ms']:7.1f} ms   under a {a.flood}-client "
                    f"flood {flooded['calm_p90_ms']:7.1f} ms ({ratio:.1f}x)   "
                    f"flood answers {flooded['flood_statuses']}, "
                    f"admitted heavy {flooded['heavy_admitted']:.0f}",
                    flush=True,
                )
        finally:
            _stop(sim)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1, help="routers sharing a redis-server (started here)")
    p.add_argument("--redis-port", type=int, default=18500)
    p.add_argument("--flood", type=int, default=32, help="concurrent clients of the flooding tenant")
    p.add_argument("--requests", type=int, default=40, help="the calm tenant's requests per phase")
    p.add_argument("--modes", default="fifo,work")
    p.add_argument(
        "--reserve", type=float, default=0.0, help="limits.saturation.reserve (fifo may fill it too)"
    )
    p.add_argument("--profile", default="test")
    p.add_argument("--port", type=int, default=18300)
    p.add_argument("--sim-port", type=int, default=18400)
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    res = asyncio.run(run(a))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
