"""Router replicas on the live path: one gateway against N ``kvrouter serve`` replicas sharing state
through a real redis-server, and against N replicas that share nothing, on the same simulated fleet.

::

    round-robin client ──request i──▶ replica i mod N (kvrouter serve, own process) ──HTTP──▶ kvrouter sim
                                          │ every replica subscribes to every instance's KV events  │
                                          └─ replicas.redis_url: load + speculative entries ─ redis-server

Each setup has its own fleet and routers, started once; before each workload the fleet's caches are
emptied (``POST /reset_prefix_cache``) and the routers' indexes and speculative entries are waited empty,
so every workload meets a cold fleet.  Hit rates are the engines' own report (``cached_tokens``).
Scenarios (``replicas_scenarios``: ``paced``, ``clients``) run interleaved and in bursts; the setups run
in a rotated order from run to run, so compare setups within a run.  The scenarios and why each is
shaped as it is: docs/results.md, "How the benches measure".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import aiohttp
import msgspec
import yaml

from kvrouter.lab.loadgen import LiveRecord, drive
from kvrouter.lab.reliability.procs import (
    RedisProcess,
    ServeProcess,
    SimProcess,
    metric,
    redis_binary,
    wait_http,
)
from kvrouter.lab.reliability.stack import MODEL, merge
from kvrouter.lab.workloads.spec import Workload
from kvrouter.percentiles import quantile

from .replicas_scenarios import SCENARIOS, WORKLOADS, Scenario, workload

SETUPS = ("one", "shared", "alone")


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=3, help="repetitions of every workload x setup")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="kvrouter serve --workers of every router (default: serve's own, one per core)",
    )
    ap.add_argument("--groups", type=int, default=16)
    # Each of these replaces the scenario's own value (replicas_scenarios.SCENARIOS) in every scenario run.
    ap.add_argument("--capacity-blocks", type=int, default=None, help="KV blocks per instance (16 tokens)")
    ap.add_argument("--profile", default=None, help="the fleet's timing profile (kvrouter sim --profile)")
    ap.add_argument("--speed", type=float, default=None, help="the fleet runs this many times its profile")
    ap.add_argument("--system-words", type=int, default=None)
    ap.add_argument("--question-words", type=int, default=None)
    ap.add_argument("--output-tokens", type=int, default=None)
    ap.add_argument("--per-group", type=int, default=None, help="prompts per group")
    ap.add_argument("--clients", type=int, default=None, help="concurrent clients (closed loop)")
    ap.add_argument("--rate", type=float, default=None, help="open loop, interleaved: Poisson req/s")
    ap.add_argument("--burst", type=int, default=None, help="open loop, bursts: requests per group")
    ap.add_argument("--burst-gap-s", type=float, default=None, help="open loop, bursts: seconds between")
    ap.add_argument("--interval-s", type=float, default=0.05, help="replicas.interval_s (sync period)")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="fleet-file setting of every router, e.g. routing.kv_aware.cold_band=0 (YAML value)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--keep", default=None, help="keep the logs, fleet files and every request's record in this directory"
    )


def scenario(a: argparse.Namespace, name: str) -> Scenario:
    """The named scenario with the command line's replacements."""
    fields = {
        "capacity_blocks": a.capacity_blocks,
        "profile": a.profile,
        "speed": a.speed,
        "system_words": a.system_words,
        "question_words": a.question_words,
        "output_tokens": a.output_tokens,
        "per_group": a.per_group,
        "clients": a.clients,
        "rate": a.rate,
        "burst": a.burst,
        "burst_gap_s": a.burst_gap_s,
    }
    return msgspec.structs.replace(SCENARIOS[name], **{k: v for k, v in fields.items() if v is not None})


