"""The deployment the Redis index serves: one indexer ingests vLLM payloads into Redis, stateless routers
read it (one round trip per lookup) and mirror the indexer's trust, which lapses if the indexer dies."""

from __future__ import annotations

import asyncio
import time

from indexer import Indexer, SourceKey, Trust
from indexer.encode import PayloadEncoder
from indexer.redis_index import RedisBlockIndex
from kvrouter.replicas.trust import TrustMirror
from kvrouter.routing import RouteInput, Router, RouterConfig
from kvrouter.routing.router import Target
from kvrouter.types import InstanceId, RequestId
from tests.support.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

BS = 4
TARGETS = [Target(InstanceId(n)) for n in ("v0", "v1")]


async def test_a_stateless_router_routes_on_what_a_standalone_indexer_ingested(
    redis_server: RedisServer,
) -> None:
    wc, rc = redis_server.client(), redis_server.client()
    wc.flushdb()
    try:
        writer = Indexer(BS, index=RedisBlockIndex(wc))
        enc = PayloadEncoder()
        toks = list(range(1, 33))
        writer.register(SourceKey("v0", 0))
        writer.register(SourceKey("v1", 0))
        writer.apply_payload("v1", enc.batch([enc.stored(list(range(1, 9)), None, toks, BS)], ts=1.0))
        reader = Indexer(BS, index=RedisBlockIndex(rc))
        router = Router(reader, RouterConfig(policy="kv-aware", shadow=False))
        inp = RouteInput(RequestId("r1"), len(toks) + 1, reader.chain_hashes([*toks, 0]))
        before = router.route(inp, TARGETS, time.monotonic())
        assert before.chosen is not None and before.chosen.cached_tokens == 0  # cold: matches earn nothing
        # a TTL a busy machine cannot outrun between the writer's publish and the reader's read
        ttl = 2.0
        pub = TrustMirror(writer, writer.index, writer=True, interval_s=0.1, ttl_s=ttl)  # type: ignore[arg-type]
        sub = TrustMirror(reader, reader.index, writer=False, interval_s=0.1, ttl_s=ttl)  # type: ignore[arg-type]
        published = time.monotonic()
        assert await pub.once() and await sub.once()
        assert reader.trust(SourceKey("v1", 0)) is Trust.EXACT
        d = router.route(inp, TARGETS, time.monotonic())
        assert d.chosen is not None and d.chosen.target == "v1" and d.reason == "cache"
        assert d.chosen.cached_tokens == 32
        # the indexer stopped publishing: once its TTL has run out, its index is no longer trusted
        deadline = time.monotonic() + ttl + 10.0
        while reader.trust(SourceKey("v1", 0)) is not Trust.COLD:
            assert time.monotonic() < deadline, "trust never lapsed"
            await asyncio.sleep(0.05)
            assert await sub.once()
        assert time.monotonic() - published >= ttl  # not before: measured from before the publish
        assert router.route(inp, TARGETS, time.monotonic()).chosen.cached_tokens == 0  # type: ignore[union-attr]
    finally:
        wc.close()
        rc.close()


async def test_mirror_errors_are_counted_not_raised() -> None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    ix = Indexer(BS, index=RedisBlockIndex(dead))
    m = TrustMirror(ix, ix.index, writer=False)  # type: ignore[arg-type]
    assert not await m.once() and m.errors == 1
    dead.close()
