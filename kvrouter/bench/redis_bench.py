"""Redis-backed state: lookup latency of ``RedisBlockIndex`` next to the in-process index, and the hit rate
of several router replicas sharing state next to one router.

lookup     the ``indexer_bench`` workload (8 instances, 2000 x 128-block sequences over 50 shared prefixes,
           30 % of tails removed) ingested as vLLM payloads by one ``Indexer`` per backend; then 2000
           8k-token queries (512 blocks: 40 % live sequence + new tokens, 40 % shared prefix + new, 20 %
           miss), each timed as the router calls it (``lookup_chains`` on precomputed chain hashes, so
           hashing is excluded and equal for both).  Also: Redis server CPU per lookup (INFO
           commandstats), Redis memory per indexed pair, ingest rate, and that both backends answer alike.
agreement  ``ReplicatedFleet`` (virtual time, the gateway's Router and Indexer, the engine model): one
           router, N replicas each alone, and N replicas sharing state through ``MemoryReplicaHub`` (the
           Redis store's semantics) at each sync interval, on workloads with bursts of new prefixes, for
           each kv-aware placement band asked for; the live counterpart is ``kvrouter bench replicas``.

A redis-server is started on 127.0.0.1 for the run unless ``--redis-url`` names one (it is flushed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import redis

from indexer import Indexer
from indexer.encode import PayloadEncoder
from indexer.redis_index import RedisBlockIndex

from ..percentiles import summary_us
from ..routing import PolicyName
from ..routing.policies import KvAwareSettings
from . import indexer_bench, indexer_fleet
from .fleet_workload import Fleet

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
_ISSUE29 = {
    "num_groups": 16,
    "system_len": 1800,
    "question_len": 16,
    "output_len": 4,
    "prompts_per_group": 10,
    "arrival": {"type": "closed-loop", "concurrency": 8},
}
"""The live bench's ``clients`` scenario (issue 29): 16 prompts of 1,800 tokens, 10 chats each, 8 clients."""
_FAST_FLEET = {"instances": 4, "profile": "test", "capacity_blocks": 420, "net_latency_s": 0.03}
"""Its fleet: caches that hold under four prompts each, prefills of a millisecond; the 30 ms each way
stand for the live routers' time per request on this machine (tens of milliseconds), so a request lives
about as long as a round trip between replicas."""

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
    "16-prompts-bursts-of-8@0.05s": (
        "sglang-gsp",
        {
            **_ISSUE19,
            "prompts_per_group": 8,
            "grouped": True,
            "arrival": {"type": "bursts", "size": 8, "interval_s": 0.05},
        },
        _SMALL_FLEET,
    ),
    "16-prompts-8-clients": ("sglang-gsp", {**_ISSUE29, "grouped": False}, _FAST_FLEET),
    "16-prompts-8-clients-bursts": ("sglang-gsp", {**_ISSUE29, "grouped": True}, _FAST_FLEET),
}
"""name -> (workload, its parameters, fleet settings over ``FleetSimConfig(instances=--instances)``)."""


@contextmanager
def local_redis(url: str | None) -> Iterator[str]:
    """The given Redis, or a throwaway redis-server on a free port below 32768."""
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: install it or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1] % 12000 + 20000
    workdir = tempfile.mkdtemp(prefix="kvrouter-bench-redis-")
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*cmd, "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.025)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _ingest(ix: Indexer, w: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    for inst, payload, _ in w["stored"] + w["removed"]:
        ix.apply_payload(inst, payload)
    assert not ix.counters.event_errors, ix.counters.event_errors
    return time.perf_counter() - t0


def _answers(ix: Indexer, chains: np.ndarray, n: int) -> list[tuple[str, int, int]]:
    res = ix.lookup_chains(chains, n).instances
    return sorted((m.instance, m.matched_blocks, m.tiers.get("GPU", 0)) for m in res if m.matched_blocks)


