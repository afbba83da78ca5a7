"""The indexer at fleet scale: ``kvrouter bench indexer --instances N --blocks M`` (see ``fleet_workload``).

Both indexes take the same workload in the same run: kvrouter's ``Indexer`` from vLLM 0.33-shaped
payloads in this process, then Dynamo's RadixTree in a subprocess with the peer venv (``dynamo_fleet.py``)
when ``shared/peerbench`` and its venv are present.

Reported per side: ingest blocks/s (payload building not timed), per second of wall time and of the
process's CPU time (Dynamo applies events on a thread of its own); lookup p50 and p99 of ``queries``
8k-token prompts whose first ``cached_blocks`` blocks are cached (kvrouter: ``lookup`` of a uint32 array;
Dynamo: ``compute_block_hash_for_seq`` + ``find_matches``); bytes of RSS per (instance, block) pair.
``--reserve`` sizes kvrouter's index ahead (``Indexer.reserve``); ``--scales 8x1250000,100x100000`` runs
each scale in its own process and reports them together.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import resource
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from indexer import Indexer
from indexer.encode import PayloadEncoder
from indexer.index import BlockIndex
from kvrouter.lab.bench.common import peer_python, rss_bytes, run_peer
from kvrouter.lab.bench.fleet_workload import Fleet, FleetSpec
from kvrouter.percentiles import summary_us

CHUNK = 2000


def spec_of(a: argparse.Namespace) -> FleetSpec:
    return FleetSpec(
        instances=a.instances,
        blocks=a.blocks,
        prefixes=a.prefixes,
        prefix_blocks=a.fleet_prefix_blocks,
        seq_blocks=a.seq_blocks,
        block_size=a.block_size,
        cached_blocks=a.cached_blocks,
        query_blocks=a.query_blocks,
        queries=a.queries,
        remove_frac=a.fleet_remove_frac,
        seed=a.seed,
    )


def payloads(fleet: Fleet, enc: PayloadEncoder, lo: int, hi: int) -> list[tuple[str, bytes]]:
    bs = fleet.spec.block_size
    out = []
    for s in range(lo, hi):
        inst, parent, engines, toks, _ = fleet.stored(s)
        ev = enc.stored(engines, parent, array("H", toks).tolist(), bs)
        out.append((f"vllm-{inst}", enc.batch([ev], ts=1.7e9)))
    return out


def run_ours(spec: FleetSpec, release: str, reserve: bool = False) -> dict[str, Any]:
    fleet = Fleet(spec)
    enc = PayloadEncoder(release)
    queries = []
    for q in range(spec.queries):
        inst, toks = fleet.query(q)
        queries.append((f"vllm-{inst}", np.frombuffer(toks, dtype="<u2").astype(np.uint32)))
    ix = Indexer(block_size=spec.block_size)
    gc.collect()
    rss0 = rss_bytes()
    if reserve:  # the fleet's declared capacity: instances x blocks each
        ix.reserve(spec.instances, spec.blocks)
    t_store = cpu_store = 0.0
    for lo in range(0, len(fleet), CHUNK):
        batch = payloads(fleet, enc, lo, min(lo + CHUNK, len(fleet)))
        t0, c0 = time.perf_counter(), time.process_time()
        for name, p in batch:
            ix.apply_payload(name, p)
        t_store += time.perf_counter() - t0
        cpu_store += time.process_time() - c0
    del batch
    gc.collect()
    rss1 = rss_bytes()
    pairs = fleet.pairs()
    removals = [(f"vllm-{w}", enc.batch([enc.removed(hs)], ts=1.7e9)) for w, hs in fleet.removals()]
    t0, c0 = time.perf_counter(), time.process_time()
    for name, p in removals:
        ix.apply_payload(name, p)
    t_rm = time.perf_counter() - t0
    cpu_rm = time.process_time() - c0
    if ix.counters.event_errors:
        raise RuntimeError(f"events not applied: {dict(ix.counters.event_errors)}")
    for _, qa in queries[:50]:
        ix.lookup(qa)
    lat: list[float] = []
    correct = 0
    for name, qa in queries:
        t0 = time.perf_counter()
        res = ix.lookup(qa)
        lat.append(time.perf_counter() - t0)
        best = res.best()
        correct += best is not None and best.instance == name and best.matched_blocks == spec.cached_blocks
    n_rm = fleet.removed_blocks()
    index = ix.index
    return {
        "pairs": pairs,
        "sequences": len(fleet),
        "ingest_store_blocks_per_s": round(pairs / t_store, 1),
        "ingest_total_blocks_per_s": round((pairs + n_rm) / (t_store + t_rm), 1),
        "ingest_total_blocks_per_cpu_s": round((pairs + n_rm) / (cpu_store + cpu_rm), 1),
        "reserved": reserve,
        "lookup_8k_uint32_array": summary_us(lat),
        "expected_match": f"{correct}/{len(queries)}",
        "rss_delta_mb": round((rss1 - rss0) / 2**20, 1),
        "bytes_per_pair": round((rss1 - rss0) / pairs, 1),
        "table_bytes_per_pair": round(index.nbytes() / pairs, 1) if isinstance(index, BlockIndex) else None,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def run_dynamo(spec: FleetSpec) -> dict[str, Any] | None:
    py = peer_python("dynamo")
    if py is None:
        return None
    script = Path(__file__).with_name("dynamo_fleet.py")
    return run_peer([str(py), str(script), json.dumps(dataclasses.asdict(spec))], timeout=4 * 3600)


def run_scale(a: argparse.Namespace) -> dict[str, Any]:
    spec = spec_of(a)
    out: dict[str, Any] = {"bench": "indexer_fleet", "config": dataclasses.asdict(spec)}
    out["kvrouter"] = ours = run_ours(spec, a.release, a.reserve)
    dyn = None if a.no_peer else run_dynamo(spec)
    if dyn is None:
        out["targets"] = {"lookup_p50_le_100us": ours["lookup_8k_uint32_array"]["p50_us"] <= 100}
        return out
    out["dynamo"] = dyn
    lookup = ours["lookup_8k_uint32_array"]["p50_us"] / dyn["lookup_p50_us"]
    ingest = ours["ingest_total_blocks_per_s"] / dyn["ingest_total_blocks_per_s"]
    cpu = dyn.get("ingest_total_blocks_per_cpu_s")
    mem = ours["bytes_per_pair"] / dyn["bytes_per_pair"]
    out["ratios"] = {
        "lookup_p50_vs_dynamo": round(lookup, 3),
        "ingest_vs_dynamo": round(ingest, 3),
        "ingest_per_cpu_s_vs_dynamo": round(ours["ingest_total_blocks_per_cpu_s"] / cpu, 3) if cpu else None,
        "bytes_per_pair_vs_dynamo": round(mem, 3),
    }
    out["targets"] = {
        "lookup_p50_le_100us": ours["lookup_8k_uint32_array"]["p50_us"] <= 100,
        "lookup_p50_le_1x_dynamo": lookup <= 1.0,
        "ingest_ge_1x_dynamo": ingest >= 1.0,
        "bytes_per_pair_le_1x_dynamo": mem <= 1.0,
    }
    return out


def run_scales(a: argparse.Namespace) -> dict[str, Any]:
    """Each ``NxM`` of ``--scales`` in its own process (so RSS is per scale)."""
    runs = []
    for item in a.scales.split(","):
        n, m = (int(x) for x in item.lower().split("x"))
        argv = [sys.executable, "-m", "kvrouter.lab.bench.indexer_fleet"]
        argv += ["--instances", str(n), "--blocks", str(m)]
        for k in ("queries", "seed", "prefixes", "fleet_prefix_blocks", "cached_blocks", "fleet_remove_frac"):
            argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
        if a.no_peer:
            argv.append("--no-peer")
        if a.reserve:
            argv.append("--reserve")
        done = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=6 * 3600)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"bench": "indexer_fleet_scales", "runs": runs}


def add_fleet_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--instances", type=int, default=None, help="fleet mode: this many instances ...")
    ap.add_argument("--blocks", type=int, default=None, help="... each holding this many blocks")
    ap.add_argument("--scales", default=None, help="fleet mode at several scales, e.g. 8x1250000,1000x10000")
    ap.add_argument("--fleet-prefix-blocks", type=int, default=64)
    ap.add_argument("--cached-blocks", type=int, default=100, help="fleet queries: leading blocks cached")
    ap.add_argument("--fleet-remove-frac", type=float, default=0.1)
    ap.add_argument(
        "--reserve", action="store_true", help="fleet mode: size kvrouter's index ahead (Indexer.reserve)"
    )


def main() -> None:
    from kvrouter.lab.bench import indexer_bench

    ap = argparse.ArgumentParser(description=__doc__)
    indexer_bench.add_args(ap)
    a = ap.parse_args()
    out = run_scales(a) if a.scales else run_scale(a)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
