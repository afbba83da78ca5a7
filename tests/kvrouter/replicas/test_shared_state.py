"""Router replicas sharing in-flight load and speculative entries through a real redis-server: agreement,
a crashed replica's load ending with its lease, and routing on through a Redis outage (counted, logged
once, resynchronised when Redis returns)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from indexer import Indexer, SourceKey
from kvrouter.loop_lag import LoopLag
from kvrouter.replicas import SharedState, SharedStateConfig
from kvrouter.replicas.config import REDIS_URL_ENV
from kvrouter.replicas.state import SpecWire, decode_batch
from kvrouter.routing import RouteInput, Router, RouterConfig
from kvrouter.routing.response_affinity import Holder, ResponseAffinity
from kvrouter.routing.router import Decision, Target
from kvrouter.types import InstanceId, RequestId
from tests.support.redis_server import RedisServer, redis_server
from tests.support.wait import until

__all__ = ["redis_server"]

BS = 4
NAMES = ("w0", "w1", "w2")
TARGETS = [Target(InstanceId(n)) for n in NAMES]
Pair = tuple[Router, SharedState, Router, SharedState]


def router() -> Router:
    ix = Indexer(BS)
    for n in NAMES:
        ix.register(SourceKey(n, 0))
    return Router(ix, RouterConfig(policy="kv-aware", shadow=False))


def prompt(seed: int, blocks: int = 8) -> RouteInput:
    ix = Indexer(BS)
    toks = list(range(seed * 1000, seed * 1000 + blocks * BS + 1))
    return RouteInput(RequestId(f"q{seed}-{time.monotonic_ns()}"), len(toks), ix.chain_hashes(toks))


def send(r: Router, inp: RouteInput) -> Decision:
    d = r.route(inp, TARGETS, time.monotonic())
    assert d.chosen is not None
    r.dispatched(inp, d.chosen, time.monotonic())
    return d


def config(url: str, replica: str, **kw: object) -> SharedStateConfig:
    base = SharedStateConfig(redis_url=url, namespace="t", replica_id=replica, interval_s=0.05, lease_s=0.4)
    return msgspec.structs.replace(base, **kw)


@pytest.fixture
def ns_flush(redis_server: RedisServer) -> Iterator[RedisServer]:
    c = redis_server.client()
    c.flushdb()
    c.close()
    yield redis_server


@pytest.fixture
async def pair(ns_flush: RedisServer) -> AsyncIterator[Pair]:
    ra, rb = router(), router()
    a = SharedState(ra, config(ns_flush.url, "a"), registry=CollectorRegistry())
    b = SharedState(rb, config(ns_flush.url, "b"), registry=CollectorRegistry())
    ra.indexer.speculative_outbox = []  # what start() does, without the background loop
    rb.indexer.speculative_outbox = []
    yield ra, a, rb, b
    await a.stop()
    await b.stop()


async def test_a_peers_in_flight_counts_towards_each_target(pair: Pair) -> None:
    ra, a, rb, b = pair
    inp = prompt(1)
    d = send(ra, inp)
    assert await a.sync_once() and await b.sync_once()
    load = rb.load.get(InstanceId(d.chosen.target))  # type: ignore[union-attr]
    assert (load.in_flight, load.external_in_flight, load.effective_in_flight()) == (0, 1, 1)
    assert load.external_prefill_tokens == 33 and b.state.peers == 1
    (cand,) = [c for c in rb.candidates(prompt(2), TARGETS) if c.target == d.chosen.target]  # type: ignore[union-attr]
    assert cand.in_flight == 1
    ra.finished(inp.request_id)
    assert await a.sync_once() and await b.sync_once()
    assert rb.load.get(InstanceId(d.chosen.target)).external_in_flight == 0  # type: ignore[union-attr]


async def test_a_burst_of_one_prefix_sticks_together_across_replicas(pair: Pair) -> None:
    ra, a, rb, b = pair
    first = send(ra, prompt(7))
    lone = router()  # a replica that shares nothing, for contrast
    assert lone.route(prompt(7), TARGETS).chosen.cached_tokens == 0  # type: ignore[union-attr]
    assert await a.sync_once() and await b.sync_once()
    d = rb.route(prompt(7), TARGETS, time.monotonic())
    assert d.chosen is not None and d.chosen.target == first.chosen.target  # type: ignore[union-attr]
    assert d.reason == "cache" and d.chosen.speculative_blocks == 8
    # no echo: b took a's entries in but has nothing of its own to publish
    assert b.state.unsent == [] and rb.indexer.speculative_outbox == []
    assert b.state.applied_entries == 1


async def test_peer_entries_expire_with_what_was_left_of_their_ttl(pair: Pair) -> None:
    """A peer's entry ends where it ends on the replica that sent it (sent + ttl), however old it was when it
    arrived: measured from the send, on both sides of that instant, not from when this test looked."""
    ra, a, rb, b = pair
    inp = prompt(3)
    sent = time.monotonic()
    send(ra, inp)
    await asyncio.sleep(0.3)  # the entry ages before it is published (its TTL left goes with it) ...
    assert await a.sync_once()
    await asyncio.sleep(0.3)  # ... and in the store, before the peer takes it in (age on the store's clock)
    assert await b.sync_once()
    end = sent + rb.indexer.speculative_ttl

    def spec_at(t: float) -> int:
        return rb.indexer.lookup_chains(inp.chains, 1, now=t).best().speculative_blocks  # type: ignore[arg-type, union-attr]

    assert spec_at(end - 0.1) == 8 and spec_at(end + 0.1) == 0


async def test_a_crashed_replicas_load_ends_with_its_lease(pair: Pair) -> None:
    ra, a, rb, b = pair
    d = send(ra, prompt(4))
    assert await a.sync_once() and await b.sync_once()
    target = InstanceId(d.chosen.target)  # type: ignore[union-attr]
    assert rb.load.get(target).external_in_flight == 1
    await asyncio.sleep(0.45)  # a never syncs again: crashed
    assert await b.sync_once()
    assert rb.load.get(target).external_in_flight == 0 and b.state.peers == 0


async def test_the_background_loop_converges_and_a_clean_stop_leaves_at_once(ns_flush: RedisServer) -> None:
    ra, rb = router(), router()
    a = SharedState(ra, config(ns_flush.url, "a", lease_s=30.0), registry=CollectorRegistry())
    b = SharedState(rb, config(ns_flush.url, "b", lease_s=30.0), registry=CollectorRegistry())
    await a.start()
    await b.start()
    try:
        d = send(ra, prompt(5))
        target = InstanceId(d.chosen.target)  # type: ignore[union-attr]
        await until(lambda: rb.load.get(target).external_in_flight == 1)
        assert b.status()["up"] and b.status()["peers"] == 1
        await a.stop()
        assert ra.indexer.speculative_outbox is None
        left = time.monotonic()
        await until(lambda: rb.load.get(target).external_in_flight == 0)
        assert time.monotonic() - left < 30.0  # a left: its load went before its lease could end
    finally:
        await a.stop()
        await b.stop()


async def test_redis_outage_routes_locally_counts_logs_once_and_resynchronises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = RedisServer()
    server.start()
    ra, rb = router(), router()
    reg = CollectorRegistry()
    lease = 2.0  # long enough that three failed round trips on a busy machine stay within it
    a = SharedState(ra, config(server.url, "a", lease_s=lease), registry=CollectorRegistry())
    b = SharedState(rb, config(server.url, "b", lease_s=lease), registry=reg)
    ra.indexer.speculative_outbox, rb.indexer.speculative_outbox = [], []
    caplog.set_level(logging.INFO, logger="kvrouter.replicas")
    try:
        d = send(ra, prompt(6))
        target = InstanceId(d.chosen.target)  # type: ignore[union-attr]
        assert await a.sync_once() and await b.sync_once()
        synced = time.monotonic()
        assert rb.load.get(target).external_in_flight == 1
        server.stop()  # Redis dies
        for _ in range(3):
            assert not await b.sync_once()
            assert rb.route(prompt(8), TARGETS, time.monotonic()).chosen is not None  # routing goes on
        assert rb.load.get(target).external_in_flight == 1  # within the lease: the last view stands
        errors = reg.get_sample_value("kvrouter_shared_state_errors_total", {"reason": "connection"})
        assert errors is not None and errors >= 3
        assert reg.get_sample_value("kvrouter_shared_state_up") == 0
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
        await asyncio.sleep(max(0.0, synced + lease + 0.05 - time.monotonic()))
        assert not await b.sync_once()
        assert rb.load.get(target).external_in_flight == 0  # past a lease: peers' load is unknown
        late = prompt(9)
        send(ra, late)  # a keeps its entry until it can publish it
        assert not await a.sync_once() and len(a.state.unsent) == 1
        server.start()  # Redis returns, empty
        for s in (a, b, a, b):
            await until_ok(s)
        assert sum(rb.load.get(InstanceId(n)).external_in_flight for n in NAMES) == 2
        assert rb.indexer.lookup_chains(late.chains, 1).best().speculative_blocks == 8  # type: ignore[arg-type, union-attr]
        assert reg.get_sample_value("kvrouter_shared_state_up") == 1
        assert (
            len([r for r in caplog.records if r.levelno == logging.WARNING and r.name == "kvrouter.replicas"])
            == 2
        )
        assert sum("reachable again" in r.getMessage() for r in caplog.records) == 2
    finally:
        await a.stop()
        await b.stop()
        server.stop()


async def until_ok(s: SharedState) -> None:
    for _ in range(20):  # the first call may meet a connection the dead server left behind
        if await s.sync_once():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("never reached the restarted Redis")


async def test_a_round_trip_that_timed_out_while_this_loop_stood_still_is_not_an_outage() -> None:
    server = RedisServer()
    server.start()
    assert server.proc is not None
    lag = LoopLag()
    lag.start()
    reg = CollectorRegistry()
    b = SharedState(router(), config(server.url, "b", timeout_s=0.3), registry=reg, lag=lag)
    b.router.indexer.speculative_outbox = []
    try:
        assert await b.sync_once()
        server.proc.send_signal(signal.SIGSTOP)  # Redis holds every answer: round trips time out
        trip = asyncio.create_task(b.sync_once())
        await asyncio.sleep(0.05)  # the round trip is under way
        time.sleep(0.8)  # this process stands still past its timeout
        assert not await trip
        assert reg.get_sample_value("kvrouter_shared_state_errors_total", {"reason": "stalled"}) == 1
        assert reg.get_sample_value("kvrouter_shared_state_up") == 1  # not taken for an outage
        assert not await b.sync_once()  # the same with the loop free: an outage
        assert reg.get_sample_value("kvrouter_shared_state_up") == 0
        server.proc.send_signal(signal.SIGCONT)
        await until_ok(b)
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        await b.stop()
        server.stop()
        lag.stop()


def test_config_is_validated_and_the_env_names_the_url() -> None:
    from indexer.errors import ConfigError

    with pytest.raises(ConfigError):
        SharedStateConfig(interval_s=0.5, lease_s=0.6).validate()
    with pytest.raises(ConfigError):
        SharedStateConfig(redis_url="http://x").validate()
    cfg = SharedStateConfig().with_env({REDIS_URL_ENV: "redis://10.0.0.1:6379/0"})
    assert cfg.redis_url == "redis://10.0.0.1:6379/0" and SharedStateConfig().with_env({}).redis_url is None
    a, b = SharedStateConfig().resolved_replica_id(), SharedStateConfig().resolved_replica_id()
    assert a != b
    from kvrouter.replicas import SnapshotConfig, store_for

    with pytest.raises(ConfigError):
        SnapshotConfig(path="/x", redis_key="k").validate()
    with pytest.raises(ConfigError):
        store_for(SnapshotConfig(redis_key="k"), None)
    assert store_for(SnapshotConfig(), None) is None and not SnapshotConfig().enabled


async def test_the_gateway_wires_shared_state_and_snapshots(ns_flush: RedisServer, tmp_path: Path) -> None:
    """``replicas.redis_url`` and ``snapshot.path`` in the fleet file: the gateway shares its state, snapshots
    its index, and both report on the gateway's registry (no name clashes)."""
    from prometheus_client import generate_latest

    from indexer.config import InstanceConfig, parse_fleet
    from kvrouter.config import RouterFleetConfig
    from kvrouter.gateway import Gateway

    snap = tmp_path / "index.snapshot"
    cfg = parse_fleet(
        {
            "block_size": BS,
            "instances": [{"name": "w0", "url": "http://127.0.0.1:9", "events": "tcp://127.0.0.1:9"}],
            "replicas": {"redis_url": ns_flush.url, "namespace": "gw"},
            "snapshot": {"path": str(snap)},
        },
        RouterFleetConfig,
    )
    assert cfg.instances[0] == InstanceConfig("w0", url="http://127.0.0.1:9", events="tcp://127.0.0.1:9")
    gw = Gateway(cfg)
    assert gw.shared is not None and gw.warm is not None
    await gw.start()
    try:
        text = generate_latest(gw.metrics.registry).decode()
        for name in (
            "kvrouter_shared_state_up 1.0",
            "kvrouter_shared_state_peers",
            "kvrouter_index_snapshots_total",
        ):
            assert name in text
    finally:
        await gw.stop()
    assert snap.exists()  # the last snapshot at shutdown