def run_lookup(a: argparse.Namespace, url: str) -> dict[str, Any]:
    w = indexer_bench.build(a)
    client = redis.Redis.from_url(url, decode_responses=False)
    client.flushdb()
    backends = {
        "memory": Indexer(a.block_size),
        "redis": Indexer(a.block_size, index=RedisBlockIndex(client, namespace="bench")),
    }
    blocks = sum(x[2] for x in w["stored"] + w["removed"])
    out: dict[str, Any] = {"indexed_pairs": w["pairs"]}
    for name, ix in backends.items():
        out[f"{name}_ingest_blocks_per_s"] = round(blocks / _ingest(ix, w), 1)
    mem = client.info("memory")
    out["redis_used_memory_bytes"] = mem["used_memory"]
    out["redis_bytes_per_indexed_pair"] = round(mem["used_memory"] / w["pairs"], 1)
    queries = [(kind, backends["memory"].chain_hashes(q), len(q)) for kind, q in w["queries"]]
    assert all(len(c) == a.query_blocks for _, c, _ in queries)
    for _, c, n in queries[:50]:  # warm both
        for ix in backends.values():
            ix.lookup_chains(c, n)
    equal = all(
        _answers(backends["memory"], c, n) == _answers(backends["redis"], c, n) for _, c, n in queries
    )
    out["answers_equal"] = equal
    client.config_resetstat()
    for name, ix in backends.items():
        lat: dict[str, list[float]] = {"all": [], "hit_seq": [], "hit_prefix": [], "miss": []}
        for kind, c, n in queries:
            t0 = time.perf_counter()
            ix.lookup_chains(c, n)
            dt = time.perf_counter() - t0
            lat["all"].append(dt)
            lat[kind].append(dt)
        out[f"{name}_lookup_8k"] = {k: summary_us(v) for k, v in lat.items()}
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    out["redis_server_us_per_lookup"] = stats.get("usec_per_call")
    # Redis >= 7 tracks per-command latency percentiles server-side: the lookup without the client, the
    # loopback and the scheduler (on a busy host the client-side p99 is mostly the latter)
    pcts = client.info("latencystats").get("latency_percentiles_usec_evalsha")
    if isinstance(pcts, dict):
        out["redis_server_lookup_us"] = {k: float(v) for k, v in pcts.items()}
    m, r = out["memory_lookup_8k"]["all"], out["redis_lookup_8k"]["all"]
    out["redis_over_memory_p50"] = round(r["p50_us"] / m["p50_us"], 1)
    out["redis_over_memory_p99"] = round(r["p99_us"] / m["p99_us"], 1)
    client.close()
    return out


def run_fleet(a: argparse.Namespace, url: str) -> dict[str, Any]:
    """The fleet-scale workload (``indexer_fleet``) into ``RedisBlockIndex``: ingest rate, Redis memory
    per (instance, block) pair, and lookups of the uint32 prompts as ``Indexer.lookup`` makes them (chunked
    hashing with an EXISTS per chunk, then the match script)."""
    spec = indexer_fleet.spec_of(a)
    fleet = Fleet(spec)
    client = redis.Redis.from_url(url, decode_responses=False)
    client.flushdb()
    mem0 = client.info("memory")["used_memory"]
    ix = Indexer(spec.block_size, index=RedisBlockIndex(client, namespace="bench"))
    enc = PayloadEncoder(a.release)
    t_store = 0.0
    for lo in range(0, len(fleet), indexer_fleet.CHUNK):
        batch = indexer_fleet.payloads(fleet, enc, lo, min(lo + indexer_fleet.CHUNK, len(fleet)))
        t0 = time.perf_counter()
        for name, p in batch:
            ix.apply_payload(name, p)
        t_store += time.perf_counter() - t0
    if ix.counters.event_errors:
        raise RuntimeError(f"events not applied: {dict(ix.counters.event_errors)}")
    mem = client.info("memory")["used_memory"] - mem0
    pairs = fleet.pairs()
    lat: list[float] = []
    correct = 0
    queries = [fleet.query(q) for q in range(spec.queries)]
    arrays = [(f"vllm-{i}", np.frombuffer(t, dtype="<u2").astype(np.uint32)) for i, t in queries]
    for _, qa in arrays[:50]:
        ix.lookup(qa)
    for name, qa in arrays:
        t0 = time.perf_counter()
        res = ix.lookup(qa)
        lat.append(time.perf_counter() - t0)
        best = res.best()
        correct += best is not None and best.instance == name and best.matched_blocks == spec.cached_blocks
    client.close()
    return {
        "config": {"instances": spec.instances, "blocks": spec.blocks},
        "pairs": pairs,
        "ingest_store_blocks_per_s": round(pairs / t_store, 1),
        "redis_used_memory_mb": round(mem / 2**20, 1),
        "redis_bytes_per_pair": round(mem / pairs, 1),
        "lookup_8k_uint32_array": summary_us(lat),
        "expected_match": f"{correct}/{len(arrays)}",
    }


def run_agreement(a: argparse.Namespace) -> dict[str, Any]:
    from ..routing import RouterConfig
    from ..routing.policies import KvAwareSettings, PolicySettings
    from ..sim.evaluation.compare import EvalSpec, load_workload, summarize
    from ..sim.evaluation.replicas import ReplicaSimConfig, ReplicatedFleet
    from ..sim.evaluation.virtual_fleet import FleetSimConfig
    from ..workloads.blocks import BlockContentCache

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
            rc = RouterConfig(policy=PolicyName.KV_AWARE, shadow=False, settings=PolicySettings(kv_aware=kv))
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
    ap.add_argument(
        "--redis-url", default=None, help="an existing Redis to use (flushed!); default: spawn one"
    )
    ap.add_argument("--skip-lookup", action="store_true")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--replicas", type=int, default=4)
    # --instances (agreement: the fleet's size, default 8) and --blocks come from indexer_bench: with both
    # given, the lookup part runs the fleet-scale workload instead (see run_fleet)
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
    if not a.skip_lookup:
        with local_redis(a.redis_url) as url:
            fleet = a.instances is not None and a.blocks is not None
            out["lookup"] = run_fleet(a, url) if fleet else run_lookup(a, url)
    if not a.skip_agreement:
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
