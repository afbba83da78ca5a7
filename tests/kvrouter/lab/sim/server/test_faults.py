"""Every fault knob of a simulated instance, over real HTTP and ZeroMQ: 503, crash mid-stream, restart from
sequence 0 with an empty cache, dropped batches, engine stall, event stall, latency, slowdown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from indexer.wire import BatchDecoder
from kvrouter.lab.sim.engine.scheduler import BatchStats
from kvrouter.lab.sim.server.faults import FaultConfig
from kvrouter.lab.sim.server.publisher import END_SEQ
from kvrouter.lab.sim.server.rank import _CATCH_UP_S
from kvrouter.lab.sim.server.server import SimServer
from tests.support.sim_server import instance_config, long_text, running, sse_events
from tests.support.wait import until

MODEL = "sim-model"


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    async with running(instance_config()) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def sub(server: SimServer) -> AsyncIterator[zmq.asyncio.Socket]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    endpoint = server.instance.config.events_endpoint
    assert endpoint is not None
    sock.connect(endpoint)
    yield sock
    sock.close(linger=0)
    ctx.term()


async def faults(http: aiohttp.ClientSession, server: SimServer, **update: Any) -> dict[str, Any]:
    async with http.post(f"{server.url}/sim/faults", json=update) as r:
        assert r.status == 200, await r.text()
        body: dict[str, Any] = await r.json()
        return body


async def complete(
    http: aiohttp.ClientSession, server: SimServer, prompt: str, max_tokens: int = 2
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    async with http.post(f"{server.url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


async def seqs(sock: zmq.asyncio.Socket, timeout: float = 0.3, *, at_least: int = 0) -> list[int]:
    """Sequence numbers of every batch that arrives until ``timeout`` passes in silence, after waiting up to
    a generous 10 s for the first ``at_least`` batches (those are expected: a busy machine may be slow)."""
    return [q for _, q in await timed_seqs(sock, timeout, at_least=at_least)]


async def timed_seqs(
    sock: zmq.asyncio.Socket, timeout: float = 0.3, *, at_least: int = 0
) -> list[tuple[float, int]]:
    """(arrival time, sequence number) of each batch, as ``seqs``."""
    out: list[tuple[float, int]] = []
    while True:
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), 10.0 if len(out) < at_least else timeout)
        except TimeoutError:
            assert len(out) >= at_least, f"{len(out)} batches arrived, {at_least} expected"
            return out
        BatchDecoder().decode(frames[2])
        out.append((time.monotonic(), int.from_bytes(frames[1], "big")))


async def warm(http: aiohttp.ClientSession, server: SimServer, sock: zmq.asyncio.Socket) -> list[int]:
    """Send requests until the subscription is live (ZeroMQ's slow joiner); returns the seqs seen."""
    for i in range(100):
        await complete(http, server, long_text(40, seed=i), 1)
        got = await seqs(sock, 0.05)
        if got:
            return got
    raise AssertionError("no event batch arrived")


async def test_dead_answers_503_then_recovers(server: SimServer, http: aiohttp.ClientSession) -> None:
    status = await faults(http, server, dead=True)
    assert status["dead"] is True
    async with http.get(f"{server.url}/health") as r:
        assert r.status == 503
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        async with http.post(f"{server.url}{path}", json=body) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == 503
    await faults(http, server, dead=False)
    async with http.get(f"{server.url}/health") as r:
        assert r.status == 200
    await complete(http, server, "x")


DOWN_S = 1.5
"""Long enough that the port is still closed when the test looks, however busy the machine."""


async def test_crash_mid_stream_cuts_the_stream_and_restarts_empty(
    server: SimServer, http: aiohttp.ClientSession, sub: zmq.asyncio.Socket
) -> None:
    await warm(http, server, sub)
    pub = server.instance.ranks[0].publisher
    assert pub is not None
    prompt = long_text(120, seed=42)
    for i in range(20):  # batches enough that the restarted sequence is clearly below this one
        await complete(http, server, long_text(40, seed=500 + i), 1)
    await complete(http, server, prompt)
    hit = await complete(http, server, prompt)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    await faults(http, server, slowdown=20.0)
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 1000, "stream": True}
    data: list[str] = []
    seq_before = 0
    with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
        async with http.post(f"{server.url}/v1/completions", json=body) as resp:
            async for _, d in sse_events(resp):
                data.append(d)
                if len(data) == 3:
                    seq_before = pub.next_seq
                    # Crash through the admin route, on another connection; down for DOWN_S.
                    async with aiohttp.ClientSession() as admin:
                        status = await faults(admin, server, crash=True, down_s=DOWN_S)
                    assert status["crashes"] == 0  # answered before dying
    assert 3 <= len(data) < 1000 and "[DONE]" not in data
    # While down the port refuses connections, as a dead process's would.
    with pytest.raises(aiohttp.ClientConnectorError):
        async with http.get(f"{server.url}/health") as r:
            pass
    await until(lambda: server.instance.faults.crashes == 1 and not server.instance.faults.crashed)
    assert server.last_down_s >= DOWN_S  # the port closed that long, on the server's own clock
    async with http.get(f"{server.url}/health") as r:
        assert r.status == 200
    # Back with an empty cache, and event sequences from 0 again.
    await faults(http, server, slowdown=1.0)
    miss = await complete(http, server, prompt)
    assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A subscriber sees the sequence go back: a restart.
    after = await warm(http, server, sub)
    assert seq_before >= 20 and after[0] < seq_before
    # (Batch 0 may go out before the SUB has reconnected; the replay ROUTER has it.)
    assert (await replayed_seqs(server, 0))[:1] == [0]
    assert not server.instance.ranks[0].engine.has_work()


