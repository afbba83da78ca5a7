"""A prompt no target holds, asked for at several router replicas before any round trip could tell them of
each other, on a real redis-server (issue 29): the first to place it claims where (``PrefixClaims``), the
others follow that claim, and the placing replica publishes at once (``SharedState.nudge``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvrouter.replicas import PrefixClaims, SharedState
from kvrouter.routing.new_placements import ClaimAnswer
from kvrouter.types import InstanceId
from tests.kvrouter.replicas.test_shared_state import TARGETS, config, ns_flush, prompt, router, send
from tests.support.net import free_port
from tests.support.redis_server import RedisServer, redis_server
from tests.support.wait import until

__all__ = ["ns_flush", "redis_server"]


Claims = tuple[PrefixClaims, PrefixClaims, CollectorRegistry]


def sample(reg: CollectorRegistry, outcome: str) -> float:
    v = reg.get_sample_value("kvrouter_shared_state_prefix_claims_total", {"outcome": outcome})
    return v or 0.0


@pytest.fixture
async def claims(
    ns_flush: RedisServer,
) -> AsyncIterator[tuple[PrefixClaims, PrefixClaims, CollectorRegistry]]:
    reg = CollectorRegistry()
    # Round trips bounded generously: on a loaded machine the first (connection, script load) can take
    # longer than the default 0.5 s, and these tests are about what a claim decides, not its deadline.
    roomy = {"timeout_s": 10.0, "lease_s": 20.0}
    a = PrefixClaims(config(ns_flush.url, "a", **roomy), 5.0, registry=reg)
    b = PrefixClaims(config(ns_flush.url, "b", **roomy), 5.0, registry=CollectorRegistry())
    yield a, b, reg
    await a.close()
    await b.close()


def test_a_prompt_is_new_until_some_target_holds_or_expects_it() -> None:
    r = router()
    inp = prompt(3)
    assert r.new_prefix(inp)
    send(r, inp)  # its speculative entry: the next request expects it there
    assert not r.new_prefix(prompt(3))
    assert r.new_prefix(prompt(4))


def chains(*hashes: int) -> np.ndarray:
    return np.array(hashes, dtype=np.int64)


def owner(got: ClaimAnswer | None) -> str | None:
    assert got is not None and not got.newer
    return got.owner


async def test_the_first_claim_holds_and_later_ones_follow_it(claims: Claims) -> None:
    a, b, reg = claims
    assert owner(await a.claim(11, "w1", chains(11, 5))) == "w1"
    assert owner(await b.claim(11, "w2", chains(11, 5))) == "w1"  # b would have placed it on w2
    assert owner(await a.claim(11, "w0", chains(11, 5))) == "w1"
    assert (sample(reg, "won"), sample(reg, "followed")) == (1.0, 1.0)


async def test_a_new_prompt_is_claimed_only_by_a_process_told_of_every_placement_before_it(
    claims: Claims,
) -> None:
    """Another prompt: b is first told where a placed its new prompt (nothing claimed), then claims; a,
    which logged its own placement, is told of b's alone; without looking, a claim is taken at once."""
    a, b, reg = claims
    assert owner(await a.claim(11, "w1", chains(11, 5))) == "w1"
    got = await b.claim(12, "w2", chains(12, 6, 7))
    assert got is not None and got.owner is None
    assert [(n.target, n.chain_array().tolist()) for n in got.newer] == [("w1", [11, 5])]
    assert owner(await b.claim(12, "w2", chains(12, 6, 7))) == "w2"
    got = await a.claim(13, "w0", chains(13))
    assert got is not None and [(n.target, n.chain_array().tolist()) for n in got.newer] == [
        ("w2", [12, 6, 7])
    ]
    assert owner(await b.claim(14, "w1", chains(14), look=False)) == "w1"  # a's 13 not yet claimed
    assert owner(await a.claim(12, "w0", chains(12))) == "w2"  # a live claim answers before the log
    assert (sample(reg, "won"), sample(reg, "newer"), sample(reg, "followed")) == (1.0, 1.0, 1.0)


async def test_a_replica_that_follows_a_claim_routes_to_the_claimed_target(claims: Claims) -> None:
    """b's own view would put the prompt elsewhere (a's request is in flight where a put it); after
    following a's claim it decides for that target, on the expected prefix, as a would."""
    a, b, _ = claims
    ra, rb = router(), router()
    first = send(ra, prompt(9))
    assert first.chosen is not None
    ch = prompt(9).chains
    assert ch is not None and owner(await a.claim(int(ch[0]), first.chosen.target, ch)) == first.chosen.target
    rb.load.set_external({InstanceId(first.chosen.target): (3, 0)})  # b sees that target busy
    inp = prompt(9)
    mine = rb.route(inp, TARGETS, time.monotonic(), dry_run=True)
    assert mine.chosen is not None and mine.chosen.target != first.chosen.target
    assert inp.chains is not None
    got = owner(await b.claim(int(inp.chains[0]), mine.chosen.target, inp.chains))
    assert got == first.chosen.target
    (at,) = [c for c in mine.ranked if c.target == got]
    rb.expect(inp.chains, at, time.monotonic())
    assert not rb.new_prefix(inp)
    d = rb.route(inp, TARGETS, time.monotonic())
    assert d.chosen is not None and d.chosen.target == first.chosen.target
    assert d.reason == "cache" and d.chosen.speculative_blocks == 8


async def test_an_unreachable_store_costs_one_wait_then_none() -> None:
    """No Redis answers: the claim fails once (counted), and is not asked for again for ``lease_s``; a
    decision does not wait for a round trip either."""
    reg = CollectorRegistry()
    c = PrefixClaims(config(f"redis://127.0.0.1:{free_port()}/0", "c", timeout_s=0.2), 5.0, registry=reg)
    try:
        assert await c.claim(1, "w0", chains(1)) is None
        assert await c.claim(2, "w0", chains(2)) is None
        assert (sample(reg, "error"), sample(reg, "skipped")) == (1.0, 1.0)
    finally:
        await c.close()
    s = SharedState(router(), config(f"redis://127.0.0.1:{free_port()}/0", "c", timeout_s=0.2))
    await s.start()
    try:
        await s.fresh()  # no round trip can succeed: not waited for
        assert s.fresh_waits == 0 and not s.status()["up"]
    finally:
        await s.stop()


async def test_a_new_placement_is_published_and_read_without_waiting_for_the_interval(
    ns_flush: RedisServer,
) -> None:
    """At a 30 s interval only a nudge (after a's placement) and a fresh round trip (before b's) carry a's
    entry to b before the test ends."""
    ra, rb = router(), router()
    slow = {"interval_s": 30.0, "lease_s": 60.0, "timeout_s": 10.0}
    a = SharedState(ra, config(ns_flush.url, "a", **slow), registry=CollectorRegistry())
    b = SharedState(rb, config(ns_flush.url, "b", **slow), registry=CollectorRegistry())
    await a.start()
    await b.start()
    try:
        first = send(ra, prompt(5))
        assert first.chosen is not None
        a.nudge()
        await until(lambda: ra.indexer.speculative_outbox == [] and a.state.unsent == [], what="published")
        assert rb.new_prefix(prompt(5))
        await b.fresh()  # before b places a new prompt: a round trip now, not at the interval
        assert (b.fresh_waits, b.fresh_timeouts) == (1, 0)
        assert not rb.new_prefix(prompt(5))
        d = rb.route(prompt(5), TARGETS, time.monotonic())
        assert d.chosen is not None and d.chosen.target == first.chosen.target and d.reason == "cache"
    finally:
        await a.stop()
        await b.stop()