def overrides(items: list[str]) -> dict[str, Any]:
    """``a.b.c=VALUE`` items as one nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        path, sep, raw = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--set wants PATH=VALUE, got {item!r}")
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return out


def summarize(recs: list[LiveRecord], wl: Workload) -> dict[str, Any]:
    ok = [r for r in recs if r.status == 200 and r.error is None]
    group = {r.id: r.group for r in wl.requests}
    where: dict[str | None, set[str | None]] = {}
    for r in ok:
        where.setdefault(group.get(r.id), set()).add(r.instance)
    prompt = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else 0.0,
        "ttft_p50_ms": round(quantile(ttft, 0.5) * 1e3, 1),
        "ttft_p90_ms": round(quantile(ttft, 0.9) * 1e3, 1),
        "instances_used": len({r.instance for r in ok}),
        "instances_per_group": round(statistics.fmean(len(v) for v in where.values()), 2) if where else 0.0,
        "groups_per_instance": sorted(
            (sum(1 for v in where.values() if i in v) for i in {r.instance for r in ok}), reverse=True
        ),
    }


async def _ready(base: str, instances: int, peers: int, workers: int | None) -> None:
    """Until the router is subscribed to every instance and (sharing) its round trips see every peer.  On
    fresh connections: with several workers the kernel picks one per connection, and the worker that makes
    the round trips (the leader) says so in /health."""
    deadline = time.monotonic() + 60
    connected, seen = 0, 0
    timeout = aiohttp.ClientTimeout(total=5)
    while time.monotonic() < deadline:
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout) as s,
            s.get(base + "/health") as r,
        ):
            body = await r.json()
        connected = sum(1 for src in body.get("index", []) if src.get("connected"))
        rep = body.get("replicas") or {}
        if rep.get("round_trips"):
            seen = int(rep.get("peers", 0))
        if connected >= instances and seen >= peers:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(
        f"{base} not ready: subscribed to {connected} of {instances} instances, {seen} of {peers} peers seen"
    )


async def _diagnostics(s: aiohttp.ClientSession, bases: list[str]) -> dict[str, float]:
    """Decisions by reason, claims of new prompts by outcome and peer entries taken in, summed over the
    routers."""
    out: dict[str, float] = {}
    for b in bases:
        for reason in ("cache", "load", "spill"):
            v = await metric(s, b, "kvrouter_decisions_total", f'reason="{reason}"')
            out[f"decisions_{reason}"] = out.get(f"decisions_{reason}", 0.0) + v
        for outcome in ("won", "followed", "newer", "error", "skipped"):
            v = await metric(s, b, "kvrouter_shared_state_prefix_claims_total", f'outcome="{outcome}"')
            out[f"claims_{outcome}"] = out.get(f"claims_{outcome}", 0.0) + v
        for name, key in (
            ("kvrouter_shared_state_peer_speculative_entries_total", "peer_speculative_entries"),
            ("kvrouter_shared_state_errors_total", "shared_state_errors"),
        ):
            out[key] = out.get(key, 0.0) + await metric(s, b, name)
    return out


class Stack:
    """One setup: a simulated fleet (``kvrouter sim``) and its routers (``kvrouter serve``), kept up for
    every run; ``reset`` empties the fleet's caches (vLLM's ``POST /reset_prefix_cache``) and waits until
    every router's index is empty and its speculative entries have expired, as on a fresh fleet."""

    def __init__(
        self,
        a: argparse.Namespace,
        sc: Scenario,
        setup: str,
        redis_url: str | None,
        workdir: Path,
        log: IO[bytes],
    ):
        self.a, self.sc, self.setup = a, sc, setup
        self.n = 1 if setup == "one" else a.replicas
        self.dir = workdir / setup
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.redis_url = redis_url
        self.sim = SimProcess(
            self.dir,
            log,
            "--instances", str(a.instances),
            "--capacity-blocks", str(sc.capacity_blocks),
            "--speed", str(sc.speed),
            "--answer-tokens", "0",
            "--seed", str(a.seed),
            *(("--profile", sc.profile) if sc.profile else ()),
        )  # fmt: skip
        self.serves: list[ServeProcess] = []
        self.urls: list[str] = []

    @property
    def bases(self) -> list[str]:
        return [sv.base for sv in self.serves]

    async def start(self) -> None:
        fleet = await self.sim.start()
        self.urls = [i["url"] for i in fleet["instances"]]
        cfg = merge({**fleet, "routing": {"policy": "kv-aware", "shadow": False}}, overrides(self.a.set))
        for i in range(self.n):
            mine = cfg
            if self.setup == "shared":
                rep = {
                    "redis_url": self.redis_url,
                    "namespace": f"bench-{self.dir.parent.parent.name}-{self.dir.parent.name}",
                    "replica_id": f"r{i}",
                    "interval_s": self.a.interval_s,
                }
                mine = merge(cfg, {"replicas": rep})
            self.serves.append(
                ServeProcess("serve", mine, self.dir, self.log, f"router{i}", workers=self.a.workers)
            )
        for sv in self.serves:
            sv.proc.start()
        for sv in self.serves:
            await wait_http(sv.base + "/livez", timeout_s=300, proc=sv.proc)
            peers = self.n - 1 if self.setup == "shared" else 0
            await _ready(sv.base, self.a.instances, peers, self.a.workers)

    async def reset(self, speculative_ttl_s: float) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            for url in self.urls:
                async with s.post(url + "/reset_prefix_cache") as r:
                    if r.headers.get("X-Sim-Prefix-Cache-Reset") != "true":
                        raise RuntimeError(f"{url}: prefix cache not reset (requests still running)")
                # vLLM publishes the reset's AllBlocksCleared with its next step only: one short request
                async with s.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}) as r:
                    await r.read()
            deadline = time.monotonic() + 30
            while any([await _indexed_blocks(s, b) for b in self.bases]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the routers' indexes did not empty after the reset")
                await asyncio.sleep(0.1)
        await asyncio.sleep(speculative_ttl_s + 0.5)

    async def drive(self, wl: Workload, keep: Path | None = None) -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            before = await _diagnostics(s, self.bases)
            t0 = time.perf_counter()
            recs = await drive(self.bases, wl, model=MODEL, concurrency=self.sc.clients)
            wall = time.perf_counter() - t0
            await asyncio.sleep(0.2)
            after = await _diagnostics(s, self.bases)
        diag = {k: after[k] - before.get(k, 0.0) for k in after}
        if keep is not None:  # every request: where it went, why, predicted and reported cached tokens
            group = {r.id: r.group for r in wl.requests}
            rows = [{**msgspec.structs.asdict(r), "group": group.get(r.id)} for r in recs]
            keep.write_text(json.dumps(rows))
        return {**summarize(recs, wl), "wall_s": round(wall, 1), **diag}

    def stop(self) -> None:
        for sv in self.serves:
            sv.stop()
        self.sim.stop()


async def _indexed_blocks(s: aiohttp.ClientSession, base: str) -> int:
    async with s.get(base + "/health") as r:
        body = await r.json()
    return sum(sum(src.get("blocks", {}).values()) for src in body.get("index", []))


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    if "shared" in a.setups and redis_binary() is None:
        raise RuntimeError("redis-server not found: the sharing setup needs it")
    workdir = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="kvrouter-bench-replicas-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = (workdir / "processes.log").open("ab")
    redis: RedisProcess | None = None
    rows: Rows = {sc: {w: {s: [] for s in a.setups} for w in a.workloads} for sc in a.scenarios}
    try:
        if "shared" in a.setups:
            redis = RedisProcess(log, workdir)
            await redis.start()
        for name in a.scenarios:  # one fleet speed and size each: their own stacks, one scenario at a time
            await run_scenario(a, name, redis, workdir / name, log, rows[name])
    finally:
        if redis is not None:
            redis.kill()
        log.close()
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"runs": rows, "summary": summary(rows)}


