"""Warm restart: snapshot -> new Indexer -> restore gives the same lookups, positions and trust; snapshots
that do not fit are refused; the file and Redis stores behave alike; and over real ZeroMQ an indexer
restarted from a snapshot replays only what it missed and ends exact (or sees the engine's restart)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from prometheus_client import CollectorRegistry

from indexer import HASH_VERSION, Indexer, SourceKey, Trust
from indexer.config import FleetConfig, IndexerOptions, InstanceConfig
from indexer.encode import PayloadEncoder
from indexer.snapshot import SnapshotCorrupt, SnapshotError, SnapshotMismatch
from indexer.subscriber import EventSubscriber
from kvrouter.lab.sim.engine.events import BlockRemoved
from kvrouter.lab.sim.server.publisher import EventPublisher, PublisherConfig
from kvrouter.replicas.warm import (
    FileSnapshotStore,
    RedisSnapshotStore,
    SnapshotStore,
    WarmRestart,
    mark_restored,
)
from tests.support.index_fleet import BS, fleet, held, seq_event
from tests.support.index_model import SALTS, IndexMachine
from tests.support.net import free_port
from tests.support.redis_server import RedisServer, redis_server
from tests.support.wait import until

__all__ = ["redis_server"]


def view(ix: Indexer, toks: list[int], salt: str | None = None) -> list[tuple[object, ...]]:
    res = ix.lookup(toks, cache_salt=salt).instances
    return sorted((m.instance, m.dp_rank, m.matched_blocks, sorted(m.tiers.items()), m.trust) for m in res)


def populated() -> tuple[Indexer, list[list[int]]]:
    """Two instances, DP ranks, offload tiers, a duplicate store, a hole, a salt, sequence positions."""
    ix = Indexer(4)
    enc = PayloadEncoder()
    a = list(range(1, 17))
    b = list(range(100, 112))
    ix.register(SourceKey("v", 0), has_replay=True)
    ix.on_message(SourceKey("v", 0), 0, enc.batch([enc.stored([1, 2, 3, 4], None, a, 4)], ts=10.0))
    ix.on_message(SourceKey("v", 0), 1, enc.batch([enc.stored([1, 2], None, [], 0, medium="CPU")], ts=11.0))
    ix.on_message(SourceKey("v", 0), 2, enc.batch([enc.stored([1], None, a[:4], 4)], ts=12.0))  # duplicate
    ix.apply_payload("v", enc.batch([enc.stored([7, 8, 9], None, b, 4)], ts=5.0, dp_rank=1), dp_rank=1)
    ix.apply_payload("w", enc.batch([enc.stored([5, 6], None, a[:8], 4, extra_keys=[("s",), None])], ts=3.0))
    ix.apply_payload("w", enc.batch([enc.removed([7])], ts=4.0))  # unknown: counted, harmless
    ix.apply_payload("v", enc.batch([enc.removed([8])], ts=6.0, dp_rank=1), dp_rank=1)  # a hole
    ix.register(SourceKey("cold", 0))
    return ix, [[*a, 0], [*b, 0]]


def test_restore_reproduces_lookups_positions_and_trust() -> None:
    ix, prompts = populated()
    data = ix.snapshot(created_at=123.0)
    copy = Indexer(4)
    assert sorted(copy.restore(data)) == sorted(ix.sources())
    for toks in prompts:
        for salt in (None, "s"):
            assert view(copy, toks, salt) == view(ix, toks, salt)
    for src in ix.sources():
        a, b = ix.sync(src), copy.sync(src)
        assert (a.last, a.last_ts, a.trust, a.has_replay) == (b.last, b.last_ts, b.trust, b.has_replay)
        assert ix.index.blocks(src) == copy.index.blocks(src)
    assert copy.last_event_ts == ix.last_event_ts and copy.index.total_entries() == ix.index.total_entries()
    # references survive: the duplicate GPU store of block 1 needs two removals in both
    enc = PayloadEncoder()
    for x in (ix, copy):
        x.apply_payload("v", enc.batch([enc.removed([1])], ts=13.0))
    assert view(copy, prompts[0]) == view(ix, prompts[0])
    # and a restored engine id still resolves a child's parent
    child = enc.batch([enc.stored([10], 4, list(range(17, 21)), 4)], ts=14.0)
    for x in (ix, copy):
        x.apply_payload("v", child)
    longer = [*prompts[0][:-1], 17, 18, 19, 20, 0]
    assert view(copy, longer) == view(ix, longer)
    assert not copy.counters.event_errors


def test_snapshots_that_do_not_fit_are_refused() -> None:
    ix, _ = populated()
    data = ix.snapshot()
    with pytest.raises(SnapshotMismatch):
        Indexer(16).restore(data)
    head = msgspec.msgpack.decode(data)
    for field, value in (("hash_version", HASH_VERSION + 1), ("format", 99)):
        with pytest.raises(SnapshotMismatch):
            Indexer(4).restore(msgspec.msgpack.encode({**head, field: value}))
    for junk in (b"", b"\xc1garbage", msgspec.msgpack.encode({**head, "sources": "x"})):
        with pytest.raises(SnapshotCorrupt):
            Indexer(4).restore(junk)
    with pytest.raises(SnapshotError):
        ix.restore(data)  # already holds blocks
    only = Indexer(4)
    assert only.restore(data, only=[SourceKey("w", 0)]) == [SourceKey("w", 0)]
    assert only.sources() == [SourceKey("w", 0)] and only.index.sources() == [SourceKey("w", 0)]


class SnapshotMachine(IndexMachine):
    """``test_index_props``' random histories: a restored copy answers like the original at every step."""

    @invariant()
    def restored_copy_agrees(self) -> None:
        copy = Indexer(self.ix.block_size)
        copy.restore(self.ix.snapshot())
        for seq in self.seqs:
            toks = [t for b in seq for t in b] + [1, 2]
            for salt in SALTS:
                assert view(copy, toks, salt) == view(self.ix, toks, salt)