async def replayed_seqs(server: SimServer, start: int) -> list[int]:
    endpoint = server.instance.config.replay_endpoint
    assert endpoint is not None
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 2.0)
            if frames[2] == END_SEQ:
                return out
            out.append(int.from_bytes(frames[2], "big"))  # 0.33 framing: [b"", topic, seq8, payload]
    finally:
        dealer.close(linger=0)
        ctx.term()


async def test_crash_fails_a_non_streaming_request(server: SimServer, http: aiohttp.ClientSession) -> None:
    server.instance.faults.slowdown = 50.0
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 500}
    task = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=body))
    await until(lambda: server.instance.ranks[0].engine.has_work())
    lost = await server.crash(down_s=0.0)
    assert lost == 1
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await task
    assert (await complete(http, server, "fine again"))["usage"]["completion_tokens"] == 2


async def test_drop_knob_drops_batches_as_gaps(
    server: SimServer, http: aiohttp.ClientSession, sub: zmq.asyncio.Socket
) -> None:
    first = await warm(http, server, sub)
    await faults(http, server, drop_rate=1.0)
    for i in range(5):
        await complete(http, server, long_text(40, seed=100 + i), 1)
    pub = server.instance.ranks[0].publisher
    assert pub is not None and pub.stats.dropped >= 5
    await faults(http, server, drop_rate=0.0)
    await complete(http, server, long_text(40, seed=200), 1)
    got = await seqs(sub, at_least=1)
    # The first batch to arrive is the one after the drops: none of them was sent, early or late (the
    # dropped batches left a gap, still replayable).
    assert got[0] >= first[-1] + 1 + 5
    assert set(range(first[-1] + 1, got[0])) <= set(pub.buffered_seqs())


async def test_stall_delays_requests_and_events(
    server: SimServer, http: aiohttp.ClientSession, sub: zmq.asyncio.Socket
) -> None:
    await warm(http, server, sub)
    rank = server.instance.ranks[0]
    await faults(http, server, stall_s=0.6)
    stall_end = server.instance.faults.stall_until  # the stall's own clock (time.monotonic)
    sent, waits = time.monotonic(), rank.stall_waits
    task = asyncio.create_task(complete(http, server, long_text(60, seed=7), 3))
    await until(lambda: rank.stall_waits > waits)  # the request reached the engine and the stall held it
    got = await timed_seqs(sub, 0.3, at_least=1)  # the request's batches, once the engine steps again
    out = await asyncio.wait_for(task, 10.0)
    assert got and out["usage"]["completion_tokens"] == 3
    # no step, so no event and no token, before the stall ends (the server's own record)
    steps = [t for t in rank.step_starts if t >= sent]
    assert steps and min(steps) >= stall_end
    # stall_s: 0 resumes at once.
    idle_from = time.monotonic()  # the request above is answered: nothing left to step
    await faults(http, server, stall_s=30.0)
    waits = rank.stall_waits
    task = asyncio.create_task(complete(http, server, "x", 1))
    await until(lambda: rank.stall_waits > waits)
    assert not task.done()
    released = time.monotonic()
    await faults(http, server, stall_s=0)
    await asyncio.wait_for(task, 10.0)  # not 30 s
    assert [t for t in rank.step_starts if idle_from <= t < released] == []  # held until released
    assert any(t >= released for t in rank.step_starts)