Rows = dict[str, dict[str, dict[str, list[dict[str, Any]]]]]
"""scenario -> workload -> setup -> one result per run."""


async def run_scenario(
    a: argparse.Namespace,
    name: str,
    redis: RedisProcess | None,
    workdir: Path,
    log: IO[bytes],
    rows: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    sc = scenario(a, name)
    stacks: dict[str, Stack] = {}
    try:
        for setup in a.setups:
            stacks[setup] = Stack(a, sc, setup, redis.url if redis else None, workdir, log)
        for st in stacks.values():  # one at a time: a dozen processes loading tokenizers at once time out
            await st.start()
        # speculative entries outlive the reset: waited out before each workload (the fleet file's TTL)
        spec_ttl = float(overrides(a.set).get("indexer", {}).get("speculative_ttl_s", 5.0))
        for run in range(a.runs):
            for w in a.workloads:
                wl = workload(sc, w, groups=a.groups, seed=a.seed + run)
                k = run % len(a.setups)
                for setup in a.setups[k:] + a.setups[:k]:
                    await stacks[setup].reset(spec_ttl)
                    keep = workdir / f"requests-{run}-{w}-{setup}.json" if a.keep else None
                    res = await stacks[setup].drive(wl, keep)
                    rows[w][setup].append(res)
                    print(f"{name} run {run} {w} {setup}: {json.dumps(res)}", file=sys.stderr, flush=True)
    finally:
        for st in stacks.values():
            st.stop()


def summary(rows: Rows) -> dict[str, Any]:
    """Per scenario and workload: hit rates per setup (every run, median), each run's points below one
    gateway, and the targets: sharing replicas within 1 point of one gateway and not below replicas that
    share nothing (medians over the runs; the setups of one run share its phase of this machine)."""
    out: dict[str, Any] = {}
    targets: dict[str, dict[str, bool]] = {}
    for sc, by_workload in rows.items():
        for w, by_setup in by_workload.items():
            entry: dict[str, Any] = {}
            for setup, runs in by_setup.items():
                hits = [r["hit_rate"] for r in runs]
                entry[setup] = {
                    "hit_rates": hits,
                    "median": round(statistics.median(hits), 4) if hits else None,
                    "ttft_p50_ms": [r["ttft_p50_ms"] for r in runs],
                }
            one = by_setup.get("one", [])
            for setup in ("shared", "alone"):
                runs = by_setup.get(setup, [])
                if one and runs:
                    below = [round((o["hit_rate"] - r["hit_rate"]) * 100, 2) for o, r in zip(one, runs)]
                    entry[setup]["points_below_one"] = below
                    entry[setup]["median_points_below_one"] = round(statistics.median(below), 2)
            shared, alone = by_setup.get("shared", []), by_setup.get("alone", [])
            if shared and alone:
                ahead = [round((s["hit_rate"] - al["hit_rate"]) * 100, 2) for s, al in zip(shared, alone)]
                entry["shared"]["points_ahead_of_alone"] = ahead
            key = f"{sc}/{w}"
            out[key] = entry
            t: dict[str, bool] = {}
            if "median_points_below_one" in entry.get("shared", {}):
                t["shared_within_1_point_of_one_gateway"] = entry["shared"]["median_points_below_one"] <= 1.0
            if shared and alone:
                t["shared_not_below_alone"] = entry["shared"]["median"] >= entry["alone"]["median"]
            targets[key] = t
    out["targets"] = targets
    return out


def main(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": "replicas", "config": {k: v for k, v in vars(a).items() if k != "func"}}
    with contextlib.suppress(KeyboardInterrupt):
        out.update(asyncio.run(run_all(a)))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_args(parser)
    print(json.dumps(main(parser.parse_args()), indent=1))