TestSnapshotOfRandomHistories = SnapshotMachine.TestCase
TestSnapshotOfRandomHistories.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)


# ---------------------------------------------------------------------------------------------- stores
@pytest.fixture(params=["file", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SnapshotStore]:
    if request.param == "file":
        yield FileSnapshotStore(tmp_path / "sub" / "index.snap")
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    client = aioredis.Redis(host="127.0.0.1", port=server.port, decode_responses=False)
    await client.flushdb()
    yield RedisSnapshotStore(client, "{t}:snapshot")
    await client.aclose()


async def test_a_store_returns_the_latest_snapshot(store: SnapshotStore) -> None:
    assert await store.load() is None
    await store.save(b"one")
    await store.save(b"two" * 1000)
    assert await store.load() == b"two" * 1000


async def test_warm_restart_saves_periodically_and_restores_at_start(store: SnapshotStore) -> None:
    ix, prompts = populated()
    reg = CollectorRegistry()
    warm = WarmRestart(ix, store, interval_s=0.05, registry=reg)
    await warm.start()

    def saves() -> float:
        return reg.get_sample_value("kvrouter_index_snapshots_total", {"op": "save", "result": "ok"}) or 0.0

    await until(lambda: saves() >= 2, what="two periodic saves")  # (before stop, which saves once more)
    await warm.stop()
    fresh = Indexer(4)
    assert len(await WarmRestart(fresh, store).restore()) == len(ix.sources())
    assert view(fresh, prompts[0]) == view(ix, prompts[0])
    other, reg2 = Indexer(8), CollectorRegistry()  # another block size: counted, started cold
    assert await WarmRestart(other, store, registry=reg2).restore() == []
    labels = {"op": "restore", "result": "snapshot_mismatch"}
    assert reg2.get_sample_value("kvrouter_index_snapshots_total", labels) == 1


# ---------------------------------------------------------------------------------------------- ZeroMQ
@pytest.fixture
async def publisher() -> AsyncIterator[tuple[EventPublisher, InstanceConfig]]:
    port, rport = free_port(), free_port()
    pub = EventPublisher(
        PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    )
    await pub.start()
    yield pub, InstanceConfig("v0", events=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}")
    await pub.stop()


async def run_until_down(
    ix: Indexer, inst: InstanceConfig, pub: EventPublisher, ks: range
) -> list[list[int]]:
    sub = EventSubscriber(ix, fleet([inst]))
    await sub.start()
    try:
        await until(lambda: sub.status[SourceKey("v0", 0)].connected)
        toks = []
        for k in ks:
            ev, t = seq_event(k)
            pub.publish([ev])
            toks.append(t)
        await until(lambda: all(held(ix, "v0", t) == 2 for t in toks))
    finally:
        await sub.stop()
    return toks


async def test_an_indexer_restarted_from_a_snapshot_replays_only_what_it_missed(
    publisher: tuple[EventPublisher, InstanceConfig],
) -> None:
    pub, inst = publisher
    ref = Indexer(BS)  # an indexer that never goes down
    ref_sub = EventSubscriber(ref, fleet([inst]))
    await ref_sub.start()
    ix = Indexer(BS)
    try:
        before = await run_until_down(ix, inst, pub, range(10))
        snap = ix.snapshot()
        # while the router is down: new sequences, and the engine evicts one it held
        missed = []
        for k in range(10, 20):
            ev, t = seq_event(k)
            pub.publish([ev])
            missed.append(t)
        pub.publish([BlockRemoved([1, 2])])  # sequence 0's two blocks
        fresh = Indexer(BS)
        assert fresh.restore(snap) == [SourceKey("v0", 0)]
        sub = EventSubscriber(fresh, fleet([inst]))
        await sub.start()
        mark_restored(sub, [SourceKey("v0", 0)], time.monotonic())
        try:
            await until(
                lambda: all(held(fresh, "v0", t) == 2 for t in missed) and held(fresh, "v0", before[0]) == 0
            )
            await until(lambda: held(ref, "v0", before[0]) == 0)
            sync = fresh.sync(SourceKey("v0", 0))
            assert fresh.trust(SourceKey("v0", 0)) is Trust.EXACT and sync.last == 20 and sync.restarts == 0
            assert fresh.counters.batches == 11  # seq 10..20: nothing before the snapshot came again
            assert sub.status[SourceKey("v0", 0)].disconnected_at is None  # it connected
            for t in before + missed:
                assert held(fresh, "v0", t) == held(ref, "v0", t)
            assert fresh.index.blocks(SourceKey("v0", 0)) == ref.index.blocks(SourceKey("v0", 0))
        finally:
            await sub.stop()
    finally:
        await ref_sub.stop()


async def test_a_restored_source_whose_engine_restarted_meanwhile_is_reset(
    publisher: tuple[EventPublisher, InstanceConfig],
) -> None:
    pub, inst = publisher
    ix = Indexer(BS)
    old = await run_until_down(ix, inst, pub, range(5))
    snap = ix.snapshot()
    await pub.crash()
    await asyncio.sleep(0.3)
    await pub.restart()  # sequence back to 0, cache empty; its seq 4 is a different batch, newer
    new = []
    for k in range(50, 56):
        ev, t = seq_event(k)
        pub.publish([ev])
        new.append(t)
    fresh = Indexer(BS)
    fresh.restore(snap)
    assert all(held(fresh, "v0", t) == 2 for t in old)
    sub = EventSubscriber(fresh, fleet([inst]))
    await sub.start()
    try:
        await until(lambda: all(held(fresh, "v0", t) == 2 for t in new))
        assert all(held(fresh, "v0", t) == 0 for t in old)
        assert fresh.sync(SourceKey("v0", 0)).restarts == 1
        assert fresh.trust(SourceKey("v0", 0)) is Trust.EXACT
    finally:
        await sub.stop()


async def test_a_restored_source_that_never_returns_goes_stale() -> None:
    """Nobody publishes at the instance's endpoint any more: the restored blocks are dropped after
    ``stale_after_s`` by the subscriber's own rule, instead of being trusted forever."""
    ix, prompts = populated()
    fresh = Indexer(4)
    fresh.restore(ix.snapshot(), only=[SourceKey("v", 0)])
    assert held(fresh, "v", prompts[0]) == 4
    cfg = FleetConfig(
        block_size=4,
        instances=[InstanceConfig("v", events=f"tcp://127.0.0.1:{free_port()}")],
        indexer=IndexerOptions(stale_after_s=0.2),
    )
    sub = EventSubscriber(fresh, cfg)
    await sub.start()
    try:
        mark_restored(sub, fresh.sources(), time.monotonic())
        await until(lambda: held(fresh, "v", prompts[0]) == 0)
        assert fresh.trust(SourceKey("v", 0)) is Trust.COLD and sub.counters["stale_drops"] == 1
    finally:
        await sub.stop()
