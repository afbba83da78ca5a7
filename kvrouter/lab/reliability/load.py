"""Load: the highest rate this machine holds through the gateway, sustained; then twice that.

::

    kvrouter sim (process, N instances) ◀── kvrouter serve (process) ◀── open-loop driver (this process)
                                               └─ /proc (tree): PSS, sockets; /metrics: tasks per worker
    1 ramp        rate x1.4 per step until a step fails (errors, 429, falling behind, p99 too high): R
    2 direct      R straight to the instances: the latency without the gateway
    3 sustained   R for warm_s, then R for sustain_s: zero errors, p99 added latency, memory trend
    4 idle        the gateway's sockets and tasks back where they were
    5 overload    2R, then 4R: 200 or 429 + Retry-After, no other answer
    6 recovery    R/2: how soon the 429s stop and latency is back

Everything binds 127.0.0.1; every phase is bounded in time and in outstanding requests (docs/reliability.md,
"The scenarios").
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvrouter.gateway.upstream_http import UpstreamHttp
from kvrouter.lab.reliability.driver import PromptMix, Shot, error_kinds, open_loop, summary
from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_least, at_most, exactly, fig
from kvrouter.lab.reliability.overload import overload_figures, reasons, rejections
from kvrouter.lab.reliability.procs import (
    ServeProcess,
    SimProcess,
    metric_per_worker,
    slope_per_min,
    tcp_connections,
    tree_pids,
    tree_pss_mb,
)
from kvrouter.lab.reliability.stack import ScenarioError, merge
from kvrouter.percentiles import quantile


class LoadConfig(msgspec.Struct, frozen=True):
    instances: int = 4
    start_rate: float = 50.0
    max_rate: float = 3000.0
    step_s: float = 4.0
    """Length of each ramp step."""
    hold_p99_ms: float = 200.0
    """A rate holds if its p99 stays under this (and nothing fails, nothing falls behind)."""
    direct_s: float = 8.0
    sustain_s: float = 60.0
    sustain_retries: int = 3
    """Steps down (x0.75 each) when the sustained run at the ramp's rate is not clean."""
    overload_s: float = 15.0
    overload: tuple[int, ...] = (2, 4)
    """Overload phases, as multiples of R."""
    warm_s: float = 20.0
    """At R before the sustained run (not measured): each worker's first contact with traffic."""
    recovery_s: float = 10.0
    idle_s: float = 3.0
    """Wait after the load before counting connections and tasks again."""
    admission_s: float = 0.5
    """``limits.max_requests`` = this many seconds of requests at R: what the gateway holds under overload."""
    rss_slope_mb_min: float = 5.0
    fleet_slots: int = 2
    """Fleet-bound overload: ``limits.max_in_flight`` per instance ..."""
    fleet_latency_s: float = 0.1
    """... each request held this long by the instance (latency fault): capacity slots x instances / this."""
    fleet_queue: int = 32
    """``limits.queue_size`` of the fleet-bound part; ``queue_timeout_s`` 1 s."""
    seed: int = 0
    workers: int | None = None
    """``kvrouter serve --workers`` (None: serve's default, the machine's cores)."""


MAX_OUTSTANDING = 4000
"""Requests the driver keeps outstanding at most (past it: ``client_overload``); idle connections too."""


class Phase(msgspec.Struct):
    name: str
    rate: float
    seconds: float
    stats: dict[str, float]
    errors: dict[str, int] = msgspec.field(default_factory=dict)
    """Failed requests by kind (``driver.error_kinds``)."""


async def _phase(
    urls: list[str], rate: float, seconds: float, mix: PromptMix, name: str
) -> tuple[Phase, list[Shot]]:
    client = UpstreamHttp(max_idle_per_host=MAX_OUTSTANDING)
    try:
        shots = await open_loop(client, urls, rate, seconds, mix.body, max_outstanding=MAX_OUTSTANDING)
    finally:
        client.close()
    return Phase(name, rate, seconds, summary(shots, seconds), error_kinds(shots)), shots


def _holds(p: Phase, cfg: LoadConfig) -> bool:
    st = p.stats
    return (
        st["errors"] == 0
        and st["r429"] == 0
        and st["rate_ok"] >= 0.97 * p.rate
        and st["p99_ms"] <= cfg.hold_p99_ms
    )


class Gauges(msgspec.Struct, frozen=True):
    pss_mb: float
    """The gateway's process tree (``procs.tree_pss_mb``)."""
    client_conns: int
    """Open connections from clients."""
    upstream_conns: int
    """Connections to the instances (aiohttp's pool: bounded by the peak concurrency, kept alive)."""
    close_wait: int
    """Sockets the peer closed and the gateway never did: the signature of a leak."""
    tasks: float


