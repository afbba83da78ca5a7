"""Router replicas sharing state, in virtual time: the hit rate of several replicas that share load and
speculative entries (the Redis store's semantics, ``MemoryReplicaHub``) next to one router.

agreement  ``ReplicatedFleet`` (virtual time, the gateway's Router and Indexer, the engine model): one
           router, N replicas each alone, and N replicas sharing state at each sync interval, on
           workloads with bursts of new prefixes, for each kv-aware placement band asked for; the live
           counterpart (a real redis-server) is ``kvrouter bench replicas``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import msgspec

from kvrouter.lab.bench import indexer_bench
from kvrouter.routing import KV_AWARE
from kvrouter.routing.policies import KvAwareSettings

_ISSUE19 = {
    "num_groups": 16,
    "system_len": 1400,
    "question_len": 48,
    "output_len": 24,
}
"""The live bench's workload (``kvrouter bench replicas``) in token form: 16 shared 1,400-token prompts.
The live fleet runs at a quarter of its profile's speed, so its 3 req/s and 0.5 s between bursts are
12 req/s and 0.125 s here."""
_SMALL_FLEET = {"instances": 4, "profile": "qwen3-32b-2xh100", "capacity_blocks": 400}
"""The live bench's fleet: 4 instances whose caches hold about 4 of the 16 prompts each."""

AGREEMENT_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llmd-precise@60qps": (
        "llmd-precise",
        {"num_requests": 750, "arrival": {"type": "poisson", "rate": 60}},
        {},
    ),
    "sglang-gsp@150qps": (
        "sglang-gsp",
        {"num_requests": 1024, "arrival": {"type": "poisson", "rate": 150}},
        {},
    ),
    "sglang-gsp@400qps": (
        "sglang-gsp",
        {"num_requests": 1024, "arrival": {"type": "poisson", "rate": 400}},
        {},
    ),
    "sglang-gsp@all-at-once": ("sglang-gsp", {"num_requests": 1024}, {}),
    "16-prompts-interleaved@12qps": (
        "sglang-gsp",
        {**_ISSUE19, "prompts_per_group": 10, "arrival": {"type": "poisson", "rate": 12}},
        _SMALL_FLEET,
    ),
    "16-prompts-bursts-of-8@0.125s": (
        "sglang-gsp",
        {
            **_ISSUE19,
            "prompts_per_group": 8,
            "grouped": True,
            "arrival": {"type": "bursts", "size": 8, "interval_s": 0.125},
        },
        _SMALL_FLEET,
    ),
}
"""name -> (workload, its parameters, fleet settings over ``FleetSimConfig(instances=--instances)``)."""


def run_agreement(a: argparse.Namespace) -> dict[str, Any]:
    from kvrouter.lab.evaluation.compare import EvalSpec, load_workload, summarize
    from kvrouter.lab.evaluation.replicas import ReplicaSimConfig, ReplicatedFleet
    from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
    from kvrouter.lab.workloads.blocks import BlockContentCache
    from kvrouter.routing import RouterConfig
    from kvrouter.routing.policies import KvAwareSettings, PolicySettings

    n = a.replicas
    configs = {"1 router": ReplicaSimConfig(replicas=1), f"{n} alone": ReplicaSimConfig(n, share=False)}
    for iv in a.intervals:
        configs[f"{n} shared @{iv * 1000:g}ms"] = ReplicaSimConfig(n, interval_s=iv)
    out: dict[str, Any] = {}
    for case in a.cases:
        wl, overrides, fleet = AGREEMENT_CASES[case]
        fleet_cfg = msgspec.convert({"instances": a.instances or 8, "seed": a.seed, **fleet}, FleetSimConfig)
        works = []
        for ws in a.workload_seeds:  # one workload per seed: where a new prefix lands is the workload's luck
            spec = EvalSpec(workload=wl, overrides={**overrides, "seed": ws}, fleet=fleet_cfg)
            work = load_workload(spec)
            cache = BlockContentCache(work.token_space, spec.fleet.block_size)
            cache.warm(work.requests)
            works.append((work, cache))
        by_band: dict[str, Any] = {}
        for band in a.placement_bands:
            kv = KvAwareSettings(placement_band=band)
            rc = RouterConfig(policy=KV_AWARE, shadow=False, settings=PolicySettings(kv_aware=kv))
            per: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
            for work, cache in works:
                for name, rcfg in configs.items():
                    s = summarize(ReplicatedFleet(work, fleet_cfg, rc, rcfg, hashes=cache).run())
                    per[name].append({"hit_rate": s["hit_rate"], "ttft_p50_s": s["ttft_p50_s"]})
            base = per["1 router"]
            rows: dict[str, Any] = {}
            for name, runs in per.items():
                below = [(b["hit_rate"] - r["hit_rate"]) * 100 for b, r in zip(base, runs)]
                rows[name] = {
                    "hit_rate": round(statistics.median(r["hit_rate"] for r in runs), 4),
                    "hit_rates": [round(r["hit_rate"], 4) for r in runs],
                    "ttft_p50_s": round(statistics.median(r["ttft_p50_s"] for r in runs), 4),
                    "points_below_1_router": round(statistics.median(below), 2),
                    "points_below_1_router_per_seed": [round(x, 2) for x in below],
                }
            by_band[f"band {band:g}"] = rows
        out[case] = by_band
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    indexer_bench.add_args(ap)
    ap.add_argument("--replicas", type=int, default=4)
    # --instances (the fleet's size, default 8) and --seed come from indexer_bench
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.05, 0.2], help="sync periods, seconds")
    ap.add_argument("--cases", nargs="+", default=list(AGREEMENT_CASES), choices=list(AGREEMENT_CASES))
    ap.add_argument(
        "--placement-bands",
        type=float,
        nargs="+",
        default=[KvAwareSettings().placement_band],
        help="kv-aware placement bands to compare (the first one is held to the target)",
    )
    ap.add_argument(
        "--workload-seeds",
        type=int,
        nargs="+",
        default=[0],
        help="agreement: run every case with each workload seed; rows give medians and each seed's figure",
    )


def main(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": "redis", "config": {k: v for k, v in vars(a).items() if k != "func"}}
    out["agreement"] = run_agreement(a)
    first = f"band {a.placement_bands[0]:g}"
    worst = {
        case: rows[name]["points_below_1_router"]
        for case, bands in out["agreement"].items()
        for rows in (bands[first],)
        for name in rows
        if name.startswith(f"{a.replicas} shared @{a.intervals[0] * 1000:g}ms")
    }
    out["targets"] = {"replicas_within_2_points": {c: p <= 2.0 for c, p in worst.items()}}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_args(parser)
    print(json.dumps(main(parser.parse_args()), indent=2), file=sys.stdout)
