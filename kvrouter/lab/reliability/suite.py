"""The registry of scenarios and the runner ``kvrouter reliability`` (and the slow tests) call.

::

    SCENARIOS[name] = Scenario(area, in_process, run(res, quick) -> ScenarioResult)
    run_suite(names, quick) ──▶ one Resources (tokenizer loaded once) for the in-process scenarios,
                                each scenario bounded by its timeout; a failure or a timeout is a failed
                                row with the reason, never the end of the run

Quick settings are what ``make test`` can afford (seconds per scenario); full ones are the figures the
docs/reliability.md quotes (100,000 fuzzed payloads, 5 event-loss trials, 60 s of sustained load).
"""

from __future__ import annotations

import asyncio
import gc
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import TextIO

import msgspec

from kvrouter.lab.reliability.crash import CrashConfig, crash
from kvrouter.lab.reliability.event_fuzz import EventFuzzConfig, event_fuzz_result
from kvrouter.lab.reliability.event_loss import EventLossConfig, event_loss
from kvrouter.lab.reliability.figures import ScenarioResult
from kvrouter.lab.reliability.flood import FloodConfig, flood
from kvrouter.lab.reliability.gap import GapConfig, gap
from kvrouter.lab.reliability.hang import HangConfig, hang
from kvrouter.lab.reliability.http_fuzz import HttpFuzzConfig, http_fuzz
from kvrouter.lab.reliability.load import LoadConfig, load
from kvrouter.lab.reliability.redis_outage import RedisOutageConfig, redis_outage
from kvrouter.lab.reliability.restart import RestartConfig, restart
from kvrouter.lab.reliability.security import access_control, log_hygiene
from kvrouter.lab.reliability.stack import Resources
from kvrouter.lab.reliability.tenants import TenantConfig, tenants
from kvrouter.loop_lag import LoopLag

Run = Callable[[Resources, bool], Awaitable[ScenarioResult]]


class Scenario(msgspec.Struct, frozen=True):
    area: str
    title: str
    run: Run
    timeout_s: float
    """Full-run bound; quick runs get a third of it (at least 60 s)."""
    in_process: bool = True
    """Needs the shared ``Resources`` (simulated fleets and gateways in this process)."""


async def _event_fuzz(res: Resources, quick: bool) -> ScenarioResult:
    return event_fuzz_result(
        EventFuzzConfig(payloads=5_000 if quick else 100_000, huge_every=2500 if quick else 4000)
    )


async def _http_fuzz(res: Resources, quick: bool) -> ScenarioResult:
    return await http_fuzz(res, HttpFuzzConfig(examples=400 if quick else 3000))


async def _event_loss(res: Resources, quick: bool) -> ScenarioResult:
    return await event_loss(res, EventLossConfig(trials=1, requests=80) if quick else EventLossConfig())


async def _gap(res: Resources, quick: bool) -> ScenarioResult:
    return await gap(res, GapConfig())


async def _crash(res: Resources, quick: bool) -> ScenarioResult:
    cfg = CrashConfig(streams=6, stream_tokens=1500, down_s=2.0) if quick else CrashConfig()
    return await crash(res, cfg)


async def _hang(res: Resources, quick: bool) -> ScenarioResult:
    return await hang(res, HangConfig(requests=24) if quick else HangConfig())


async def _restart(res: Resources, quick: bool) -> ScenarioResult:
    return await restart(
        res, RestartConfig(groups=6, background_rate=30) if quick else RestartConfig(background_rate=50)
    )


async def _redis(res: Resources, quick: bool) -> ScenarioResult:
    return await redis_outage(res, RedisOutageConfig(bursts=3) if quick else RedisOutageConfig())


async def _flood(res: Resources, quick: bool) -> ScenarioResult:
    return await flood(FloodConfig(seconds=8.0, baseline_s=2.0) if quick else FloodConfig())


async def _load(res: Resources, quick: bool) -> ScenarioResult:
    quick_cfg = LoadConfig(
        step_s=3.0, direct_s=4.0, sustain_s=10.0, overload_s=5.0, recovery_s=4.0, workers=res.workers
    )
    cfg = quick_cfg if quick else LoadConfig(workers=res.workers)
    if res.sustain_s is not None:
        cfg = msgspec.structs.replace(cfg, sustain_s=res.sustain_s)
    return await load(cfg)


