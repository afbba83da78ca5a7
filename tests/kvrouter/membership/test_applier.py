"""``FleetMembership`` driven by the ``Reconciler`` over real objects: an ``EventSubscriber`` and ``Indexer``
fed by the simulated vLLM publisher over ZeroMQ on 127.0.0.1, an ``UpstreamPool`` health-checking a small
HTTP server, the ``LoadTracker``.  A new instance is subscribed, replayed and checked; a leaving one is
drained and its blocks, sources and load dropped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from indexer import Indexer, SourceKey
from indexer.config import FleetConfig, IndexerOptions, InstanceConfig
from indexer.subscriber import EventSubscriber
from kvrouter.gateway.fleet_membership import FleetMembership
from kvrouter.gateway.upstream import UpstreamPool
from kvrouter.lab.sim.engine.events import BlockStored
from kvrouter.lab.sim.engine.types import BlockHash
from kvrouter.lab.sim.server.publisher import EventPublisher, PublisherConfig
from kvrouter.membership import Reconciler
from kvrouter.routing import LoadTracker
from kvrouter.types import InstanceId, RequestId
from tests.support.net import free_port
from tests.support.wait import until

BS = 16


def batch(k: int) -> tuple[BlockStored, list[int]]:
    toks = list(range(k * 1000 + 1, k * 1000 + 1 + 2 * BS))
    return BlockStored([BlockHash(k * 10 + 1), BlockHash(k * 10 + 2)], None, toks, BS), toks


def held(ix: Indexer, name: str, toks: list[int]) -> int:
    return sum(m.matched_blocks for m in ix.lookup(toks).instances if m.instance == name)


@dataclass
class World:
    """The gateway's objects, wired as ``Gateway`` wires them, plus the reconciler."""

    indexer: Indexer
    subscriber: EventSubscriber
    load: LoadTracker
    pool: UpstreamPool
    reconciler: Reconciler
    health_url: str
    health: dict[str, int]
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def inst(self, name: str, pub: EventPublisher, **kw: object) -> InstanceConfig:
        c = pub.config
        return InstanceConfig(
            name,
            url=f"{self.health_url}/{name}",
            events=c.endpoint,
            replay=c.replay_endpoint,
            **kw,  # type: ignore[arg-type]
        )


@pytest.fixture
async def world() -> AsyncIterator[World]:
    health: dict[str, int] = {}

    async def check(request: web.Request) -> web.Response:
        return web.Response(status=health.get(request.match_info["name"], 200))

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/{name}/health", check)
    app.router.add_get("/{name}/v1/models", models)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    ix = Indexer(BS)
    sub = EventSubscriber(ix, FleetConfig(block_size=BS, indexer=IndexerOptions(replay_timeout_s=1.0)))
    await sub.start()
    load = LoadTracker()
    pool = UpstreamPool([], load, health_interval_s=60.0, metrics_interval_s=60.0)
    session = aiohttp.ClientSession()
    await pool.start(session)
    w = World(
        ix, sub, load, pool, Reconciler(FleetMembership(pool, ix, sub)), f"http://127.0.0.1:{port}", health
    )
    m = w.reconciler.membership
    assert isinstance(m, FleetMembership)
    m.on_added = lambda i: w.added.append(i.name)
    m.on_removed = lambda i: w.removed.append(i.name)
    w.reconciler.poll_s = 0.01
    try:
        yield w
    finally:
        await w.reconciler.stop()
        await pool.stop()
        await sub.stop()
        await session.close()
        await runner.cleanup()


@pytest.fixture
async def pubs() -> AsyncIterator[list[EventPublisher]]:
    out = []
    for _ in range(2):
        ep, rep = free_port(), free_port()
        p = EventPublisher(
            PublisherConfig(endpoint=f"tcp://127.0.0.1:{ep}", replay_endpoint=f"tcp://127.0.0.1:{rep}")
        )
        await p.start()
        out.append(p)
    try:
        yield out
    finally:
        for p in out:
            await p.stop()


async def test_a_new_instance_is_subscribed_replayed_and_checked(
    world: World, pubs: list[EventPublisher]
) -> None:
    before = []
    for k in range(5):  # published before the router knows the instance: recovered by replay
        ev, toks = batch(k)
        pubs[0].publish([ev])
        before.append(toks)
    d = world.reconciler.set_desired("fleet", [world.inst("v0", pubs[0])])
    assert d.summary()["added"] == ["v0"]
    await world.reconciler.settle()
    u = world.pool.upstreams["v0"]
    assert u.healthy and u.served_models == ["m"] and world.added == ["v0"]
    assert [t.key for t in world.pool.targets(None)] == ["v0"]
    assert [i.name for i in world.subscriber.fleet.instances] == ["v0"]
    await until(lambda: all(held(world.indexer, "v0", t) == 2 for t in before), what="replayed batches")
    ev, toks = batch(50)
    pubs[0].publish([ev])
    await until(lambda: held(world.indexer, "v0", toks) == 2)


async def test_a_new_instance_failing_its_check_takes_no_traffic(
    world: World, pubs: list[EventPublisher]
) -> None:
    world.health["v1"] = 503
    world.reconciler.set_desired("fleet", [world.inst("v1", pubs[1])])
    await world.reconciler.settle()
    assert not world.pool.upstreams["v1"].healthy
    assert [t.healthy for t in world.pool.targets(None)] == [False]