TASK_SAMPLES = 5
"""Counts of the gateway's event-loop tasks taken for one gauge (the least is kept)."""


async def _gauges(gw: ServeProcess, instance_ports: set[int]) -> Gauges:
    """Over the gateway's process tree (its workers, with ``--workers``): connections counted before the
    scrapes (each on a connection of its own, closed after it), tasks summed over the workers.

    Tasks are the least of ``TASK_SAMPLES`` counts 0.2 s apart: a round of health checks or metric scrapes
    holds one short task per instance while it runs, and a count taken during one (in any worker) shows
    them; a leaked task stays in every count."""
    pids = tree_pids(gw.proc.pid)
    conns = [c for p in pids for c in tcp_connections(p)]
    live = [c for c in conns if c.state in ("ESTABLISHED", "CLOSE_WAIT")]
    counts = []
    for k in range(TASK_SAMPLES):
        if k:
            await asyncio.sleep(0.2)
        per_worker = await metric_per_worker(gw.base, "kvrouter_event_loop_tasks", max(1, len(pids) - 1))
        counts.append(sum(per_worker.values()))
    return Gauges(
        tree_pss_mb(gw.proc.pid),
        sum(1 for c in live if c.local_port == gw.port),
        sum(1 for c in live if c.remote_port in instance_ports),
        sum(1 for c in conns if c.state == "CLOSE_WAIT"),
        min(counts),
    )


async def load(cfg: LoadConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="kvrouter-rel-load-"))
    log = (workdir / "processes.log").open("wb")
    sim = SimProcess(
        workdir, log, "--instances", str(cfg.instances), "--profile", "test", "--answer-tokens", "0"
    )
    mix = PromptMix(cfg.seed)
    phases: list[Phase] = []
    gw: ServeProcess | None = None
    try:
        fleet = await sim.start()
        fast = {"gateway": {"health_interval_s": 0.5, "metrics_interval_s": 0.5}}
        gw = ServeProcess(
            "serve", merge(fleet, {**fast, "limits": {"max_requests": 0}}), workdir, log, "ramp", cfg.workers
        )
        await gw.start()
        gw_url = [f"{gw.base}/v1/completions"]
        await _phase(gw_url, cfg.start_rate, 2.0, mix, "warm-up")
        # 1. ramp
        rate, best = cfg.start_rate, 0.0
        while rate <= cfg.max_rate:
            p, _ = await _phase(gw_url, rate, cfg.step_s, mix, f"ramp {rate:.0f}/s")
            phases.append(p)
            if not _holds(p, cfg):
                # One more try: a step can fail on a hiccup of this shared machine, not on the rate.
                await asyncio.sleep(1.0)
                p, _ = await _phase(gw_url, rate, cfg.step_s, mix, f"ramp {rate:.0f}/s again")
                phases.append(p)
                if not _holds(p, cfg):
                    break
            best = rate
            rate = math.floor(rate * 1.4)
        if not best:
            raise ScenarioError(f"not even {cfg.start_rate:.0f} requests/s held: {phases[-1].stats}")
        r = best
        gw.stop()
        # 2. the same rate straight to the instances
        direct_urls = [f"{i['url']}/v1/completions" for i in fleet["instances"]]
        direct, _ = await _phase(direct_urls, r, cfg.direct_s, mix, "direct")
        phases.append(direct)
        # 3. sustained, with an admission limit worth admission_s of requests at R
        cap = max(16, math.ceil(r * cfg.admission_s))
        gw = ServeProcess(
            "serve",
            merge(fleet, {**fast, "limits": {"max_requests": cap, "max_loop_lag_s": 0.025}}),
            workdir,
            log,
            "gateway",
            cfg.workers,
        )
        await gw.start()
        gw_url = [f"{gw.base}/v1/completions"]
        await _phase(gw_url, min(r, cfg.start_rate), 2.0, mix, "warm-up")
        await _phase(gw_url, r, cfg.warm_s, mix, "warm-up at R")
        ports = {int(i["url"].rsplit(":", 1)[1]) for i in fleet["instances"]}
        pid = gw.proc.pid
        await asyncio.sleep(2.0)
        before = await _gauges(gw, ports)
        samples: list[tuple[float, float]] = []
        t0 = time.monotonic()

        async def sample() -> None:
            while True:
                samples.append((time.monotonic() - t0, tree_pss_mb(pid)))
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        sustained, _ = await _phase(gw_url, r, cfg.sustain_s, mix, "sustained")
        tries = 0
        while (sustained.stats["errors"] or sustained.stats["r429"]) and tries < cfg.sustain_retries:
            # A few seconds of a ramp step can hold a rate that 60 s cannot (this machine is shared,
            # and the collector runs): the highest rate held for the whole run is lower.  Step down.
            phases.append(sustained)
            tries += 1
            r = math.floor(0.75 * r)
            await asyncio.sleep(2.0)
            samples.clear()
            t0 = time.monotonic()
            sustained, _ = await _phase(gw_url, r, cfg.sustain_s, mix, f"sustained again at {r}/s")
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        phases.append(sustained)
        # 4. idle: pooled connections expire, nothing else may stay
        await asyncio.sleep(cfg.idle_s)
        after = await _gauges(gw, ports)
        # 5. overload at 2R and 4R, each followed by a pause at R/2 (the backlog of one is not the next's)
        overloads: list[tuple[Phase, list[Shot], dict[str, float]]] = []
        for k in cfg.overload:
            seen = await rejections(gw)
            over, over_shots = await _phase(gw_url, k * r, cfg.overload_s, mix, f"overload {k}R")
            now = await rejections(gw)
            overloads.append((over, over_shots, {k: v - seen.get(k, 0.0) for k, v in now.items()}))
            phases.append(over)
            await _phase(gw_url, r / 2, 3.0, mix, "pause")
        # 6. recovery at R/2
        rec, rec_shots = await _phase(gw_url, r / 2, cfg.recovery_s, mix, "recovery R/2")
        phases.append(rec)
        peak_rss = tree_pss_mb(gw.proc.pid)
        # 7. the same with the fleet as the bottleneck (as with GPUs): per-instance caps and the queue
        gw.stop()
        limits = {"max_in_flight": cfg.fleet_slots, "queue_size": cfg.fleet_queue, "queue_timeout_s": 1.0}
        gw = ServeProcess(
            "serve", merge(fleet, {**fast, "limits": limits}), workdir, log, "fleet-bound", cfg.workers
        )
        await gw.start()
        gw_url = [f"{gw.base}/v1/completions"]
        capacity = cfg.instances * cfg.fleet_slots / cfg.fleet_latency_s
        fleet_phases = await _fleet_bound(fleet, gw_url, capacity, cfg, mix)
        phases.extend(p for p, _ in fleet_phases)
    finally:
        if gw is not None:
            gw.stop()
        sim.stop()
        log.close()
    figures = _figures(cfg, r, phases, direct, sustained, rec_shots, samples, before, after, peak_rss)
    for over, over_shots, _ in overloads:
        figures += overload_figures(r, cap, over.rate, over.stats, over_shots, cfg.hold_p99_ms / 1e3)
    figures += _fleet_figures(capacity, fleet_phases)
    notes = [f"{p.name}: {_brief(p.stats, p.errors)}" for p in phases]
    notes += [f"{o.name}: gateway refusals by reason: {reasons(why)}" for o, _, why in overloads]
    return ScenarioResult(
        "load",
        "Load",
        f"Sustained load {cfg.sustain_s:.0f} s, then {' and '.join(f'{k}x' for k in cfg.overload)}",
        figures,
        time.perf_counter() - t_start,
        notes=notes,
    )


