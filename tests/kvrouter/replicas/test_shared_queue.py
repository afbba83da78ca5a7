"""Two router replicas (``kvrouter serve`` processes, one of them with 2 workers) through a real
redis-server in front of held upstreams: their limits queue, flow accounts and rate limits are one.

- A high-priority request waiting in one replica is served before the other replica's earlier waiters.
- ``queue_size`` bounds the waiters of every replica together.
- A tenant's requests per minute count in every replica.
- A replica stopped (SIGTERM) answers its waiters at once (429, ``shutting_down``); one killed (SIGKILL)
  holds nobody else's waiters past its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.kvrouter.host.test_serve_workers import HeldFleet, body, children, fresh, serve
from tests.support.redis_server import RedisServer, redis_server
from tests.support.wait import until, until_async

__all__ = ["redis_server"]

pytestmark = pytest.mark.skipif(os.cpu_count() is None, reason="needs /proc")

LEASE_S = 1.0


def fleet_file(fleet: HeldFleet, redis: RedisServer, replica: str, **limits: Any) -> dict[str, Any]:
    return fleet.fleet(
        limits={"max_in_flight": 1, "queue_size": 16, "queue_timeout_s": 60, **limits},
        flows={
            "tenant_header": "x-tenant",
            "tenants": {"vip": {"priority": 1}, "capped": {"requests_per_minute": 3}},
        },
        replicas={
            "redis_url": redis.url,
            "namespace": "queue",
            "replica_id": replica,
            "interval_s": 0.05,
            "lease_s": LEASE_S,
        },
    )


@asynccontextmanager
async def two_replicas(
    tmp: Path, fleet: HeldFleet, redis: RedisServer, **limits: Any
) -> AsyncIterator[tuple[str, str, int]]:
    """Replica a (2 workers) and b (1 process): their base URLs and a's pid."""
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    async with (
        serve(tmp / "a", fleet_file(fleet, redis, "a", **limits), workers=2) as (a, pid),
        serve(tmp / "b", fleet_file(fleet, redis, "b", **limits), workers=1) as (b, _),
    ):
        yield a, b, pid


async def replicas(base: str) -> dict[str, Any]:
    """/health's ``replicas`` part (any worker's)."""
    for _ in range(100):
        st, got = await fresh("GET", base + "/health")
        if st == 200 and got.get("replicas"):
            return dict(got["replicas"])
        await asyncio.sleep(0.05)
    raise AssertionError(f"{base} never answered /health with its replicas part")


async def peers_waiting(base: str, n: int) -> bool:
    return (await replicas(base)).get("peers_waiting") == n


Sent = asyncio.Task[tuple[int, Any]]


def send(base: str, i: int, tenant: str) -> Sent:
    return asyncio.create_task(fresh("POST", base + "/v1/completions", body(i), {"x-tenant": tenant}))


async def test_one_queue_one_priority_order_one_bound_one_rate_limit(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with HeldFleet(2) as fleet, two_replicas(tmp_path, fleet, redis_server, queue_size=5) as (a, b, _):
        first = [send(a, i, "low") for i in range(2)]
        await until(lambda: fleet.held == 2, what="both instances at their cap")
        low = []
        for i in range(4):
            low.append(send(a, 10 + i, "low"))
            await until_async(lambda n=i + 1: peers_waiting(b, n), 20, f"b sees {i + 1} waiting in a")
        vip = send(b, 99, "vip")  # b knows the instances are full: a's load reaches it
        await until_async(lambda: peers_waiting(a, 1), 20, "a sees b's waiter")
        # The bound is the replicas': 5 wait, whichever replica a newcomer reaches.
        refused = [
            await fresh("POST", base + "/v1/completions", body(50 + k), {"x-tenant": "low"})
            for k, base in enumerate([a, b, a, b])
        ]
        assert [st for st, _ in refused] == [429] * 4, refused
        assert all("queue_full" in r["error"]["message"] for _, r in refused), refused
        assert fleet.held == 2
        fleet.release.set()
        assert [st for st, _ in await asyncio.gather(*first, *low, vip)] == [200] * 7
        after = fleet.arrived[2:]
        assert after[0] == "prompt number 99", after  # b's vip before every earlier waiter of a

        # A tenant's 3 requests per minute are the replicas': alternate, each seen by the other first.
        got = []
        for k in range(8):
            got.append((await send([a, b][k % 2], 200 + k, "capped"))[0])
            await asyncio.sleep(0.25)  # a few round trips of both replicas
        assert sorted(got) == [200] * 3 + [429] * 5, got


async def vips_in_a_low_in_b(fleet: HeldFleet, a: str, b: str) -> tuple[list[Sent], list[Sent], Sent]:
    """Both instances held by 2 low requests through a, then 3 vip requests waiting in a (they outrank
    b's waiter) and 1 low one waiting in b, each replica told of the other's."""
    first = [send(a, i, "low") for i in range(2)]
    await until(lambda: fleet.held == 2, what="both instances at their cap")
    a_vips = [send(a, 10 + i, "vip") for i in range(3)]
    await until_async(lambda: peers_waiting(b, 3), 20, "b sees a's waiters")
    b_low = send(b, 20, "low")
    await until_async(lambda: peers_waiting(a, 1), 20, "a sees b's waiter")
    return first, a_vips, b_low


async def test_a_replica_stopped_answers_its_waiters_and_one_killed_holds_nobody(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with HeldFleet(2) as fleet, two_replicas(tmp_path, fleet, redis_server) as (a, b, a_pid):
        first, a_vips, b_low = await vips_in_a_low_in_b(fleet, a, b)

        t0 = time.monotonic()
        os.kill(a_pid, signal.SIGTERM)
        answered = await asyncio.wait_for(asyncio.gather(*a_vips), 20)
        assert time.monotonic() - t0 < 10  # at once, not at their 60 s queue timeout
        assert [st for st, _ in answered] == [429] * 3, answered
        assert all("shutting_down" in r["error"]["message"] for _, r in answered), answered
        assert not b_low.done() and fleet.held == 2  # a's requests in flight still hold the instances
        fleet.release.set()  # they end, a exits; b's waiter goes in the capacity they free
        assert (await asyncio.wait_for(b_low, 30))[0] == 200
        for t in first:  # answered before a exited, or cut off when it did: either way, not hanging
            with contextlib.suppress(aiohttp.ClientError):
                await asyncio.wait_for(t, 30)


async def test_a_killed_replicas_waiters_hold_nobody_past_its_lease(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with HeldFleet(2) as fleet, two_replicas(tmp_path, fleet, redis_server) as (a, b, a_pid):
        first, a_vips, b_low = await vips_in_a_low_in_b(fleet, a, b)
        for pid in [*children(a_pid), a_pid]:
            os.kill(pid, signal.SIGKILL)
        # a's clients see their connections cut (an error, not silence) ...
        for t in [*first, *a_vips]:
            with pytest.raises(aiohttp.ClientError):
                await asyncio.wait_for(t, 20)
        # ... and b, once a's lease has ended, no longer counts a's load nor waits behind a's waiters: its
        # waiter reaches an instance (which still computes a's orphaned requests: held)
        t0 = time.monotonic()
        await until(lambda: fleet.held == 3, 20, "b's waiter dispatched")
        assert time.monotonic() - t0 < 10 * LEASE_S
        assert await peers_waiting(b, 0)
        fleet.release.set()
        assert (await asyncio.wait_for(b_low, 30))[0] == 200
