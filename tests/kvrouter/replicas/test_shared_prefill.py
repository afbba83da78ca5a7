"""What router replicas take in from each other ends when the fleet's events say the work is done, on a
real redis-server (issue 29: sharing state through Redis placed worse than sharing nothing).

* A peer's queued prefill ends when the events show its blocks stored, not at the peer's next report:
  a prefill shorter than a round trip no longer charges its target after it is done.
* An entry whose blocks were stored (and evicted again) before its replica published it is not published:
  peers would otherwise count the target as holding the prefix for the entry's whole TTL.
* With several worker processes (``kvrouter serve --workers``), the leader publishes the whole host's load
  and every worker takes in the other replicas' entries, not the leader alone."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from indexer import Indexer
from indexer.encode import PayloadEncoder
from kvrouter.host import HostLayout, HostLoads, HostMemory, SpeculativeRings
from kvrouter.host.wiring import RingSync
from kvrouter.replicas import SharedState
from kvrouter.routing import RouteInput, Router
from kvrouter.routing.router import Candidate
from kvrouter.types import InstanceId
from tests.kvrouter.replicas.test_shared_state import BS, TARGETS, Pair, config, ns_flush, pair, router
from tests.support.redis_server import RedisServer, redis_server

__all__ = ["ns_flush", "pair", "redis_server"]

ENC = PayloadEncoder()


def prompt(seed: int, blocks: int = 8) -> tuple[list[int], RouteInput]:
    toks = list(range(seed * 1000, seed * 1000 + blocks * BS + 1))
    return toks, RouteInput(f"q{seed}-{time.monotonic_ns()}", len(toks), Indexer(BS).chain_hashes(toks))  # type: ignore[arg-type]


def stored(routers: list[Router], inst: str, toks: list[int], seed: int) -> None:
    """The instance's events for the prompt's full blocks reach every replica (each subscribes itself)."""
    n = len(toks) // BS
    engines = [seed * 100 + i for i in range(n)]
    for r in routers:
        r.indexer.apply_payload(inst, ENC.batch([ENC.stored(engines, None, toks[: n * BS], BS)], ts=1.0))


def evicted(routers: list[Router], inst: str, toks: list[int], seed: int) -> None:
    engines = [seed * 100 + i for i in range(len(toks) // BS)]
    for r in routers:
        r.indexer.apply_payload(inst, ENC.batch([ENC.removed(engines[::-1])], ts=2.0))


def cand(r: Router, inp: RouteInput, target: str) -> Candidate:
    (c,) = [c for c in r.candidates(inp, TARGETS, time.monotonic()) if c.target == target]
    return c


def send(r: Router, inp: RouteInput) -> str:
    d = r.route(inp, TARGETS, time.monotonic())
    assert d.chosen is not None
    r.dispatched(inp, d.chosen, time.monotonic())
    return d.chosen.target


async def test_a_peers_prefill_ends_when_the_events_show_its_blocks_stored(pair: Pair) -> None:
    ra, a, rb, b = pair
    toks, inp = prompt(1)
    target = send(ra, inp)
    assert await a.sync_once() and await b.sync_once()
    _, other = prompt(2)
    # a's request, not yet computed there: its report (33 tokens) as far as its entry's blocks go (8 x 4)
    assert cand(rb, other, target).pending_prefill_tokens == 32
    stored([ra, rb], target, toks, 1)  # computed: every replica sees the blocks stored ...
    assert await a.sync_once() and await b.sync_once()
    # ... while a's report still has it prefilling (its first token has not come back through a yet)
    assert rb.load.get(InstanceId(target)).external_prefill_tokens == 33
    assert cand(rb, other, target).pending_prefill_tokens == 0
    assert cand(rb, other, target).in_flight == 1  # still in flight at a: only the prefill is done


async def test_an_entry_whose_blocks_came_and_went_before_it_was_published_stays_home(pair: Pair) -> None:
    ra, a, rb, b = pair
    toks, inp = prompt(5)
    target = send(ra, inp)
    stored([ra, rb], target, toks, 5)
    evicted([ra, rb], target, toks, 5)  # cache pressure: gone before a's next round trip
    assert await a.sync_once() and await b.sync_once()
    assert a.state.done_unsent == 1 and b.state.applied_entries == 0
    best = rb.indexer.lookup_chains(inp.chains, inp.num_tokens, now=time.monotonic()).best()  # type: ignore[arg-type]
    assert best is None or best.matched_blocks == 0  # no replica counts the blocks as held
    # an entry still in progress at publication is shared as before
    _, inp2 = prompt(6)
    target2 = send(ra, inp2)
    assert await a.sync_once() and await b.sync_once()
    m = rb.indexer.lookup_chains(inp2.chains, inp2.num_tokens, now=time.monotonic()).best()  # type: ignore[arg-type]
    assert m is not None and m.instance == target2 and m.speculative_blocks == 8


@pytest.fixture
async def host_pair(
    ns_flush: RedisServer,
) -> AsyncIterator[tuple[list[Router], list[SharedState], Router, SharedState]]:
    """Replica a as a host of two worker processes (worker 0 leads), replica b as one process."""
    layout = HostLayout(workers=2, targets=8, instances=8, ring_words=1 << 12)
    mem = HostMemory(layout, bytearray(layout.size()), threading.Lock())
    workers = [router(), router()]
    # as the gateway does: every worker builds its shared state (its count of peers' prefill) ...
    states = [SharedState(r, config(ns_flush.url, "a"), registry=CollectorRegistry()) for r in workers]
    for k, r in enumerate(workers):  # ... over the host's memory (what Gateway(host=WorkerHost(...)) builds)
        r.load.shared = HostLoads(mem, k)
        r.host = RingSync(
            r.indexer, SpeculativeRings(mem, k), keep_outbox=k == 0, peer_prefill=r.peer_prefill
        )
    workers[0].indexer.speculative_outbox = []  # the leader alone runs round trips (start() without the loop)
    rb = router()
    b = SharedState(rb, config(ns_flush.url, "b"), registry=CollectorRegistry())
    rb.indexer.speculative_outbox = []
    yield workers, states, rb, b
    await states[0].stop()
    await b.stop()


async def test_every_worker_of_a_host_shares(
    host_pair: tuple[list[Router], list[SharedState], Router, SharedState],
) -> None:
    (w0, w1), (lead, _), rb, b = host_pair
    # a request the second worker sent is in the load the leader publishes
    _, inp = prompt(7)
    target = send(w1, inp)
    assert await lead.sync_once() and await b.sync_once()
    assert rb.load.get(InstanceId(target)).external_in_flight == 1
    assert rb.indexer.lookup_chains(inp.chains, 1).best().speculative_blocks == 8  # type: ignore[arg-type, union-attr]
    # b's request reaches the second worker too: its entry, and its prefill until the blocks are stored
    toks2, inp2 = prompt(8)
    target2 = send(rb, inp2)
    assert await b.sync_once() and await lead.sync_once()
    _, other = prompt(9)
    for w in (w0, w1):
        c = cand(w, inp2, target2)
        assert c.speculative_blocks == 8 and c.cached_tokens == 32, w
        assert cand(w, other, target2).pending_prefill_tokens == 32
    assert isinstance(w1.host, RingSync) and w1.host.from_replicas == 1
    stored([w0, w1], target2, toks2, 8)
    assert all(cand(w, other, target2).pending_prefill_tokens == 0 for w in (w0, w1))
