"""Dynamo's RadixTree on the fleet-scale workload: the peer side of ``kvrouter bench indexer --instances``.

Run by the bench as a subprocess with the peer venv's python (``shared/peerbench/setup.sh`` builds it:
ai-dynamo-runtime, no numpy)::

    $PEER_VENVS/dynamo/bin/python kvrouter/lab/bench/dynamo_fleet.py '{"instances": 100, "blocks": 100000}'

It reads the same workload (``fleet_workload.py`` beside it) and prints one JSON line.  Events are
Dynamo's JSON ``KvCacheEvent`` (stored blocks carry ``block_hash``, the engine's id, and ``tokens_hash``,
``compute_block_hash_for_seq`` of the block's tokens); a lookup is ``compute_block_hash_for_seq`` of the
prompt plus ``find_matches``, timed together.  Ingest time covers ``apply_event`` calls and a final
``find_matches`` round trip (the tree applies events on its own thread).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fleet_workload import Fleet, FleetSpec  # type: ignore[import-not-found]

CHUNK = 2000


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(v: list[float], p: float) -> float:
    v = sorted(v)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def main() -> None:
    from dynamo.llm import RadixTree, compute_block_hash_for_seq  # type: ignore[import-not-found]

    spec = FleetSpec(**json.loads(sys.argv[1]))
    fleet = Fleet(spec)
    bs = spec.block_size
    prefix_local = [
        compute_block_hash_for_seq(array("H", fleet.prefix_tokens(p)).tolist(), bs)
        for p in range(spec.prefixes)
    ]
    queries = []
    for q in range(spec.queries):
        inst, toks = fleet.query(q)
        queries.append((inst, array("H", toks).tolist()))
    ev_id = [0] * spec.instances

    def event(w: int, data: dict[str, object]) -> bytes:
        ev_id[w] += 1
        return json.dumps({"event_id": ev_id[w], "data": data, "dp_rank": 0}).encode()

    tree = RadixTree()
    gc.collect()
    rss0 = rss_bytes()
    t_store = cpu_store = 0.0
    for lo in range(0, len(fleet), CHUNK):
        batch = []
        for s in range(lo, min(lo + CHUNK, len(fleet))):
            w, parent, engines, toks, with_prefix = fleet.stored(s)
            tail_toks = toks[2 * spec.prefix_blocks * bs :] if with_prefix else toks
            local = compute_block_hash_for_seq(array("H", tail_toks).tolist(), bs)
            if with_prefix:
                local = prefix_local[fleet.pref[s]] + local
            blocks = [{"block_hash": e, "tokens_hash": h} for e, h in zip(engines, local)]
            batch.append((w, event(w, {"stored": {"parent_hash": parent, "blocks": blocks}})))
        t0, c0 = time.perf_counter(), time.process_time()
        for w, b in batch:
            tree.apply_event(w, b)
        t_store += time.perf_counter() - t0
        cpu_store += time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    tree.find_matches([0])
    t_store += time.perf_counter() - t0
    cpu_store += time.process_time() - c0
    rss1 = rss_bytes()
    removals = [(w, event(w, {"removed": {"block_hashes": hs}})) for w, hs in fleet.removals()]
    t0, c0 = time.perf_counter(), time.process_time()
    for w, b in removals:
        tree.apply_event(w, b)
    tree.find_matches([0])
    t_rm = time.perf_counter() - t0
    cpu_rm = time.process_time() - c0
    for _, toks in queries[:50]:
        tree.find_matches(compute_block_hash_for_seq(toks, bs))
    lat, correct = [], 0
    for inst, toks in queries:
        t0 = time.perf_counter()
        sc = tree.find_matches(compute_block_hash_for_seq(toks, bs))
        lat.append(time.perf_counter() - t0)
        correct += sc.scores.get((inst, 0), 0) == spec.cached_blocks
    pairs = fleet.pairs()
    n_rm = fleet.removed_blocks()
    print(
        json.dumps(
            {
                "bench": "dynamo_radix_tree_fleet",
                "package": "ai-dynamo-runtime",
                "pairs": pairs,
                "ingest_store_blocks_per_s": round(pairs / t_store, 1),
                "ingest_total_blocks_per_s": round((pairs + n_rm) / (t_store + t_rm), 1),
                "ingest_total_blocks_per_cpu_s": round((pairs + n_rm) / (cpu_store + cpu_rm), 1),
                "lookup_p50_us": round(pct(lat, 50) * 1e6, 2),
                "lookup_p99_us": round(pct(lat, 99) * 1e6, 2),
                "lookup_mean_us": round(statistics.fmean(lat) * 1e6, 2),
                "expected_match": f"{correct}/{len(queries)}",
                "rss_delta_mb": round((rss1 - rss0) / 2**20, 1),
                "bytes_per_pair": round((rss1 - rss0) / pairs, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
