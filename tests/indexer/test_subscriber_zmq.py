"""The indexer over real ZeroMQ sockets on 127.0.0.1, fed by the simulated fleet's vLLM-faithful publisher:
dropped batches recovered by replay, late joins, engine restarts, data-parallel ranks, bind mode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from indexer import Indexer, SourceKey, Trust
from indexer.config import FleetConfig, IndexerOptions, InstanceConfig
from indexer.subscriber import EventSubscriber
from kvrouter.lab.sim.engine.events import AllBlocksCleared
from kvrouter.lab.sim.server.publisher import EventPublisher, PublisherConfig, topic_for
from tests.support.index_fleet import BS, fleet, held, seq_event
from tests.support.net import free_port
from tests.support.wait import until


@pytest.mark.parametrize("release", ["0.25.0", "0.33.0"])
async def test_dropped_batches_are_recovered_by_replay(release: str) -> None:
    port, rport = free_port(), free_port()
    pub = EventPublisher(
        PublisherConfig(
            endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{rport}",
            release=release,
            drop_rate=0.3,
            seed=7,
        )
    )
    await pub.start()
    ix = Indexer(BS)
    inst = InstanceConfig("v0", events=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}")
    sub = EventSubscriber(ix, fleet([inst]))
    await sub.start()
    try:
        await until(lambda: sub.status[SourceKey("v0", 0)].connected)
        seqs = []
        for k in range(40):
            ev, toks = seq_event(k)
            pub.publish([ev])
            seqs.append(toks)
            await asyncio.sleep(0.005)
        await until(lambda: all(held(ix, "v0", t) == 2 for t in seqs))
        sync = ix.sync(SourceKey("v0", 0))
        assert pub.stats.dropped > 0 and sync.gaps > 0
        assert sync.unfilled == 0 and ix.trust(SourceKey("v0", 0)) is Trust.EXACT
        assert sync.last == 39
    finally:
        await sub.stop()
        await pub.stop()


async def test_late_join_recovers_the_engines_buffer() -> None:
    port, rport = free_port(), free_port()
    pub = EventPublisher(
        PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    )
    await pub.start()
    seqs = []
    for k in range(12):  # published before any indexer exists
        ev, toks = seq_event(k)
        pub.publish([ev])
        seqs.append(toks)
    ix = Indexer(BS)
    inst = InstanceConfig("v0", events=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}")
    sub = EventSubscriber(ix, fleet([inst]))
    await sub.start()
    try:
        await until(lambda: all(held(ix, "v0", t) == 2 for t in seqs))
        assert ix.trust(SourceKey("v0", 0)) is Trust.EXACT
        ev, toks = seq_event(99)
        pub.publish([ev])
        await until(lambda: held(ix, "v0", toks) == 2)
    finally:
        await sub.stop()
        await pub.stop()


async def test_engine_restart_drops_the_sources_state() -> None:
    """The restarted engine's sequence may already be past ours when we reconnect: the replay from our
    last sequence shows a newer timestamp, so the restart is still recognised and its history replayed."""
    port, rport = free_port(), free_port()
    pub = EventPublisher(
        PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    )
    await pub.start()
    ix = Indexer(BS)
    inst = InstanceConfig("v0", events=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}")
    sub = EventSubscriber(ix, fleet([inst]))
    await sub.start()
    try:
        await until(lambda: sub.status[SourceKey("v0", 0)].connected)
        old = []
        for k in range(3):
            ev, toks = seq_event(k)
            pub.publish([ev])
            old.append(toks)
        await until(lambda: all(held(ix, "v0", t) == 2 for t in old))
        await pub.crash()
        await asyncio.sleep(0.3)  # ZeroMQ releases a closed socket's port asynchronously; vLLM takes longer
        await pub.restart()  # sequence back to 0, cache empty
        new = []
        for k in range(50, 56):  # published before the subscriber is back: seq 0..5 > our last (2)
            ev, toks = seq_event(k)
            pub.publish([ev])
            new.append(toks)
        await until(lambda: all(held(ix, "v0", t) == 2 for t in new))
        assert all(held(ix, "v0", t) == 0 for t in old)
        assert ix.sync(SourceKey("v0", 0)).restarts == 1
        assert ix.trust(SourceKey("v0", 0)) is Trust.EXACT
    finally:
        await sub.stop()
        await pub.stop()


async def test_two_data_parallel_ranks_use_port_offsets() -> None:
    port = free_port()
    while True:  # rank 1 publishes on port + 1
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_port()
    pubs = [
        EventPublisher(PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", dp_rank=r, seed=r))
        for r in range(2)
    ]
    for p in pubs:
        await p.start()
    ix = Indexer(BS)
    sub = EventSubscriber(ix, fleet([InstanceConfig("v", events=f"tcp://127.0.0.1:{port}", dp_size=2)]))
    await sub.start()
    try:
        await until(lambda: all(sub.status[SourceKey("v", r)].connected for r in range(2)))
        e0, t0 = seq_event(1)
        e1, t1 = seq_event(2)
        for _ in range(200):  # slow joiner: connected before our subscription reached the PUB (no replay)
            pubs[0].publish([e0])
            pubs[1].publish([e1])
            await asyncio.sleep(0.02)
            if held(ix, "v", t0, 0) == 2 and held(ix, "v", t1, 1) == 2:
                break
        await until(lambda: held(ix, "v", t0, 0) == 2 and held(ix, "v", t1, 1) == 2)
        assert held(ix, "v", t0, 1) == 0 and held(ix, "v", t1, 0) == 0
    finally:
        await sub.stop()
        for p in pubs:
            await p.stop()


async def test_bind_mode_names_instances_by_topic_and_a_dead_source_delays_no_one() -> None:
    port = free_port()
    dead = free_port()  # nobody will ever publish here
    ix = Indexer(BS)
    cfg = fleet([InstanceConfig("ghost", events=f"tcp://127.0.0.1:{dead}")], bind=f"tcp://127.0.0.1:{port}")
    sub = EventSubscriber(ix, cfg)
    await sub.start()
    pub = EventPublisher(
        PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", connect=True, topic=topic_for("pod-a", "m"))
    )
    await pub.start()
    try:
        ev, toks = seq_event(3)
        for _ in range(50):  # slow joiner: keep publishing until the bound SUB has the peer
            pub.publish([ev])
            await asyncio.sleep(0.02)
            if held(ix, "pod-a", toks) == 2:
                break
        await until(lambda: held(ix, "pod-a", toks) == 2)
        pub.publish([AllBlocksCleared()])
        await until(lambda: held(ix, "pod-a", toks) == 0)
        ghost = sub.status[SourceKey("ghost", 0)]
        assert not ghost.connected and not ghost.ever_connected
        assert ix.trust(SourceKey("ghost", 0)) is Trust.COLD
    finally:
        await pub.stop()
        await sub.stop()


@pytest.mark.parametrize("mode", ["listed", "capped"])
async def test_bind_mode_allow_list_and_cap_refuse_stray_publishers(mode: str) -> None:
    """``bind_accept: listed`` takes only the fleet's names; ``any`` stops at ``max_bind_sources`` unlisted
    names, and a silent unlisted source frees its place after ``stale_after_s``."""
    port = free_port()
    ix = Indexer(BS)
    opts = IndexerOptions(
        replay_timeout_s=1.0,
        bind_accept="listed" if mode == "listed" else "any",
        max_bind_sources=1,
        stale_after_s=0.6,
    )
    cfg = FleetConfig(
        block_size=BS, instances=[InstanceConfig("pod-ok")], bind=f"tcp://127.0.0.1:{port}", indexer=opts
    )
    sub = EventSubscriber(ix, cfg)
    await sub.start()
    names = ["pod-ok", "stray-1", "stray-2"]
    pubs = {
        n: EventPublisher(
            PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", connect=True, topic=topic_for(n, "m"))
        )
        for n in names
    }
    for p in pubs.values():
        await p.start()
    try:
        ev, toks = seq_event(3)

        async def publish_until(cond: Callable[[], bool]) -> None:
            for _ in range(100):  # slow joiners: keep publishing until the bound SUB has every peer
                for p in pubs.values():
                    p.publish([ev])
                await asyncio.sleep(0.02)
                if cond():
                    return

        if mode == "listed":
            await publish_until(lambda: sub.counters["bind_unlisted"] >= 10 and held(ix, "pod-ok", toks) == 2)
            assert held(ix, "pod-ok", toks) == 2
            assert held(ix, "stray-1", toks) == held(ix, "stray-2", toks) == 0
            assert {s.instance for s in sub.status} == {"pod-ok"}
        else:
            await publish_until(lambda: sub.counters["bind_too_many_sources"] >= 10)
            strays = {s.instance for s in sub.status} - {"pod-ok"}
            assert len(strays) == 1  # the listed name never counts against the cap
            (admitted,) = strays
            refused = ({"stray-1", "stray-2"} - strays).pop()
            assert held(ix, admitted, toks) == 2 and held(ix, refused, toks) == 0
            await pubs[admitted].stop()
            del pubs[admitted]
            # the admitted stray goes silent: once stale it is forgotten and the other one gets in
            deadline = time.monotonic() + 5
            while held(ix, refused, toks) != 2 and time.monotonic() < deadline:
                pubs[refused].publish([ev])
                pubs["pod-ok"].publish([ev])
                await asyncio.sleep(0.05)
            assert held(ix, refused, toks) == 2
            assert admitted not in {s.instance for s in sub.status} and sub.counters["stale_drops"] >= 1
    finally:
        for p in pubs.values():
            await p.stop()
        await sub.stop()


async def test_gap_older_than_the_replay_buffer_degrades_on_the_replays_answer() -> None:
    port, rport = free_port(), free_port()
    pub = EventPublisher(
        PublisherConfig(
            endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}", buffer_steps=2
        )
    )
    await pub.start()
    ix = Indexer(BS)
    inst = InstanceConfig("v0", events=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}")
    sub = EventSubscriber(ix, fleet([inst]))
    await sub.start()
    try:
        await until(lambda: sub.status[SourceKey("v0", 0)].connected)
        ev, toks = seq_event(0)
        pub.publish([ev])
        await until(lambda: held(ix, "v0", toks) == 2)
        pub.set_drop_rate(1.0)
        for k in range(1, 6):
            pub.publish([seq_event(k)[0]])
        pub.set_drop_rate(0.0)
        pub.publish([seq_event(6)[0]])
        await until(lambda: ix.trust(SourceKey("v0", 0)) is Trust.DEGRADED)
        # degraded on the replay's own answer (it ended, short of the gap), not after a replay timeout
        assert sub.counters["replay_timeouts"] == 0 and sub.counters["replayed_batches"] >= 1
        pub.publish([AllBlocksCleared()])  # the engine clears: exact again
        await until(lambda: ix.trust(SourceKey("v0", 0)) is Trust.EXACT)
    finally:
        await sub.stop()
        await pub.stop()


async def test_a_source_in_bind_mode_hears_an_engine_that_connects_out() -> None:
    """vLLM connects its PUB out when its endpoint names a host: the subscriber binds a SUB there for that
    one source (``events_mode: bind``), hears the live stream and replays what it missed before."""
    port, rport = free_port(), free_port()
    pub = EventPublisher(
        PublisherConfig(
            endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}", connect=True
        )
    )
    await pub.start()
    early = []
    for k in range(5):  # nobody listens yet: lost live, kept for replay
        ev, toks = seq_event(k)
        pub.publish([ev])
        early.append(toks)
    ix = Indexer(BS)
    inst = InstanceConfig(
        "v0", events=f"tcp://127.0.0.1:{port}", events_mode="bind", replay=f"tcp://127.0.0.1:{rport}"
    )
    sub = EventSubscriber(ix, fleet([inst]))
    await sub.start()
    src = SourceKey("v0", 0)
    try:
        await until(lambda: sub.status[src].connected, what="the engine's PUB connected to our SUB")
        assert sub.status[src].mode == "bind"
        await until(lambda: all(held(ix, "v0", t) == 2 for t in early), what="replayed")
        for k in range(50, 250):  # slow joiner: the PUB's connection is up before our subscription reaches
            ev, toks = seq_event(k)  # it (a batch published meanwhile is dropped, then replayed)
            pub.publish([ev])
            await asyncio.sleep(0.02)
            if sub.status[src].messages >= 1:
                break
        await until(lambda: held(ix, "v0", toks) == 2, what="live batch")
        assert sub.status[src].messages >= 1 and ix.trust(src) is Trust.EXACT
    finally:
        await sub.stop()
        await pub.stop()


async def test_a_bind_that_fails_is_retried_and_shown() -> None:
    """The address is held by another socket: the source says why, and binds once it is free."""
    import socket

    port = free_port()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    ix = Indexer(BS)
    inst = InstanceConfig("v0", events=f"tcp://127.0.0.1:{port}", events_mode="bind")
    sub = EventSubscriber(ix, fleet([inst]))
    await sub.start()
    src = SourceKey("v0", 0)
    try:
        await until(lambda: sub.status[src].error is not None, what="the bind error shown")
        assert "bind" in (sub.status[src].error or "") and sub.counters["bind_errors"] >= 1
        holder.close()
        await until(lambda: sub.status[src].error is None, timeout=20, what="bound once free")
    finally:
        holder.close()
        await sub.stop()
