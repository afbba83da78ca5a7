"""A replica's round trip to the shared store against the number of tenants whose service it holds, on a
real redis-server: what one replica pays per ``replicas.interval_s`` (50 ms by default) to share the flows'
accounts.

For each tenant count, one replica publishes every tenant's service once; then, round after round, it
publishes one tenant's new total (as steady traffic changes a few) while a second replica reads:

since    the reader asks for the totals changed since its last reply (``SyncRequest.totals_since``: what
         replicas do)
full     the reader asks for every total each round (what they did before; the peer measured in the same
         run)

Also ``accounts_us``: ``ReplicaFlows.request`` and ``apply`` on the replica's side for the same tenants
(one changed per round), in process.  ``target_round_trip_flat_in_tenants``: ``since`` at 10,000 tenants
within 2x of 10.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from kvrouter.flows import Flow, FlowsConfig, ProcessBoard, RateLimiter
from kvrouter.lab.reliability.procs import RedisProcess
from kvrouter.percentiles import summary_us
from kvrouter.replicas import RedisReplicaStore, SyncRequest
from kvrouter.replicas.flows import ReplicaFlows


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tenants", default="10,1000,10000", help="tenant counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=40)


def _req(replica: str, counts: list[tuple[str, float]] | None = None, since: str = "") -> SyncRequest:
    return SyncRequest(replica, 5000, b"", b"", "", 10_000, 1000, counts=counts or [], totals_since=since)


async def _round_trips(
    store: RedisReplicaStore, client: aioredis.Redis, n: int, rounds: int
) -> dict[str, Any]:
    await client.flushdb()
    names = [f"s:1:tenant-{i}" for i in range(n)]
    for lo in range(0, n, 5000):
        await store.sync(_req("writer", [(k, 10.0) for k in names[lo : lo + 5000]]))
    out: dict[str, Any] = {}
    for mode in ("since", "full"):
        at_w = (await store.sync(_req("writer"))).totals_at
        at_r = ""
        times = []
        for k in range(rounds + 1):
            t0 = time.perf_counter()
            got = await store.sync(_req("reader", since=at_r if mode == "since" else ""))
            if k:  # the first read of each mode is a full one
                times.append(time.perf_counter() - t0)
            at_r = got.totals_at
            change = [(names[k % n], 20.0 + k)]
            at_w = (await store.sync(_req("writer", change, since=at_w))).totals_at
        out[mode] = summary_us(times)
    return out


def _accounts(n: int, rounds: int) -> dict[str, Any]:
    board = ProcessBoard()
    flows = ReplicaFlows(board, RateLimiter(FlowsConfig().tenant, board.flows))
    for i in range(n):
        board.flows.charge(Flow(f"tenant-{i}", 1), 10.0)
    _, counts = flows.request()
    flows.published()
    flows.apply([], dict(counts), {}, 0.0, totals_at="1:1", totals_full=True)
    times = []
    for k in range(rounds):
        board.flows.charge(Flow(f"tenant-{k % n}", 1), 1.0)
        t0 = time.perf_counter()
        _, counts = flows.request()
        flows.published()
        flows.apply(
            [], {key: v + 1.0 for key, v in counts}, {}, 0.0, totals_at=f"1:{k + 2}", totals_full=False
        )
        times.append(time.perf_counter() - t0)
    return summary_us(times)


async def _run(a: argparse.Namespace) -> dict[str, Any]:
    counts = [int(x) for x in str(a.tenants).split(",") if x]
    with tempfile.TemporaryDirectory() as d, open(Path(d) / "redis.log", "wb") as log:
        redis = RedisProcess(log, Path(d))
        await redis.start()
        client = aioredis.Redis(host="127.0.0.1", port=redis.port)
        try:
            store = RedisReplicaStore(client, "bench")
            rows = {str(n): await _round_trips(store, client, n, a.rounds) for n in counts}
        finally:
            await client.aclose()
            redis.kill()
    for n in counts:
        rows[str(n)]["accounts_us"] = _accounts(n, a.rounds)
    res: dict[str, Any] = {"round_trip_by_tenants": rows}
    lo, hi = str(min(counts)), str(max(counts))
    res["target_round_trip_flat_in_tenants"] = rows[hi]["since"]["p50_us"] <= 2 * rows[lo]["since"]["p50_us"]
    return res


def main(a: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_run(a))
