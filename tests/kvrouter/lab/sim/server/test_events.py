"""A live simulated fleet (HTTP load, real ZeroMQ) feeding kvrouter's indexer through the fleet file it
describes: the index ends up agreeing with every engine's actual cache, for each wire format family."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest

from indexer import Indexer, SourceKey
from indexer.subscriber import EventSubscriber
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig, free_port_block
from tests.support.sim_server import BS, shared_tokenizer
from tests.support.wait import until


@pytest.mark.parametrize("release", ["0.33.0", "0.23.0"])
async def test_indexer_fed_by_a_live_fleet_agrees_with_every_engine(release: str) -> None:
    tok, _ = shared_tokenizer()
    rng = random.Random(7)
    cfg = SimFleetConfig(
        instances=2,
        dp_size=2,
        profile="test",
        capacity_blocks=96,  # small: the load evicts, so BlockRemoved flows too
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        release=release,
        speed=4.0,
    )
    async with SimFleet(cfg, tokenizer=tok) as fleet, aiohttp.ClientSession() as http:
        fleet_cfg = fleet.fleet_config()
        assert [i.dp_size for i in fleet_cfg.instances] == [2, 2]
        ix = Indexer(BS)
        sub = EventSubscriber(ix, fleet_cfg)
        await sub.start()
        sources = [SourceKey(i.name, r) for i in fleet_cfg.instances for r in range(i.dp_size)]
        try:
            await until(lambda: all(sub.status[s].connected for s in sources), what="all sources connected")

            async def post(url: str, body: dict[str, Any], rank: int | None = None) -> None:
                headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
                async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            # Warm every rank until its subscription is live, then start from a cleared cache so a batch
            # lost to ZeroMQ's slow joiner before that cannot matter.
            for url in fleet.urls:
                for r in range(2):
                    body = {"prompt": [rng.randrange(1000, 30000) for _ in range(40)], "max_tokens": 1}
                    await post(url, body, r)
            await until(lambda: all(ix.sync(s).last is not None for s in sources), what="first batches")
            for url in fleet.urls:
                async with http.post(f"{url}/reset_prefix_cache") as resp:
                    assert resp.status == 200

            bases = [[rng.randrange(1000, 30000) for _ in range(400)] for _ in range(4)]
            prompts: list[list[int]] = []
            sem = asyncio.Semaphore(12)

            async def one(i: int) -> None:
                prompt = [*rng.choice(bases)[: rng.randrange(20, 400)], rng.randrange(1000, 30000)]
                prompts.append(prompt)
                body = {"prompt": prompt, "max_tokens": rng.randrange(1, 40), "ignore_eos": True}
                async with sem:  # unpinned: each instance's balancer picks the rank
                    await post(fleet.urls[i % 2], body)

            await asyncio.gather(*(one(i) for i in range(80)))

            def agrees() -> bool:
                for tokens in prompts:
                    got = {(m.instance, m.dp_rank): m.matched_blocks for m in ix.lookup(tokens).instances}
                    for s in fleet.servers:
                        for rank in s.instance.ranks:
                            if got.get((s.name, rank.rank), 0) != rank.engine.cached_prefix_blocks(tokens):
                                return False
                return True

            await until(agrees, what="index == engines")
            pubs = [rank.publisher for s in fleet.servers for rank in s.instance.ranks]
            assert all(p is not None and p.stats.sent > 2 for p in pubs)
            assert ix.counters.blocks_removed > 0 and ix.counters.clears == 4  # evictions and resets flowed
            assert not ix.counters.event_errors
        finally:
            await sub.stop()


async def test_bind_mode_publishers_connect_to_the_indexer() -> None:
    tok, _ = shared_tokenizer()
    bind = f"tcp://127.0.0.1:{free_port_block(1)}"
    cfg = SimFleetConfig(instances=2, profile="test", capacity_blocks=256, bind=bind, speed=4.0)
    async with SimFleet(cfg, tokenizer=tok) as fleet, aiohttp.ClientSession() as http:
        fleet_cfg = fleet.fleet_config()
        assert fleet_cfg.bind == bind and all(i.events is None and i.replay for i in fleet_cfg.instances)
        ix = Indexer(BS)
        sub = EventSubscriber(ix, fleet_cfg)
        await sub.start()
        sources = [SourceKey(i.name, 0) for i in fleet_cfg.instances]
        rng = random.Random(3)
        try:
            prompts: list[list[int]] = []

            async def send(url: str) -> None:
                prompt = [rng.randrange(1000, 30000) for _ in range(rng.randrange(40, 200))]
                prompts.append(prompt)
                async with http.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
                    assert r.status == 200

            # Each instance's topic kv@<name>@<model> names it; keep sending until both are known.
            for _ in range(100):
                await asyncio.gather(*(send(u) for u in fleet.urls))
                await asyncio.sleep(0.02)
                if all(s in sub.status and sub.status[s].messages for s in sources):
                    break
            for url in fleet.urls:
                async with http.post(f"{url}/reset_prefix_cache") as resp:
                    assert resp.status == 200
            prompts.clear()
            for _ in range(10):
                await asyncio.gather(*(send(u) for u in fleet.urls))

            def agrees() -> bool:
                for tokens in prompts:
                    got = {m.instance: m.matched_blocks for m in ix.lookup(tokens).instances}
                    for s in fleet.servers:
                        if got.get(s.name, 0) != s.instance.ranks[0].engine.cached_prefix_blocks(tokens):
                            return False
                return True

            await until(agrees, what="index == engines (bind mode)")
            assert any(got.matched_blocks for got in ix.lookup(prompts[-1]).instances)
        finally:
            await sub.stop()