async def test_a_leaving_instance_is_drained_then_its_blocks_dropped(
    world: World, pubs: list[EventPublisher]
) -> None:
    r = world.reconciler
    r.set_desired("fleet", [world.inst("v0", pubs[0]), world.inst("v1", pubs[1])])
    await r.settle()
    ev0, t0 = batch(1)
    ev1, t1 = batch(2)
    await until(lambda: all(world.subscriber.status[SourceKey(n, 0)].connected for n in ("v0", "v1")))
    pubs[0].publish([ev0])
    pubs[1].publish([ev1])
    await until(lambda: held(world.indexer, "v0", t0) == 2 and held(world.indexer, "v1", t1) == 2)

    world.load.dispatch(RequestId("r1"), InstanceId("v0"), 100)  # a request in flight on v0
    r.drain_timeout_s = 10.0
    looked: list[int] = []  # what the drain saw each time it looked at v0's requests
    in_flight = r.membership.in_flight

    def counted(name: str) -> int:
        n = in_flight(name)
        looked.append(n)
        return n

    r.membership.in_flight = counted  # type: ignore[method-assign]
    d = r.set_desired("fleet", [world.inst("v1", pubs[1])])
    assert d.summary()["removed"] == ["v0"]
    await until(lambda: "v0" in r.draining)
    assert [t.key for t in world.pool.targets(None)] == ["v1"]  # no new request goes to v0
    assert world.pool.in_flight("v0") == 1 and held(world.indexer, "v0", t0) == 2  # still subscribed
    # The drain looked again after seeing the request, and kept the instance: it waits for the request.
    await until(lambda: len(looked) >= 2, what="the drain looking twice")
    assert looked[:2] == [1, 1] and r.busy() and "v0" in world.pool.upstreams

    world.load.finish(RequestId("r1"))  # its last request ends: the drain completes
    await asyncio.wait_for(r.settle(), 15.0)
    assert "v0" not in world.pool.upstreams and InstanceId("v0") not in world.load.loads
    assert held(world.indexer, "v0", t0) == 0 and held(world.indexer, "v1", t1) == 2
    assert all(s.instance != "v0" for s in world.indexer.sources())
    assert all(s.instance != "v0" for s in world.subscriber.status)
    assert [i.name for i in world.subscriber.fleet.instances] == ["v1"] and world.removed == ["v0"]
    pubs[0].publish([batch(3)[0]])  # it keeps publishing: nobody listens any more
    # a later batch from the instance that stays arrives: ingestion ran after v0's publish
    ev4, t4 = batch(4)
    pubs[1].publish([ev4])
    await until(lambda: held(world.indexer, "v1", t4) == 2, what="v1's later batch")
    assert held(world.indexer, "v0", batch(3)[1]) == 0 and held(world.indexer, "v1", batch(3)[1]) == 0


async def test_a_drain_that_times_out_drops_the_instance_anyway(
    world: World, pubs: list[EventPublisher]
) -> None:
    r = world.reconciler
    r.set_desired("fleet", [world.inst("v0", pubs[0])])
    await r.settle()
    world.load.dispatch(RequestId("stuck"), InstanceId("v0"), 10)
    r.drain_timeout_s = 0.1
    r.set_desired("fleet", [])
    await asyncio.wait_for(r.settle(), 15.0)
    assert r.counters["drain_timeouts"] == 1 and "v0" not in world.pool.upstreams
    world.load.finish(RequestId("stuck"))  # the proxy finishing it later is harmless
    assert world.load.total_in_flight() == 0


async def test_new_endpoints_are_a_remove_then_add(world: World, pubs: list[EventPublisher]) -> None:
    r = world.reconciler
    r.set_desired("fleet", [world.inst("v", pubs[0])])
    await r.settle()
    ev0, t0 = batch(1)
    await until(lambda: world.subscriber.status[SourceKey("v", 0)].connected)
    pubs[0].publish([ev0])
    await until(lambda: held(world.indexer, "v", t0) == 2)
    ev1, t1 = batch(2)
    pubs[1].publish([ev1])  # buffered at the new endpoint, replayed on join
    r.set_desired("fleet", [world.inst("v", pubs[1])])  # the pod came back elsewhere
    await r.settle()
    await until(lambda: held(world.indexer, "v", t1) == 2)
    assert held(world.indexer, "v", t0) == 0
    assert world.subscriber.status[SourceKey("v", 0)].endpoint == pubs[1].config.endpoint


async def test_a_weight_change_keeps_blocks_and_subscription(
    world: World, pubs: list[EventPublisher]
) -> None:
    r = world.reconciler
    r.set_desired("fleet", [world.inst("v0", pubs[0])])
    await r.settle()
    ev, toks = batch(1)
    await until(lambda: world.subscriber.status[SourceKey("v0", 0)].connected)
    pubs[0].publish([ev])
    await until(lambda: held(world.indexer, "v0", toks) == 2)
    r.set_desired("fleet", [world.inst("v0", pubs[0], weight=4.0)])
    await r.settle()
    assert r.counters["updated"] == 1 and world.pool.targets(None)[0].weight == 4.0
    assert held(world.indexer, "v0", toks) == 2 and world.subscriber.status[SourceKey("v0", 0)].connected


async def test_removal_during_a_health_check_reports_to_no_one(
    world: World, pubs: list[EventPublisher]
) -> None:
    changes: list[tuple[str, bool]] = []
    world.pool.on_change = lambda name, ok: changes.append((name, ok))
    add = asyncio.create_task(world.pool.add(world.inst("v0", pubs[0])))
    await asyncio.sleep(0)  # the check is under way
    world.pool.remove("v0")
    u = await add
    assert u is not None and u.healthy  # the check passed...
    assert changes == [] and "v0" not in world.pool.upstreams  # ...for an instance that is gone
    await world.pool.add(world.inst("v1", pubs[1]))
    assert changes == [("v1", True)]
