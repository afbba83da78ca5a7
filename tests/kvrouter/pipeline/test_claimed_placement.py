"""Two router replicas' request pipelines placing one new prompt at the same moment, on a real
redis-server (issue 29): whatever each one's view of the load says, both send it where the first claim
put it; the claimant predicts no hit for the prompt it computes, the follower expects it there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry

from indexer import Indexer, SourceKey
from indexer.config import parse_fleet
from kvrouter.config import RouterFleetConfig
from kvrouter.pipeline import PassThroughTokens, PipelineMetrics, Prepared, RequestPipeline
from kvrouter.replicas import PrefixClaims, SharedStateConfig
from kvrouter.routing import Router, Target
from kvrouter.routing.router import HostSync
from kvrouter.types import InstanceId, TargetKey
from tests.support.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

NAMES = ("a", "b", "c")
FLEET = """
block_size: 16
instances:
  - {name: a, url: "http://127.0.0.1:1"}
  - {name: b, url: "http://127.0.0.1:2"}
  - {name: c, url: "http://127.0.0.1:3"}
routing: {policy: kv-aware, shadow: false}
"""


class Targets:
    def targets(self, model: str | None) -> list[Target]:
        return [Target(InstanceId(n)) for n in NAMES]

    def known_model(self, model: str | None) -> bool:
        return True

    def base_model(self, model: str | None) -> str | None:
        return None

    def instance_targets(self, name: str) -> list[Target] | None:
        return [Target(InstanceId(name))]


def pipeline(host: Callable[[Indexer], HostSync] | None = None) -> RequestPipeline:
    """A router's pipeline over the three idle targets; ``host``: its exchange with the other workers of
    its host, made over its index (None: one process)."""
    cfg = parse_fleet(yaml.safe_load(FLEET), RouterFleetConfig)
    ix = Indexer(cfg.block_size)
    for n in NAMES:
        ix.register(SourceKey(n, 0))
    router = Router(ix, cfg.router_config(), host=host(ix) if host is not None else None)
    return RequestPipeline(cfg, router, Targets(), PassThroughTokens(), PipelineMetrics(CollectorRegistry()))


async def diverging_views(first: RequestPipeline, second: RequestPipeline) -> tuple[Prepared, Prepared, str]:
    """One new prompt prepared by both, and the target ``first`` would choose, which ``second`` sees as
    busy: on its own, ``second`` would send the prompt elsewhere."""
    p1 = await first.prepare(body(1), "completions", {})
    own = first.decide(p1, dry_run=True).chosen
    assert own is not None
    second.router.load.set_external({TargetKey(own.target): (3, 800)})
    p2 = await second.prepare(body(1), "completions", {})
    alone = second.decide(p2, dry_run=True).chosen
    assert alone is not None and alone.target != own.target
    return p1, p2, own.target


def body(seed: int) -> bytes:
    prompt = list(range(seed * 1000, seed * 1000 + 200))
    return msgspec.json.encode({"model": "m", "prompt": prompt, "max_tokens": 1})


@pytest.fixture
async def claims(redis_server: RedisServer) -> AsyncIterator[tuple[PrefixClaims, PrefixClaims]]:
    c = redis_server.client()
    c.flushdb()
    c.close()
    # A claim that takes longer than ``timeout_s`` is given up (placed on the local view): on a loaded
    # machine the first round trip (connection, script load) can, and this test is about placement.
    cfg = SharedStateConfig(redis_url=redis_server.url, namespace="pipe", timeout_s=10.0, lease_s=20.0)
    one, two = PrefixClaims(cfg, 5.0), PrefixClaims(cfg, 5.0)
    yield one, two
    await one.close()
    await two.close()


async def test_replicas_with_different_views_place_a_new_prompt_where_it_was_claimed(
    claims: tuple[PrefixClaims, PrefixClaims],
) -> None:
    first, second = pipeline(), pipeline()
    first.claims = claims[0]
    second.claims = claims[1]
    p1, p2, own = await diverging_views(first, second)

    d1 = await first.admit(p1)  # claims own
    assert d1.chosen is not None and d1.chosen.target == own
    assert (d1.reason, d1.predicted_cached_tokens) == ("load", 0)
    first.dispatched(p1, d1.chosen)
    d2 = await second.admit(p2)  # follows the claim
    assert d2.chosen is not None and d2.chosen.target == own
    assert d2.reason == "cache" and d2.chosen.speculative_blocks == 200 // 16

    # another prompt: its own claim, by the second replica's choice
    p3 = await second.prepare(body(2), "completions", {})
    d3 = await second.admit(p3)
    ch = p3.inp.chains
    assert d3.chosen is not None and ch is not None
    got = await claims[0].claim(int(ch[0]), "x", ch)
    assert got is not None and got.owner == d3.chosen.target


def body_chains(p: Prepared) -> list[int]:
    assert p.inp.chains is not None
    return [int(c) for c in p.inp.chains]


async def solo_target(seed: int) -> str:
    pl = pipeline()
    d = pl.decide(await pl.prepare(body(seed), "completions", {}), dry_run=True)
    assert d.chosen is not None
    return d.chosen.target


async def colliding() -> tuple[int, int]:
    """Two prompts that a router on an idle fleet, knowing of neither, places on one target."""
    seen: dict[str, int] = {}
    for seed in range(3, 40):
        t = await solo_target(seed)
        if t in seen:
            return seen[t], seed
        seen[t] = seed
    raise AssertionError("no two prompts share a target")


async def test_new_prompts_placed_at_once_by_two_replicas_spread_as_one_routers_would(
    claims: tuple[PrefixClaims, PrefixClaims],
) -> None:
    """Each replica alone would put its new prompt on the same target (neither knows of the other's
    yet); the second to claim is told of the first's placement, expects it there and moves, as one
    router that had placed the first would (its cache the fuller)."""
    s1, s2 = await colliding()
    first, second = pipeline(), pipeline()
    first.claims, second.claims = claims
    p1 = await first.prepare(body(s1), "completions", {})
    p2 = await second.prepare(body(s2), "completions", {})
    d1, d2 = await asyncio.gather(first.admit(p1), second.admit(p2))
    assert d1.chosen is not None and d2.chosen is not None
    assert d1.chosen.target != d2.chosen.target
    assert {d1.chosen.target, d2.chosen.target} >= {await solo_target(s1)}
    assert d1.predicted_cached_tokens == d2.predicted_cached_tokens == 0
    # Each counts its own placement in the placement band's balance key, and the one told of the
    # other's by the claims log counts that one too.
    now = time.monotonic()
    n = len(body_chains(p1))
    for pl, d in ((first, d1), (second, d2)):
        assert pl.router.placed.blocks(d.chosen.target, now) == n
    told = [pl.router.placed.blocks(o.chosen.target, now) for pl, o in ((first, d2), (second, d1))]
    assert sorted(told) == [0, n] or told == [n, n], told


async def test_new_prompts_of_one_process_awaiting_their_claims_spread_too(
    claims: tuple[PrefixClaims, PrefixClaims],
) -> None:
    """One process decides its second new prompt while the first awaits its claim (not dispatched yet):
    the log tells it of the first."""
    s1, s2 = await colliding()
    one = pipeline()
    one.claims = claims[0]
    p1 = await one.prepare(body(s1), "completions", {})
    p2 = await one.prepare(body(s2), "completions", {})
    d1, d2 = await asyncio.gather(one.admit(p1), one.admit(p2))
    assert d1.chosen is not None and d2.chosen is not None
    assert d1.chosen.target != d2.chosen.target
