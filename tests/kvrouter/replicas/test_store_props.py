"""The replicas' shared store against a reference model, on both stores (in-process hub on a fake clock, a
real redis-server on real time); and ``ReplicaState`` (what each replica publishes and takes in) against a
model of several routers' loads and speculative entries.

The store model needs no clock of its own: every reply carries the store's time (``server_ms``), which is the
time the store used for that round trip, so the model decides leases with it.  A lease ending within 2 ms of
a reply's time may be seen either way (Redis expires keys on its own millisecond clock).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import numpy as np
import redis.asyncio as aioredis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from indexer import Indexer, SourceKey
from kvrouter.replicas import MemoryReplicaHub, RedisReplicaStore, ReplicaStore, SyncRequest
from kvrouter.replicas.state import ReplicaState, SpecWire
from kvrouter.routing import Router, RouterConfig
from kvrouter.types import RequestId, TargetKey
from tests.support.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

LEASE_MS = 60
WINDOW_MS = 600_000  # no batch leaves the window during a run: windows have their own contract test
SLACK_MS = 2
REPLICAS = ["r1", "r2", "r3"]


@dataclass
class Member:
    loads: bytes
    lease_end: int


@dataclass
class StoreModel:
    members: dict[str, Member] = field(default_factory=dict)
    stream: list[tuple[str, bytes]] = field(default_factory=list)
    """(publisher, blob) of every batch, in the order the store took them."""
    position: dict[str, int] = field(default_factory=dict)
    """The stream position each cursor a reply handed out stands for."""

    def renew(self, replica: str, loads: bytes, now: int) -> None:
        """A sync at ``now``: this replica's lease first, then every lease that ended is dropped (those
        within the slack of their end may still be there)."""
        self.members[replica] = Member(loads, now + LEASE_MS)
        self.members = {r: mem for r, mem in self.members.items() if mem.lease_end > now - SLACK_MS}

    def peer_loads(self, replica: str, now: int) -> tuple[Counter[bytes], Counter[bytes]]:
        """The loads a sync of ``replica`` at ``now`` must return (as multisets): at least the first (live
        beyond the slack), at most the second (every lease the model still holds)."""
        peers = {r: mem for r, mem in self.members.items() if r != replica}
        sure = Counter(mem.loads for mem in peers.values() if mem.lease_end > now + SLACK_MS)
        return sure, Counter(mem.loads for mem in peers.values())


# ops: ("sync", replica, loads, with_spec, fresh_cursor, max_read) | ("leave", replica) | ("wait", seconds)
sync_op = st.tuples(
    st.just("sync"),
    st.sampled_from(REPLICAS),
    st.dictionaries(
        st.sampled_from(["w0", "w1"]), st.tuples(st.integers(0, 9), st.integers(0, 999)), max_size=2
    ),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1, 2, 100]),
)
ops_st = st.lists(
    st.one_of(
        sync_op,
        sync_op,
        sync_op,
        st.tuples(st.just("leave"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("wait"), st.sampled_from([0.03, 0.05, 0.1])),
    ),
    max_size=14,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 5_000.0

    def __call__(self) -> float:
        return self.t


async def run_against_model(store: ReplicaStore, wait: object, ops: list[tuple[object, ...]]) -> None:
    m = StoreModel()
    cursors: dict[str, str] = {}
    tags = itertools.count()
    last_ms = 0
    for op in ops:
        if op[0] == "wait":
            await wait(op[1])  # type: ignore[operator]
            continue
        if op[0] == "leave":
            replica = str(op[1])
            await store.leave(replica)
            m.members.pop(replica, None)
            continue
        _, replica, loads, with_spec, fresh, max_read = op
        assert isinstance(replica, str) and isinstance(max_read, int) and isinstance(loads, dict)
        blob = msgspec.msgpack.encode([SpecWire("w0", 0, next(tags).to_bytes(8, "little"), 5000)])
        cursor = "" if fresh else cursors.get(replica, "")
        specs = blob if with_spec else b""
        enc = msgspec.msgpack.encode(loads)
        req = SyncRequest(replica, LEASE_MS, enc, specs, cursor, WINDOW_MS, max_read)
        reply = await store.sync(req)
        now = reply.server_ms
        assert now >= last_ms, "the store's clock went back"
        last_ms = now
        # the model: this replica's lease first, then the batch, then the read
        m.renew(replica, req.loads, now)
        if with_spec:
            m.stream.append((replica, blob))
        start = m.position[cursor] if cursor else 0
        taken = m.stream[start : start + max_read]
        end = start + len(taken)
        # peers' loads: every live lease but ours, those within the slack of their end may go either way
        sure, maybe = m.peer_loads(replica, now)
        got = Counter(reply.peer_loads)
        assert not sure - got and not got - maybe, (op, got, sure)  # as multisets
        # peers' batches after the cursor, in order, never our own; at most max_read read (ours count)
        assert [b for _, b in reply.peer_specs] == [b for r, b in taken if r != replica], op
        assert all(abs(now - ms) < 60_000 for ms, _ in reply.peer_specs)
        if end > start or cursor == "":
            m.position[reply.cursor] = end
        else:
            assert reply.cursor == cursor  # nothing read: the cursor stays
        cursors[replica] = reply.cursor


# A lease that ends while a peer keeps the members alive (the set itself expires once everyone is quiet).
LEASE_ENDS = [
    ("sync", "r1", {"w0": (1, 2)}, True, False, 100),
    ("wait", 0.03),
    ("sync", "r2", {}, False, False, 100),
    ("wait", 0.05),
    ("sync", "r2", {}, False, False, 100),
]
# Reads bounded by max_read resume at the cursor; a fresh cursor reads everything again.
CURSORS = [
    *[("sync", "r1", {}, True, False, 100) for _ in range(3)],
    *[("sync", "r2", {}, False, False, 1) for _ in range(4)],
    ("sync", "r2", {}, False, True, 2),
]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@example(ops=LEASE_ENDS)
@example(ops=CURSORS)
@given(ops=ops_st)
def test_memory_hub_against_the_model(ops: list[tuple[object, ...]]) -> None:
    clock = FakeClock()

    async def tick(dt: float) -> None:
        clock.t += dt

    asyncio.run(run_against_model(MemoryReplicaHub(clock), tick, ops))


_namespaces = itertools.count()


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@example(ops=LEASE_ENDS)
@example(ops=CURSORS)
@given(ops=ops_st)
def test_redis_store_against_the_model(redis_server: RedisServer, ops: list[tuple[object, ...]]) -> None:
    async def go() -> None:
        client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, decode_responses=False)
        try:
            store = RedisReplicaStore(client, f"props{next(_namespaces)}")
            await run_against_model(store, asyncio.sleep, ops)
        finally:
            await client.aclose()

    asyncio.run(go())


# ---------------------------------------------------------------------------------------------- state
BS = 4
TTL = 4.0
TARGETS = [TargetKey("w0"), TargetKey("w1")]


def replica_router() -> Router:
    ix = Indexer(BS, speculative_ttl=TTL)
    for t in TARGETS:
        ix.register(SourceKey(t, 0))
    ix.speculative_outbox = []
    return Router(ix, RouterConfig(policy="kv-aware", shadow=False))


state_ops = st.lists(
    st.one_of(
        st.tuples(st.just("dispatch"), st.integers(0, 2), st.sampled_from(TARGETS), st.integers(1, 6)),
        st.tuples(st.just("finish"), st.integers(0, 2), st.integers(0, 30)),
        st.tuples(st.just("sync"), st.integers(0, 2)),
        st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0])),
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
# an entry that ages in the store before a peer takes it in, then outlives its ttl
@example(ops=[("dispatch", 0, TARGETS[0], 2), ("sync", 0), ("wait", 3.0), ("sync", 1), ("wait", 3.0)])
# two peers' requests on one target add up
@example(ops=[("dispatch", 0, TARGETS[0], 1), ("dispatch", 1, TARGETS[0], 1), ("dispatch", 1, TARGETS[1], 1)])
@given(ops=state_ops)
def test_replica_state_against_a_model(ops: list[tuple[object, ...]]) -> None:
    """Three replicas on one hub, on one fake clock.  After every replica has synced twice in a row (round
    trips settle), each one's external load per target is the sum of the others' own requests there, and its
    index holds each peer's speculative entry exactly while the sender's ttl runs (sent + ttl)."""
    clock = FakeClock()
    hub = MemoryReplicaHub(clock)
    routers = [replica_router() for _ in range(3)]
    states = [ReplicaState(r, f"r{i}") for i, r in enumerate(routers)]
    own: list[dict[RequestId, TargetKey]] = [{}, {}, {}]
    sent: list[tuple[int, TargetKey, int, float]] = []  # (replica, target, chain, expiry)
    ids = itertools.count()

    async def sync(i: int) -> None:
        st_ = states[i]
        reply = await hub.sync(st_.request(clock(), lease_s=30.0, window_s=600.0, max_read=10_000))
        st_.published()
        st_.apply(reply, clock())

    async def go() -> None:
        for op in ops:
            if op[0] == "dispatch":
                _, i, t, k = op
                assert isinstance(i, int) and isinstance(t, str) and isinstance(k, int)
                rid = RequestId(f"q{next(ids)}")
                chain = 1_000_003 * (next(ids) + 1)
                routers[i].load.dispatch(rid, TargetKey(t), 16 * k)
                chains = np.array([chain], dtype=np.int64)
                routers[i].indexer.add_speculative(SourceKey(t, 0), chains, now=clock())
                own[i][rid] = TargetKey(t)
                sent.append((i, TargetKey(t), chain, clock() + TTL))
            elif op[0] == "finish":
                _, i, pick = op
                assert isinstance(i, int) and isinstance(pick, int)
                if own[i]:
                    rid = sorted(own[i])[pick % len(own[i])]
                    routers[i].finished(rid)
                    del own[i][rid]
            elif op[0] == "sync":
                await sync(int(op[1]))  # type: ignore[call-overload]
            else:
                clock.t += float(op[1])  # type: ignore[arg-type]
        for _ in range(2):
            for i in range(3):
                await sync(i)
        now = clock()
        for i, r in enumerate(routers):
            for t in TARGETS:
                peers = sum(1 for j in range(3) if j != i for tt in own[j].values() if tt == t)
                assert r.load.get(t).external_in_flight == peers, (i, t)
            for j, t, chain, expiry in sent:
                if j == i:
                    continue
                held = any(
                    m.source == SourceKey(t, 0) and m.speculative
                    for m in r.indexer.index.match(np.array([chain], dtype=np.int64))
                )
                # ms-granular ages on the store's clock: within 10 ms of the end it may go either way
                if expiry > now + 0.01:
                    assert held, (i, j, t, expiry - now)
                elif expiry <= now - 0.01:
                    r.indexer.index.expire(now)
                    assert not any(
                        m.source == SourceKey(t, 0)
                        for m in r.indexer.index.match(np.array([chain], dtype=np.int64))
                    ), (i, j, t, now - expiry)

    asyncio.run(go())


def test_the_model_sees_expiry() -> None:
    """The model's lease rule on a literal case (so a model that never expires anything cannot pass)."""
    m = StoreModel(members={"a": Member(b"x", 100), "b": Member(b"y", 200)})
    assert m.peer_loads("c", 150) == (Counter({b"y": 1}), Counter({b"x": 1, b"y": 1}))
    m.renew("c", b"z", 150)  # a's lease ended 50 ms ago: gone; b's runs until 200: kept
    assert sorted(m.members) == ["b", "c"] and m.members["c"].lease_end == 150 + LEASE_MS
    assert m.peer_loads("b", 199) == (Counter({b"z": 1}), Counter({b"z": 1}))
    assert m.peer_loads("c", 199) == (Counter(), Counter({b"y": 1}))  # b within the slack of its end