async def _fleet_bound(
    fleet: dict[str, Any], urls: list[str], capacity: float, cfg: LoadConfig, mix: PromptMix
) -> list[tuple[Phase, list[Shot]]]:
    """Half the fleet's capacity, twice it, half again, with each instance holding requests a while."""
    async with aiohttp.ClientSession() as s:
        for inst in fleet["instances"]:
            async with s.post(f"{inst['url']}/sim/faults", json={"latency_s": cfg.fleet_latency_s}) as r:
                await r.read()
        try:
            out = [await _phase(urls, capacity / 2, cfg.direct_s, mix, "fleet-bound C/2")]
            out.append(await _phase(urls, 2 * capacity, cfg.overload_s, mix, "fleet-bound 2C"))
            out.append(await _phase(urls, capacity / 2, cfg.recovery_s, mix, "fleet-bound recovery C/2"))
        finally:
            for inst in fleet["instances"]:
                async with s.post(f"{inst['url']}/sim/faults", json={"latency_s": 0.0}) as r:
                    await r.read()
    return out


def _fleet_figures(capacity: float, phases: list[tuple[Phase, list[Shot]]]) -> list[Figure]:
    (base, _), (over, shots), (_, rec_shots) = phases
    o = over.stats
    rejected = [sh.latency_s * 1e3 for sh in shots if sh.status == 429]
    admitted = [sh.latency_s for sh in shots if sh.status == 200]
    return [
        fig(
            f"fleet-bound overload at {2 * capacity:.0f} req/s (2x capacity): 200 / 429 / other",
            f"{o['ok']:.0f} / {o['r429']:.0f} / {o['errors']:.0f}",
        ),
        exactly("fleet-bound: errors other than 429", int(o["errors"]), 0),
        at_least("fleet-bound: 429s", o["r429"], 1, fmt="{:.0f}"),
        at_most("fleet-bound: 429 answer time p99", quantile(rejected, 0.99), 100.0, unit="ms", fmt="{:.1f}"),
        at_most(
            "fleet-bound: admitted p99 (queue timeout 1 s)",
            quantile(admitted, 0.99),
            1.0 + 1.0,
            unit="s",
            fmt="{:.2f}",
        ),
        at_most(
            "fleet-bound: recovered after the load dropped",
            _recovered_after(rec_shots, base.stats["p99_ms"]),
            2.0,
            unit="s",
            fmt="{:.2f}",
        ),
    ]


