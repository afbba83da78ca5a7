"""The simulated publisher over real ZeroMQ sockets on 127.0.0.1: framing, order, replay, every fault knob."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from indexer import DecodeError
from indexer.wire import BatchDecoder
from kvrouter.lab.sim.engine.events import BlockRemoved, KVEvent
from kvrouter.lab.sim.engine.types import BlockHash
from kvrouter.lab.sim.errors import PublisherError, SimConfigError
from kvrouter.lab.sim.server.publisher import END_SEQ, EventPublisher, PublisherConfig, topic_for
from tests.support.net import free_port

TIMEOUT = 3.0


def ev(k: int) -> list[KVEvent]:
    return [BlockRemoved([BlockHash(k)])]


def free_port_pair() -> int:
    """A port p with p + 1 free as well (data-parallel rank 1 binds port + 1)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair")


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def cfg(**kw: object) -> PublisherConfig:
    base: dict[str, object] = {
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    base.update(kw)
    return PublisherConfig(**base)  # type: ignore[arg-type]


async def sub_to(ctx: zmq.asyncio.Context, endpoint: str, topic: bytes = b"") -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


async def recv(sock: zmq.asyncio.Socket, timeout: float = TIMEOUT) -> list[bytes] | None:
    try:
        return await asyncio.wait_for(sock.recv_multipart(), timeout)
    except TimeoutError:
        return None


async def warm(pub: EventPublisher, sub: zmq.asyncio.Socket) -> int:
    """Publish until the subscription is live (ZeroMQ's slow joiner); returns the last sequence received."""
    for _ in range(200):
        seq = pub.publish(ev(999))
        assert seq is not None
        got = await recv(sub, 0.02)
        if got is not None:
            while (more := await recv(sub, 0.05)) is not None:  # drain the rest of the warm-up
                got = more
            return int.from_bytes(got[1], "big")
    raise AssertionError("subscriber never received anything")


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        while True:
            frames = await recv(dealer)
            assert frames is not None, "replay did not end"
            out.append(frames)
            if END_SEQ in frames:
                return out
    finally:
        dealer.close(linger=0)


async def test_subscriber_receives_batches_in_order(ctx: zmq.asyncio.Context) -> None:
    pub = EventPublisher(cfg(), ctx=ctx)
    async with pub:
        sub = await sub_to(ctx, pub.config.pub_endpoint)
        last = await warm(pub, sub)
        assert pub.publish([]) is None and pub.next_seq == last + 1  # idle steps send nothing
        for k in range(20):
            assert pub.publish(ev(k), ts=100.0 + k) == last + 1 + k
        for k in range(20):
            frames = await recv(sub)
            assert frames is not None and len(frames) == 3
            topic, seq8, payload = frames
            assert topic == b"" and int.from_bytes(seq8, "big") == last + 1 + k
            batch = BatchDecoder().decode(payload)
            assert batch.ts == 100.0 + k and batch.dp_rank == 0
            assert [list(e.block_hashes) for e in batch.events] == [[k]]  # type: ignore[union-attr]
        sub.close(linger=0)
    assert not pub.running


@pytest.mark.parametrize(("release", "new_framing"), [("0.25.0", False), ("0.33.0", True)])
async def test_replay_framing(ctx: zmq.asyncio.Context, release: str, new_framing: bool) -> None:
    topic = topic_for("sim-0", "m")
    pub = EventPublisher(cfg(release=release, topic=topic), ctx=ctx)
    async with pub:
        for k in range(5):
            pub.publish(ev(k))
        assert pub.config.router_endpoint is not None
        frames = await replay(ctx, pub.config.router_endpoint, 2)
    *batches, end = frames
    if new_framing:
        assert end == [b"", b"", END_SEQ, b""]
        assert [f[1] for f in batches] == [topic.encode()] * 3
        seqs = [int.from_bytes(f[2], "big") for f in batches]
        payloads = [f[3] for f in batches]
    else:
        assert end == [b"", END_SEQ, b""]
        assert all(len(f) == 3 for f in batches)
        seqs = [int.from_bytes(f[1], "big") for f in batches]
        payloads = [f[2] for f in batches]
    assert all(f[0] == b"" for f in batches)
    assert seqs == [2, 3, 4]
    got = [BatchDecoder().decode(p).events[0].block_hashes for p in payloads]  # type: ignore[union-attr]
    assert got == [[2], [3], [4]]
    assert pub.stats.replay_requests == 1 and pub.stats.replayed_batches == 3


async def test_replay_keeps_only_the_last_buffer_steps(ctx: zmq.asyncio.Context) -> None:
    pub = EventPublisher(cfg(buffer_steps=3), ctx=ctx)
    async with pub:
        for k in range(5):
            pub.publish(ev(k))
        assert pub.buffered_seqs() == [2, 3, 4]
        assert pub.config.router_endpoint is not None
        frames = await replay(ctx, pub.config.router_endpoint, 0)
    assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == [2, 3, 4]


async def test_dropped_batches_keep_their_seq_and_replay_recovers_them(ctx: zmq.asyncio.Context) -> None:
    pub = EventPublisher(cfg(seed=3), ctx=ctx)
    async with pub:
        sub = await sub_to(ctx, pub.config.pub_endpoint)
        first = await warm(pub, sub) + 1
        pub.set_drop_rate(0.5)
        for k in range(40):
            pub.publish(ev(k))
        pub.set_drop_rate(0.0)
        tail = pub.publish(ev(1000))
        assert tail == first + 40
        live: dict[int, bytes] = {}
        while True:
            frames = await recv(sub)
            assert frames is not None
            live[int.from_bytes(frames[1], "big")] = frames[2]
            if int.from_bytes(frames[1], "big") == tail:
                break
        missing = sorted(set(range(first, tail)) - set(live))
        assert missing and len(missing) == pub.stats.dropped
        assert pub.config.router_endpoint is not None
        frames_list = await replay(ctx, pub.config.router_endpoint, first)
        replayed = {int.from_bytes(f[2], "big"): f[3] for f in frames_list[:-1]}
        assert set(replayed) == set(range(first, tail + 1))
        assert all(replayed[s] == p for s, p in live.items())  # the same bytes as live
        recovered = [BatchDecoder().decode(replayed[s]).events[0].block_hashes for s in missing]  # type: ignore[union-attr]
        assert recovered == [[s - first] for s in missing]
        sub.close(linger=0)


async def test_crash_refuses_and_restart_resets_the_sequence(ctx: zmq.asyncio.Context) -> None:
    pub = EventPublisher(cfg(), ctx=ctx)
    async with pub:
        sub = await sub_to(ctx, pub.config.pub_endpoint)
        await warm(pub, sub)
        assert pub.next_seq > 0
        await pub.crash()
        assert not pub.running and pub.publish(ev(1)) is None and pub.stats.refused == 1
        await pub.restart()
        assert pub.running and pub.next_seq == 0 and pub.buffered_seqs() == []
        assert pub.config.router_endpoint is not None
        assert await replay(ctx, pub.config.router_endpoint, 0) == [[b"", b"", END_SEQ, b""]]
        assert pub.publish(ev(5)) == 0
        # the subscriber reconnects by itself and sees the sequence start again
        last = await warm(pub, sub)
        assert last < 200
        await pub.restart()  # restart while up = crash + start
        assert pub.next_seq == 0
        sub.close(linger=0)


async def test_stall_holds_batches_then_flushes_them_in_order(ctx: zmq.asyncio.Context) -> None:
    pub = EventPublisher(cfg(), ctx=ctx)
    async with pub:
        sub = await sub_to(ctx, pub.config.pub_endpoint)
        last = await warm(pub, sub)
        pub.stall()
        seqs = [pub.publish(ev(k)) for k in range(3)]
        assert seqs == [last + 1, last + 2, last + 3] and pub.stalled
        assert await recv(sub, 0.2) is None
        assert last + 1 not in pub.buffered_seqs()  # not yet sent, not yet replayable
        pub.resume()
        got = [await recv(sub) for _ in range(3)]
        assert [int.from_bytes(f[1], "big") for f in got if f] == seqs
        sub.close(linger=0)


async def test_muted_replay_never_answers(ctx: zmq.asyncio.Context) -> None:
    pub = EventPublisher(cfg(), ctx=ctx)
    async with pub:
        pub.publish(ev(1))
        pub.replay_muted = True
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        assert pub.config.router_endpoint is not None
        dealer.connect(pub.config.router_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert await recv(dealer, 0.3) is None
        dealer.close(linger=0)
        assert pub.stats.replay_requests == 1 and pub.stats.replayed_batches == 0


async def test_corrupted_batches_do_not_decode_but_take_a_seq(ctx: zmq.asyncio.Context) -> None:
    pub = EventPublisher(cfg(), ctx=ctx)
    async with pub:
        sub = await sub_to(ctx, pub.config.pub_endpoint)
        last = await warm(pub, sub)
        pub.corrupt_next(1)
        pub.publish(ev(1))
        pub.publish(ev(2))
        bad, good = await recv(sub), await recv(sub)
        assert bad is not None and good is not None
        assert int.from_bytes(bad[1], "big") == last + 1 and int.from_bytes(good[1], "big") == last + 2
        with pytest.raises(DecodeError):
            BatchDecoder().decode(bad[2])
        assert BatchDecoder().decode(good[2]).events
        assert pub.stats.corrupted == 1
        sub.close(linger=0)


async def test_connect_mode_names_the_instance_in_the_topic(ctx: zmq.asyncio.Context) -> None:
    port = free_port()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind(f"tcp://127.0.0.1:{port}")
    pub = EventPublisher(
        PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", connect=True, topic=topic_for("sim-3", "llama")),
        ctx=ctx,
    )
    async with pub:
        last = await warm(pub, sub)
        pub.publish(ev(7))
        frames = await recv(sub)
        assert frames is not None and frames[0] == b"kv@sim-3@llama"
        assert int.from_bytes(frames[1], "big") == last + 1
    sub.close(linger=0)


async def test_data_parallel_rank_offsets_ports_and_fills_the_rank(ctx: zmq.asyncio.Context) -> None:
    p, r = free_port_pair(), free_port_pair()
    pub = EventPublisher(
        PublisherConfig(endpoint=f"tcp://127.0.0.1:{p}", replay_endpoint=f"tcp://127.0.0.1:{r}", dp_rank=1),
        ctx=ctx,
    )
    assert pub.config.pub_endpoint == f"tcp://127.0.0.1:{p + 1}"
    async with pub:
        sub = await sub_to(ctx, f"tcp://127.0.0.1:{p + 1}")
        await warm(pub, sub)
        pub.publish(ev(1))
        frames = await recv(sub)
        assert frames is not None and BatchDecoder().decode(frames[2]).dp_rank == 1
        frames_list = await replay(ctx, f"tcp://127.0.0.1:{r + 1}", 0)
        assert len(frames_list) > 1
        sub.close(linger=0)


async def test_lifecycle_is_clean_and_errors_are_typed(ctx: zmq.asyncio.Context) -> None:
    own = EventPublisher(cfg())
    await own.start()
    await own.start()  # idempotent
    await own.stop()
    await own.stop()
    assert own._ctx.closed and not own.running
    a = EventPublisher(cfg(), ctx=ctx)
    await a.start()
    b = EventPublisher(PublisherConfig(endpoint=a.config.endpoint), ctx=ctx)
    b.bind_retry_s = 0.1
    with pytest.raises(PublisherError):
        await b.start()  # the port is taken
    assert not b.running
    await a.stop()
    assert not ctx.closed  # a shared context is the caller's
    with pytest.raises(SimConfigError):
        PublisherConfig(release="0.1.0").validate()
    with pytest.raises(SimConfigError):
        PublisherConfig(drop_rate=2).validate()
    with pytest.raises(SimConfigError):
        a.set_drop_rate(-1)
