"""One behaviour suite for every ``ReplicaStore``: ``RedisReplicaStore`` on a real redis-server and the
in-process ``MemoryReplicaHub`` (on a fake clock).  Time passes with ``advance``: real sleeps on Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
import redis.asyncio as aioredis

from kvrouter.replicas import MemoryReplicaHub, RedisReplicaStore, ReplicaStore, SyncRequest
from kvrouter.replicas.state import SpecWire
from tests.support.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

LEASE_MS = 400
WINDOW_MS = 1500


class World(msgspec.Struct):
    store: ReplicaStore
    advance: Callable[[float], Awaitable[None]]
    keeping: Callable[[int], ReplicaStore]
    """The same store, with another ``keep_versions``."""


class FakeClock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["memory", "redis"])
async def world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    if request.param == "memory":
        clock = FakeClock()

        async def tick(dt: float) -> None:
            clock.t += dt

        hub = MemoryReplicaHub(clock)
        yield World(hub, tick, lambda keep: MemoryReplicaHub(clock, keep_versions=keep))
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    client = aioredis.Redis(host="127.0.0.1", port=server.port, decode_responses=False)
    await client.flushdb()
    yield World(
        RedisReplicaStore(client, "t"),
        asyncio.sleep,
        lambda keep: RedisReplicaStore(client, "t", keep_versions=keep),
    )
    await client.aclose()


def req(replica: str, loads: dict[str, tuple[int, int]], specs: list[SpecWire] | None = None,
        cursor: str = "", max_read: int = 100, lease_ms: int = LEASE_MS) -> SyncRequest:  # fmt: skip
    enc = msgspec.msgpack.encode
    return SyncRequest(
        replica, lease_ms, enc(loads), enc(specs) if specs else b"", cursor, WINDOW_MS, max_read
    )


def loads_of(raw: list[bytes]) -> list[dict[str, list[int]]]:
    return sorted((msgspec.msgpack.decode(r) for r in raw), key=str)


def specs_of(pairs: list[tuple[int, bytes]]) -> list[str]:
    return [e.instance for _, raw in pairs for e in msgspec.msgpack.decode(raw, type=list[SpecWire])]


async def test_peers_see_each_others_load_but_not_their_own(world: World) -> None:
    s = world.store
    await s.sync(req("r1", {"w0": (2, 100)}))
    r2 = await s.sync(req("r2", {"w1": (1, 10)}))
    assert loads_of(r2.peer_loads) == [{"w0": [2, 100]}]
    r1 = await s.sync(req("r1", {"w0": (3, 0)}))
    assert loads_of(r1.peer_loads) == [{"w1": [1, 10]}]
    r3 = await s.sync(req("r3", {}))
    assert loads_of(r3.peer_loads) == [{"w0": [3, 0]}, {"w1": [1, 10]}]
    assert r3.server_ms >= r1.server_ms


async def test_a_lease_not_refreshed_ends(world: World) -> None:
    """Decided on the store's clock (each reply's ``server_ms``), with a lease a busy machine cannot outrun
    between two round trips; the waits are lower bounds, so the second read is surely past the lease."""
    s, lease = world.store, 1500
    first = await s.sync(req("crashed", {"w0": (5, 0)}, lease_ms=lease))
    await world.advance(0.05)
    during = await s.sync(req("r2", {}, lease_ms=lease))
    assert during.server_ms < first.server_ms + lease
    assert loads_of(during.peer_loads) == [{"w0": [5, 0]}]
    await world.advance(lease / 1000 + 0.05)  # past the crashed replica's lease
    after = await s.sync(req("r2", {}, lease_ms=lease))
    assert after.server_ms > first.server_ms + lease and after.peer_loads == []


async def test_leave_ends_the_lease_at_once(world: World) -> None:
    s = world.store
    await s.sync(req("r1", {"w0": (1, 0)}))
    await s.leave("r1")
    assert (await s.sync(req("r2", {}))).peer_loads == []


async def test_speculative_batches_reach_peers_once_in_order(world: World) -> None:
    s = world.store
    e = [SpecWire("w0", 0, b"\x01" * 8, 5000)]
    f = [SpecWire("w1", 0, b"\x02" * 8, 5000)]
    await s.sync(req("r1", {}, e))
    await s.sync(req("r1", {}, f))
    first = await s.sync(req("r2", {}))
    assert specs_of(first.peer_specs) == ["w0", "w1"]
    assert all(first.server_ms - ms < 1000 for ms, _ in first.peer_specs)
    again = await s.sync(req("r2", {}, cursor=first.cursor))
    assert again.peer_specs == [] and again.cursor == first.cursor
    # our own batches advance our cursor but are never returned to us
    mine = await s.sync(req("r2", {}, [SpecWire("w2", 0, b"\x03" * 8, 5000)], cursor=first.cursor))
    assert mine.peer_specs == [] and mine.cursor != first.cursor
    assert specs_of((await s.sync(req("r1", {}, cursor=""))).peer_specs) == ["w2"]


async def test_reads_are_bounded_and_resume_at_the_cursor(world: World) -> None:
    s = world.store
    for i in range(5):
        await s.sync(req("r1", {}, [SpecWire(f"w{i}", 0, b"\x00" * 8, 5000)]))
    seen, cursor = [], ""
    for _ in range(3):
        r = await s.sync(req("r2", {}, cursor=cursor, max_read=2))
        seen += specs_of(r.peer_specs)
        cursor = r.cursor
    assert seen == [f"w{i}" for i in range(5)]


async def test_a_fresh_reader_sees_only_the_window(world: World) -> None:
    s = world.store
    await s.sync(req("r1", {}, [SpecWire("old", 0, b"\x00" * 8, 5000)]))
    await world.advance(WINDOW_MS / 1000 + 0.2)
    await s.sync(req("r1", {}, [SpecWire("new", 0, b"\x00" * 8, 5000)]))
    assert specs_of((await s.sync(req("r2", {}))).peer_specs) == ["new"]


def with_queue(
    r: SyncRequest, queue: bytes = b"", counts: list[tuple[str, float]] | None = None
) -> SyncRequest:
    return msgspec.structs.replace(r, queue=queue, counts=counts or [])


async def test_peers_see_each_others_waiters_stamped_until_they_have_none(world: World) -> None:
    s, lease = world.store, 1500
    first = await s.sync(with_queue(req("r1", {}, lease_ms=lease), b"q1"))
    seen = await s.sync(req("r2", {}, lease_ms=lease))
    assert [q for _, q in seen.peer_queues] == [b"q1"]
    assert first.server_ms <= seen.peer_queues[0][0] <= seen.server_ms  # stamped on the store's clock
    assert (await s.sync(with_queue(req("r1", {}, lease_ms=lease), b"q1"))).peer_queues == []  # not our own
    await s.sync(req("r1", {}, lease_ms=lease))  # r1 has no waiters any more
    assert (await s.sync(req("r2", {}, lease_ms=lease))).peer_queues == []
    await s.sync(with_queue(req("crashed", {}, lease_ms=lease), b"q3"))
    assert [q for _, q in (await s.sync(req("r2", {}, lease_ms=lease))).peer_queues] == [b"q3"]
    await world.advance(lease / 1000 + 0.05)  # the crashed replica's waiters end with its lease
    assert (await s.sync(req("r2", {}, lease_ms=lease))).peer_queues == []


async def test_leave_drops_the_waiters_at_once(world: World) -> None:
    s = world.store
    await s.sync(with_queue(req("r1", {}), b"q1"))
    await s.leave("r1")
    assert (await s.sync(req("r2", {}))).peer_queues == []


async def test_running_totals_sum_every_replicas_latest_and_outlive_it(world: World) -> None:
    """A service total published again (a repeated round trip) counts once; a replica's last total stays
    in the sum after it leaves (service given is not taken back).  Rate use is read per live peer."""
    s = world.store
    await s.sync(with_queue(req("r1", {}), counts=[("s:0:a", 5.0), ("r:a", 1.0), ("t:a", 40.0)]))
    got = await s.sync(with_queue(req("r2", {}), counts=[("s:0:a", 3.5), ("r:a", 2.0)]))
    assert got.totals == {"s:0:a": 8.5}
    assert got.peer_use == {"r1": {"r:a": 1.0, "t:a": 40.0}}
    await s.sync(with_queue(req("r1", {}), counts=[("s:0:a", 5.0)]))  # a repeat
    got = await s.sync(req("r2", {}))
    assert got.totals == {"s:0:a": 8.5} and got.peer_use == {"r1": {"r:a": 1.0, "t:a": 40.0}}
    mine = await s.sync(with_queue(req("r1", {}), counts=[("s:0:a", 7.25), ("s:1:b", -2.0), ("r:a", 3.0)]))
    assert mine.peer_use == {"r2": {"r:a": 2.0}}
    await s.leave("r1")
    got = await s.sync(req("r2", {}))
    assert got.totals == {"s:0:a": 10.75, "s:1:b": -2.0} and got.peer_use == {}


def since_(r: SyncRequest, at: str) -> SyncRequest:
    return msgspec.structs.replace(r, totals_since=at)


async def test_a_reader_since_its_last_reply_gets_only_the_totals_changed_after_it(world: World) -> None:
    """Each reply says where the totals stand; a request since then gets only the sums changed after it
    (its own publishing of the same round trip included), so many tenants cost a round trip what changed,
    not their number.  A request since an unknown epoch, or a version the store has not reached (it
    restarted, its keys expired), gets every sum."""
    s = world.store
    before = (await s.sync(req("r2", {}))).totals_at
    await s.sync(with_queue(req("r1", {}), counts=[(f"s:0:t{i}", float(i + 1)) for i in range(1200)]))
    many = await s.sync(since_(req("r3", {}), before))  # more than one of the script's reads of 1,000
    assert not many.totals_full and len(many.totals) == 1200 and many.totals["s:0:t1199"] == 1200.0
    first = await s.sync(req("r2", {}))
    assert first.totals_full and len(first.totals) == 1200 and first.totals["s:0:t7"] == 8.0
    at = first.totals_at
    quiet = await s.sync(since_(req("r2", {}), at))
    assert (quiet.totals_full, quiet.totals, quiet.totals_at) == (False, {}, at)
    await s.sync(with_queue(req("r1", {}), counts=[("s:0:t3", 10.0), ("s:1:new", 2.0), ("r:a", 1.0)]))
    got = await s.sync(since_(with_queue(req("r2", {}), counts=[("s:0:t7", 1.5)]), at))
    assert not got.totals_full and got.totals == {"s:0:t3": 10.0, "s:1:new": 2.0, "s:0:t7": 9.5}
    assert (await s.sync(since_(req("r2", {}), got.totals_at))).totals == {}
    epoch, _, version = got.totals_at.partition(":")
    for stale in (f"{epoch}:{int(version) + 5}", f"1{epoch}:0", "", "garbage"):
        full = await s.sync(since_(req("r2", {}), stale))
        assert full.totals_full and len(full.totals) == 1201 and full.totals["s:0:t7"] == 9.5, stale


async def test_a_total_published_as_0_leaves_the_sum_and_a_sum_at_0_is_dropped(world: World) -> None:
    """A replica that forgot a flow publishes its total as 0: the sum loses that replica's share, and once
    every replica has, the sum is gone (a reader of changes gets it as 0; a full read lacks it)."""
    s = world.store
    await s.sync(with_queue(req("r1", {}), counts=[("s:0:a", 5.0), ("s:0:b", 2.0)]))
    at = (await s.sync(with_queue(req("r2", {}), counts=[("s:0:a", 3.0)]))).totals_at
    await s.sync(with_queue(req("r1", {}), counts=[("s:0:a", 0.0)]))
    got = await s.sync(since_(req("r3", {}), at))
    assert got.totals == {"s:0:a": 3.0}
    got = await s.sync(since_(with_queue(req("r2", {}), counts=[("s:0:a", 0.0)]), got.totals_at))
    assert got.totals == {"s:0:a": 0.0}
    assert (await s.sync(req("r3", {}))).totals == {"s:0:b": 2.0}
    # charged again after: counted from 0, as a new flow
    await s.sync(with_queue(req("r1", {}), counts=[("s:0:a", 1.0)]))
    assert (await s.sync(req("r3", {}))).totals == {"s:0:a": 1.0, "s:0:b": 2.0}


async def test_the_names_of_sums_dropped_long_ago_leave_the_log_of_changes(world: World) -> None:
    """With ``keep_versions`` 2, a dropped sum's name stays in the log for two more versions; then it
    leaves it, and a reader from before that reads every sum (it would miss the drop otherwise), while a
    reader from after it still gets only changes."""
    s = world.keeping(2)
    old = (await s.sync(with_queue(req("r1", {}), counts=[("s:0:gone", 4.0), ("s:0:kept", 1.0)]))).totals_at
    at = (await s.sync(with_queue(req("r1", {}), counts=[("s:0:gone", 0.0)]))).totals_at
    got = await s.sync(since_(req("r2", {}), old))
    assert not got.totals_full and got.totals == {"s:0:gone": 0.0}
    recent = at
    for i in range(4):  # four more versions: the drop is older than two
        recent = (
            await s.sync(since_(with_queue(req("r1", {}), counts=[("s:0:kept", i + 2.0)]), recent))
        ).totals_at
    stale = await s.sync(since_(req("r2", {}), at))
    assert stale.totals_full and stale.totals == {"s:0:kept": 5.0}
    fresh = await s.sync(since_(req("r2", {}), recent))
    assert not fresh.totals_full and fresh.totals == {}