async def _tenants(res: Resources, quick: bool) -> ScenarioResult:
    return await tenants(res, TenantConfig(prompts=4) if quick else TenantConfig())


async def _logs(res: Resources, quick: bool) -> ScenarioResult:
    return await log_hygiene(res)


async def _access(res: Resources, quick: bool) -> ScenarioResult:
    return await access_control(res)


SCENARIOS: dict[str, Scenario] = {
    "event-fuzz": Scenario("Bad input", "Event decoder + index fuzz", _event_fuzz, 600, in_process=False),
    "http-fuzz": Scenario("Bad input", "HTTP API fuzz", _http_fuzz, 600),
    "event-loss": Scenario("Faults", "Event loss with replay", _event_loss, 300),
    "gap": Scenario("Faults", "Gap older than the replay buffer", _gap, 120),
    "crash": Scenario("Faults", "Instance crash mid-stream", _crash, 180),
    "hang": Scenario("Faults", "Instance hangs", _hang, 120),
    "restart": Scenario("Faults", "Router restart under load", _restart, 180),
    "redis": Scenario("Faults", "Redis gone and back", _redis, 240),
    "flood": Scenario("Faults", "Event flood", _flood, 300, in_process=False),
    "tenants": Scenario("Security", "Tenant isolation", _tenants, 120),
    "log-hygiene": Scenario("Security", "Log hygiene", _logs, 120),
    "access": Scenario("Security", "Admin token and API keys", _access, 60),
    "load": Scenario("Load", "Sustained load and overload", _load, 900, in_process=False),
}
"""Run order: the in-process scenarios first, the load last (it wants the machine to itself)."""


async def run_one(name: str, res: Resources, *, quick: bool) -> ScenarioResult:
    sc = SCENARIOS[name]
    timeout = max(60.0, sc.timeout_s / 3) if quick else sc.timeout_s
    t0 = time.perf_counter()
    lag = LoopLag()
    if sc.in_process:
        # What went before (the tokenizer, earlier scenarios' survivors) out of the collector's way, as
        # ``kvrouter serve`` freezes its start-up heap: a full collection of this process's heap stood
        # the whole stack still for up to seconds, and the scenarios here time what the stack does.
        gc.collect()
        gc.freeze()
        lag.start()
    try:
        async with asyncio.timeout(timeout):
            r = await sc.run(res, quick)
        if sc.in_process:
            r.notes.append(
                f"event loop (the stack's and the driver's): longest stall {lag.max_s * 1e3:.0f} ms"
            )
        return r
    except TimeoutError:
        err = f"did not finish in {timeout:.0f} s"
    except Exception as e:  # a scenario that breaks is a failed row, and the suite goes on
        err = f"{type(e).__name__}: {e}"
        tb = traceback.format_exc(limit=4)
        return ScenarioResult(
            name, sc.area, sc.title, seconds=time.perf_counter() - t0, error=err, notes=[tb]
        )
    finally:
        lag.stop()
    return ScenarioResult(name, sc.area, sc.title, seconds=time.perf_counter() - t0, error=err)


async def run_suite(
    names: list[str] | None = None,
    *,
    quick: bool = False,
    progress: TextIO | None = None,
    workers: int | None = None,
    sustain_s: float | None = None,
) -> list[ScenarioResult]:
    """Run the named scenarios (all by default) in registry order; ``workers``: ``kvrouter serve
    --workers`` where the gateway runs as a process (None: serve's default); ``sustain_s``: the load
    scenario's sustained run (None: its default, 60 s)."""
    chosen = [n for n in SCENARIOS if names is None or n in names]
    out = []
    res = Resources(workers, sustain_s)
    if any(SCENARIOS[n].in_process for n in chosen):
        await res.open()  # the tokenizer: seconds, so only when a scenario needs it
    try:
        for name in chosen:
            if progress is not None:
                print(f"[reliability] {name} ...", file=progress, flush=True)
            r = await run_one(name, res, quick=quick)
            out.append(r)
            if progress is not None:
                state = "ok" if r.ok else "FAILED"
                print(f"[reliability] {name}: {state} in {r.seconds:.0f} s", file=progress, flush=True)
    finally:
        res.close()
    return out
