"""Router replicas on the live path: one gateway against N ``kvrouter serve`` replicas sharing state
through a real redis-server, and against N replicas that share nothing, on the same simulated fleet.

::

    round-robin client ──request i──▶ replica i mod N (kvrouter serve, own process) ──HTTP──▶ kvrouter sim
                                          │ every replica subscribes to every instance's KV events  │
                                          └─ replicas.redis_url: load + speculative entries ─ redis-server

Each setup has its own fleet (``kvrouter sim`` in a child process) and routers, all started once; before
each workload the fleet's caches are emptied (``POST /reset_prefix_cache``, as on vLLM) and the routers'
indexes and speculative entries are waited empty, so every workload meets a cold fleet.  Hit rates are
the engines' own report (``usage.prompt_tokens_details.cached_tokens``).
The fleet's caches are small enough that not every prefix fits everywhere, so a prefix computed on two
instances costs another prefix its place.

Workloads (chat requests, ``groups`` shared system prompts of ``system_words`` words):

interleaved  the groups' prompts shuffled, Poisson arrivals at ``rate`` req/s
bursts       each group one burst of ``burst`` requests at once, a group every ``burst_gap_s``: the
             burst is shorter than a sync interval, so replicas cannot learn of each other's requests;
             at the default gap a burst meets a busy fleet (earlier groups still prefill), where the
             replicas' views of the load differ.  With a gap long enough for the fleet to go idle
             (``--burst-gap-s 2``) the views are exactly tied and any tie-break agrees.

The setups run in a rotated order from run to run, so a slow phase of this shared machine does not always
hit the same one; compare the setups within a run.
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
from kvrouter.lab.workloads import make_workload
from kvrouter.lab.workloads.arrivals import Bursts, Poisson
from kvrouter.lab.workloads.spec import Workload
from kvrouter.percentiles import quantile

SETUPS = ("one", "shared", "alone")
WORKLOADS = ("interleaved", "bursts")


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=3, help="repetitions of every workload x setup")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument(
        "--capacity-blocks",
        type=int,
        default=400,
        help="KV blocks per instance (16 tokens each): room for about 4 of the 16 system prompts",
    )
    ap.add_argument(
        "--speed",
        type=float,
        default=0.25,
        help="the fleet runs this many times faster than its profile (slower: less at a busy CPU's mercy)",
    )
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--system-words", type=int, default=1400)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--per-group", type=int, default=10, help="interleaved: prompts per group")
    ap.add_argument("--rate", type=float, default=3.0, help="interleaved: Poisson arrivals, req/s")
    ap.add_argument("--burst", type=int, default=8, help="bursts: requests per group, all at once")
    ap.add_argument(
        "--burst-gap-s",
        type=float,
        default=0.5,
        help="bursts: seconds between groups (0.5: a group arrives while the last ones still prefill)",
    )
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


def workload(a: argparse.Namespace, which: str, seed: int) -> Workload:
    common = {
        "form": "chat",
        "seed": seed,
        "num_groups": a.groups,
        "system_len": a.system_words,
        "question_len": a.question_words,
        "output_len": a.output_tokens,
    }
    if which == "interleaved":
        return make_workload("sglang-gsp", **common, prompts_per_group=a.per_group, arrival=Poisson(a.rate))
    return make_workload(
        "sglang-gsp",
        **common,
        prompts_per_group=a.burst,
        grouped=True,
        arrival=Bursts(a.burst, a.burst_gap_s),
    )


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
    }


async def _ready(s: aiohttp.ClientSession, base: str, instances: int, peers: int) -> None:
    """Until the router is subscribed to every instance and (sharing) sees every peer."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        async with s.get(base + "/health") as r:
            body = await r.json()
        connected = sum(1 for src in body.get("index", []) if src.get("connected"))
        if connected >= instances and await metric(s, base, "kvrouter_shared_state_peers") >= peers:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{base} not ready: subscribed to {connected} of {instances} instances")