def _brief(st: dict[str, float], kinds: dict[str, int] | None = None) -> str:
    errs = f" ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})" if kinds else ""
    return (
        f"ok {st['ok']:.0f}/{st['sent']:.0f}, errors {st['errors']:.0f}{errs}, 429 {st['r429']:.0f}, "
        f"p50 {st['p50_ms']:.1f} ms, p99 {st['p99_ms']:.1f} ms"
    )


def _recovered_after(shots: list[Shot], base_p99_ms: float) -> float:
    """Seconds into the recovery phase until the first whole second with no 429 and a p99 back under twice
    the sustained phase's."""
    if not shots:
        return float("nan")
    end = max(s.sent for s in shots)
    t = 0.0
    while t <= end:
        win = [s for s in shots if t <= s.sent < t + 1.0]
        lat = [s.latency_s for s in win if s.status == 200]
        if win and not any(s.status == 429 for s in win) and quantile(lat, 0.99) * 1e3 <= 2 * base_p99_ms:
            return t
        t += 0.25
    return float("inf")


def _figures(
    cfg: LoadConfig,
    r: float,
    phases: list[Phase],
    direct: Phase,
    sus: Phase,
    rec_shots: list[Shot],
    samples: list[tuple[float, float]],
    before: Gauges,
    after: Gauges,
    peak_rss: float,
) -> list[Figure]:
    s = sus.stats
    late = [(t, v) for t, v in samples if t >= 10.0] or samples
    added = s["p99_ms"] - direct.stats["p99_ms"]
    out: list[Figure] = [
        fig(f"highest rate held (ramp x1.4, p99 <= {cfg.hold_p99_ms:.0f} ms)", f"{r:.0f} req/s"),
        exactly(
            f"errors at {r:.0f} req/s for {cfg.sustain_s:.0f} s (of {s['sent']:.0f})",
            int(s["errors"] + s["r429"]),
            0,
        ),
        at_least("achieved rate", s["rate_ok"], 0.97 * r, unit="req/s", fmt="{:.0f}"),
        fig("latency p50 / p99 through the gateway", f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f} ms"),
        fig(
            "latency p50 / p99 straight to the instances",
            f"{direct.stats['p50_ms']:.1f} / {direct.stats['p99_ms']:.1f} ms",
        ),
        fig("p99 added by the gateway", f"{added:.1f} ms"),
        fig(
            "routing decision p50 / p99 (x-kvrouter-decision-ms)",
            f"{s['decision_p50_ms']:.2f} / {s['decision_p99_ms']:.2f} ms",
        ),
        at_most(
            "gateway memory (PSS, all its processes) trend after the first 10 s",
            slope_per_min(late),
            cfg.rss_slope_mb_min,
            unit="MB/min",
            fmt="{:.2f}",
        ),
        fig(
            "gateway memory (PSS): start / end of the sustained run",
            f"{samples[0][1]:.0f} / {samples[-1][1]:.0f} MB" if samples else "n/a",
        ),
        at_most(
            "client connections still open after the load",
            after.client_conns,
            0,
            fmt="{:.0f}",
        ),
        exactly("sockets in CLOSE_WAIT (closed by the peer, never by the gateway)", after.close_wait, 0),
        at_most(
            "event-loop tasks, idle after minus before the load", after.tasks - before.tasks, 0, fmt="{:+.0f}"
        ),
        fig(
            "pooled upstream connections before / after (aiohttp keep-alive)",
            f"{before.upstream_conns} / {after.upstream_conns}",
        ),
        at_most(
            "recovered after the load dropped to R/2",
            _recovered_after(rec_shots, s["p99_ms"]),
            2.0,
            unit="s",
            fmt="{:.2f}",
        ),
        fig("gateway memory (PSS) after overload", f"{peak_rss:.0f} MB"),
    ]
    return out
