"""Tenants never see each other's cache: requests with different ``cache_salt`` (or per-key salts) never
match each other's blocks in lookups, routing, speculative entries or shadow scoring, under concurrency.

::

    tenant 0 (key k0)   burst of the shared prompt p ──┐  all at once, for every prompt
    tenants 1..n-1      one request each of p ─────────┤  (per-key salts, and one client-chosen cache_salt)
                                                       ▼
    each tenant's first request of p:  predicted cached tokens (x-kvrouter-cached-tokens) == 0,
                                       engine-reported cached tokens == 0 (the gateway injected the salt)
    then each tenant again:            predicted == reported > 0 (its own cache works)
    lookups per salt == engine truth per salt;  explain for a fresh salt: no candidate, no shadow
    policy credits any cache
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from typing import Any

import aiohttp
import msgspec

from kvrouter.lab.reliability.figures import Figure, ScenarioResult, exactly
from kvrouter.lab.reliability.stack import MODEL, Resources, cached_tokens, client, completion, until


class TenantConfig(msgspec.Struct, frozen=True):
    instances: int = 3
    keyed_tenants: int = 4
    """Tenants with an API key and an enforced salt (tenant 0 bursts); one more sends its own cache_salt."""
    prompts: int = 6
    burst: int = 4
    seed: int = 0


class Sent(msgspec.Struct):
    tenant: int
    prompt: int
    first: bool
    status: int = 0
    predicted: int = 0
    reported: int = 0


async def tenants(res: Resources, cfg: TenantConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    rng = random.Random(cfg.seed)
    salts = [f"salt-{i}-{secrets.token_hex(8)}" for i in range(cfg.keyed_tenants)]
    keys = [f"sk-{i}-{secrets.token_hex(8)}" for i in range(cfg.keyed_tenants)]
    own_salt = f"client-chosen-{secrets.token_hex(8)}"
    admin = secrets.token_hex(16)
    over = {
        "tenants": {
            "api_keys": {k: {"name": f"t{i}", "salt": s} for i, (k, s) in enumerate(zip(keys, salts))}
        },
        "gateway": {"admin_token": admin},
    }
    n_tenants = cfg.keyed_tenants + 1  # the last one sends cache_salt itself, without a key
    prompts = [[rng.randrange(100, 30_000) for _ in range(rng.randint(200, 400))] for _ in range(cfg.prompts)]
    sent: list[Sent] = []
    fleet = res.fleet(cfg.instances, seed=cfg.seed)
    async with fleet:
        g = await res.gateway(fleet, over)
        async with g, client() as s:

            async def send(t: int, p: int, first: bool) -> None:
                rec = Sent(t, p, first)
                sent.append(rec)
                if t < cfg.keyed_tenants:
                    headers = {"Authorization": f"Bearer {keys[t]}"}
                    extra: dict[str, Any] = {
                        "cache_salt": salts[(t + 1) % cfg.keyed_tenants]
                    }  # a lie: ignored
                else:
                    headers, extra = {}, {"cache_salt": own_salt}
                st, h, d = await completion(
                    s,
                    g.base,
                    [*prompts[p], rng.randrange(100, 30_000)],
                    headers=headers,
                    max_tokens=2,
                    **extra,
                )
                rec.status = st
                rec.predicted = int(h.get("x-kvrouter-cached-tokens", "-1"))
                rec.reported = cached_tokens(d)

            # Round 1, all at once: tenant 0 bursts every prompt; every other tenant sends each prompt once.
            jobs = [send(0, p, k == 0) for p in range(cfg.prompts) for k in range(cfg.burst)]
            jobs += [send(t, p, True) for p in range(cfg.prompts) for t in range(1, n_tenants)]
            rng.shuffle(jobs)
            await asyncio.gather(*jobs)
            ix = g.gateway.indexer
            await until(lambda: _indexed(g, prompts, salts[0]), 5, "tenant 0's blocks indexed")
            # Round 2: every tenant again (its own blocks now, and only those).
            await asyncio.gather(
                *(send(t, p, False) for p in range(cfg.prompts) for t in range(1, n_tenants))
            )
            ix.index.expire(time.monotonic() + ix.speculative_ttl + 1)  # compare the index, not the guesses
            lookups_off = 0
            for salt in [*salts, own_salt, "never-used"]:
                for tokens in prompts:
                    got = {m.instance: m.matched_blocks for m in ix.lookup(tokens, cache_salt=salt).instances}
                    for srv in fleet.servers:
                        truth = srv.instance.ranks[0].engine.cached_prefix_blocks(tokens, cache_salt=salt)
                        lookups_off += got.get(srv.name, 0) != truth
            fresh = await _explain_fresh(s, g.base, admin, prompts)
    firsts = [r for r in sent if r.first and r.tenant != 0]
    again = [r for r in sent if not r.first and r.tenant != 0]
    figures: list[Figure] = [
        exactly(f"requests answered 200 (of {len(sent)})", sum(r.status == 200 for r in sent), len(sent)),
        exactly(
            f"first request per tenant and prompt: predicted cached tokens > 0 (of {len(firsts)})",
            sum(r.predicted != 0 for r in firsts),
            0,
        ),
        exactly(
            f"first request per tenant and prompt: engine-reported cached tokens > 0 (of {len(firsts)})",
            sum(r.reported != 0 for r in firsts),
            0,
        ),
        exactly(
            f"second request: own cache predicted and served (of {len(again)})",
            sum(r.predicted > 0 and r.reported > 0 for r in again),
            len(again),
        ),
        exactly("lookups per salt off the engines' cache per salt", lookups_off, 0),
        exactly("explain, unused salt: candidates or shadow policies crediting cache", fresh, 0),
        Figure(
            "tenants, prompts, concurrency",
            f"{cfg.keyed_tenants} keyed + 1 client salt, {cfg.prompts} prompts, {len(sent)} requests",
            "",
        ),
    ]
    return ScenarioResult(
        "tenants",
        "Security",
        "Tenant isolation (salts) under concurrency",
        figures,
        time.perf_counter() - t_start,
    )


def _indexed(g: Any, prompts: list[list[int]], salt: str) -> bool:
    ix = g.gateway.indexer
    return all(any(m.matched_blocks for m in ix.lookup(p, cache_salt=salt).instances) for p in prompts)


async def _explain_fresh(s: aiohttp.ClientSession, base: str, admin: str, prompts: list[list[int]]) -> int:
    """Cached tokens any candidate or shadow policy credits for a salt that never sent anything."""
    bad = 0
    for tokens in prompts:
        body = {"model": MODEL, "prompt": tokens, "cache_salt": "never-used"}
        async with s.post(
            f"{base}/v1/route/explain", json=body, headers={"Authorization": f"Bearer {admin}"}
        ) as r:
            d = await r.json()
        bad += sum(c["cached_tokens"] != 0 or c["tiers"]["speculative"] != 0 for c in d["candidates"])
        bad += sum(v["cached_tokens"] != 0 for v in d["shadow"].values())
    return bad