async def _diagnostics(s: aiohttp.ClientSession, bases: list[str]) -> dict[str, float]:
    """Decisions by reason and peer entries taken in, summed over the routers."""
    out: dict[str, float] = {}
    for b in bases:
        for reason in ("cache", "load", "spill"):
            v = await metric(s, b, "kvrouter_decisions_total", f'reason="{reason}"')
            out[f"decisions_{reason}"] = out.get(f"decisions_{reason}", 0.0) + v
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
        self, a: argparse.Namespace, setup: str, redis_url: str | None, workdir: Path, log: IO[bytes]
    ):
        self.a, self.setup = a, setup
        self.n = 1 if setup == "one" else a.replicas
        self.dir = workdir / setup
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.redis_url = redis_url
        self.sim = SimProcess(
            self.dir,
            log,
            "--instances", str(a.instances),
            "--capacity-blocks", str(a.capacity_blocks),
            "--speed", str(a.speed),
            "--answer-tokens", "0",
            "--seed", str(a.seed),
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
                    "namespace": f"bench-{self.dir.parent.name}",
                    "replica_id": f"r{i}",
                    "interval_s": self.a.interval_s,
                }
                mine = merge(cfg, {"replicas": rep})
            self.serves.append(ServeProcess("serve", mine, self.dir, self.log, f"router{i}"))
        for sv in self.serves:
            sv.proc.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            for sv in self.serves:
                await wait_http(sv.base + "/livez", timeout_s=300, proc=sv.proc)
                await _ready(s, sv.base, self.a.instances, self.n - 1 if self.setup == "shared" else 0)

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
            recs = await drive(self.bases, wl, model=MODEL)
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
    stacks: dict[str, Stack] = {}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {w: {s: [] for s in a.setups} for w in a.workloads}
    try:
        if "shared" in a.setups:
            redis = RedisProcess(log, workdir)
            await redis.start()
        for setup in a.setups:
            stacks[setup] = Stack(a, setup, redis.url if redis else None, workdir, log)
        for st in stacks.values():  # one at a time: a dozen processes loading tokenizers at once time out
            await st.start()
        # speculative entries outlive the reset: waited out before each workload (the fleet file's TTL)
        spec_ttl = float(overrides(a.set).get("indexer", {}).get("speculative_ttl_s", 5.0))
        for run in range(a.runs):
            for w in a.workloads:
                wl = workload(a, w, a.seed + run)
                k = run % len(a.setups)
                for setup in a.setups[k:] + a.setups[:k]:
                    await stacks[setup].reset(spec_ttl)
                    keep = workdir / f"requests-{run}-{w}-{setup}.json" if a.keep else None
                    res = await stacks[setup].drive(wl, keep)
                    rows[w][setup].append(res)
                    print(f"run {run} {w} {setup}: {json.dumps(res)}", file=sys.stderr, flush=True)
    finally:
        for st in stacks.values():
            st.stop()
        if redis is not None:
            redis.kill()
        log.close()
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"runs": rows, "summary": summary(a, rows)}


def summary(a: argparse.Namespace, rows: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Hit rates per setup (every run, median), and each run's points below one gateway."""
    out: dict[str, Any] = {}
    for w, by_setup in rows.items():
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
                entry[setup]["points_below_one"] = [
                    round((o["hit_rate"] - r["hit_rate"]) * 100, 2) for o, r in zip(one, runs)
                ]
        out[w] = entry
    shared_ok = all(
        max(e["shared"].get("points_below_one", [99])) <= 1.0 for e in out.values() if "shared" in e
    )
    bursts = out.get("bursts", {})
    ahead = (
        [
            round((s - al) * 100, 2)
            for s, al in zip(bursts["shared"]["hit_rates"], bursts["alone"]["hit_rates"])
        ]
        if "shared" in bursts and "alone" in bursts
        else []
    )
    out["targets"] = {
        "shared_within_1_point_of_one_gateway": shared_ok,
        "shared_ahead_of_alone_on_bursts_points": ahead,
        "shared_ahead_of_alone_on_bursts": bool(ahead) and all(x > 0 for x in ahead),
    }
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