async def test_response_ids_reach_every_replica(ns_flush: RedisServer) -> None:
    """Which instance holds a stored response is learned by the peers within one round trip, with what
    was left of its time to live, and never published back."""
    ra, rb = router(), router()
    fa, fb = ResponseAffinity(ttl_s=60.0), ResponseAffinity(ttl_s=60.0)
    a = SharedState(ra, config(ns_flush.url, "a"), registry=CollectorRegistry(), affinity=fa)
    b = SharedState(rb, config(ns_flush.url, "b"), registry=CollectorRegistry(), affinity=fb)
    fa.outbox, fb.outbox = [], []  # what start() does, without the background loop
    try:
        now = time.monotonic()
        fa.record("resp_1", Holder("w2", 500), now - 30.0)  # recorded half a life ago
        assert await a.sync_once() and await b.sync_once()
        got = fb.lookup("resp_1", time.monotonic())
        assert got == Holder("w2", 500) and fb.learned_from_peers == 1
        exp = fb.map.expiry("resp_1")
        assert exp is not None and 29.0 < exp - time.monotonic() <= 30.5
        assert fb.outbox == [] and b.state.unsent_affinity == []  # not echoed
        # a batch from a replica of the release before (a bare list of speculative entries) still reads
        old = msgspec.msgpack.encode([SpecWire("w0", 0, b"\0" * 8, 1000)])
        assert decode_batch(old).s[0].instance == "w0"
    finally:
        await a.stop()
        await b.stop()