async def test_stall_at_start() -> None:
    """A stall configured at start holds the engine from the instance's creation: a request answered
    before the stall's end would mean the engine stepped during it.  The end is the server's own (its
    clock started before the server did), not a time the test took later."""
    async with (
        running(instance_config(faults=FaultConfig(stall_s=1.5))) as server,
        aiohttp.ClientSession() as http,
    ):
        stall_end = server.instance.faults.stall_until
        rank = server.instance.ranks[0]
        assert stall_end > time.monotonic(), "the server took the whole stall to start"
        task = asyncio.create_task(complete(http, server, "x", 1))
        await until(lambda: rank.stall_waits > 0)  # the request arrived during the stall, and waited
        await asyncio.wait_for(task, 10.0)
        assert rank.step_starts and rank.step_starts[0] >= stall_end  # the first step, on the server's clock


async def test_event_stall_holds_batches_then_flushes_in_order(
    server: SimServer, http: aiohttp.ClientSession, sub: zmq.asyncio.Socket
) -> None:
    first = await warm(http, server, sub)
    pub = server.instance.ranks[0].publisher
    assert pub is not None
    await faults(http, server, stall_events=True)
    sent = pub.stats.sent
    for i in range(4):
        await complete(http, server, long_text(40, seed=300 + i), 1)
    # Each answer follows its step's batch: all of them are held, none went out.
    assert pub.num_held >= 4 and pub.stats.sent == sent
    held = pub.num_held
    await faults(http, server, stall_events=False)
    got = await seqs(sub, at_least=held)
    assert got[:held] == list(range(first[-1] + 1, first[-1] + 1 + held))  # in order, none lost


async def test_latency_and_slowdown(server: SimServer, http: aiohttp.ClientSession) -> None:
    """Both are lower bounds on the answer's time, which a busy machine only lengthens: ``latency_s`` before
    the engine, and ``slowdown`` x the modelled duration of each of the request's steps (one per token;
    each at least the profile's one-token decode step), less the rank's catch-up allowance."""
    await faults(http, server, latency_s=0.3)
    t0 = time.monotonic()
    await complete(http, server, "late", 10)
    assert time.monotonic() - t0 >= 0.3
    await faults(http, server, latency_s=0.0, slowdown=100.0)
    t0 = time.monotonic()
    await complete(http, server, "slow", 10)
    slow = time.monotonic() - t0
    profile = server.instance.ranks[0].engine.timing
    step = profile.step_time(
        BatchStats(num_scheduled=1, decode_tokens=1, context_tokens=1, attention_pairs=1)
    )
    # the rank paces steps on its own clock and may start the first one up to _CATCH_UP_S in the past
    assert step > 0 and slow >= 100.0 * 10 * step - _CATCH_UP_S


async def test_corrupt_and_mute_replay_reach_the_publisher(
    server: SimServer, http: aiohttp.ClientSession
) -> None:
    await faults(http, server, corrupt_next=2, mute_replay=True)
    pub = server.instance.ranks[0].publisher
    assert pub is not None and pub.replay_muted
    await complete(http, server, long_text(40, seed=1), 1)
    await until(lambda: pub.stats.corrupted >= 1)


async def test_bad_fault_updates_are_400(server: SimServer, http: aiohttp.ClientSession) -> None:
    for update in ({"drop_rate": 2.0}, {"bogus": 1}, {"slowdown": 0}, {"stall_s": "long"}):
        async with http.post(f"{server.url}/sim/faults", json=update) as r:
            assert r.status == 400, update
    async with http.get(f"{server.url}/sim/faults") as r:
        status = await r.json()
    assert status["drop_rate"] == 0.0 and status["slowdown"] == 1.0


async def test_keep_alive_connections_do_not_outlive_a_crash(
    server: SimServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{server.url}/health") as r:  # leaves an idle keep-alive connection in the pool
        assert r.status == 200
    assert server._runner is not None and server._runner.server is not None
    assert len(server._runner.server.connections) == 1
    await server.crash(down_s=0.0)
    assert server._runner.server.connections == []  # closed, as a dead process's sockets are
    await asyncio.sleep(0.1)
    async with http.get(f"{server.url}/health", timeout=aiohttp.ClientTimeout(total=3)) as r:
        assert r.status == 200  # a fresh connection, not a hang on the stale one
