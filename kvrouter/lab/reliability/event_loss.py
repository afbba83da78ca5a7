"""Event loss: a fleet dropping 5 % of its event batches, replay on; once traffic stops the gateway's index
must equal every engine's real cache, block for block, in every trial.

::

    trial k:  SimFleet(drop_rate) ──PUB──╳── (lost batches) ──▶ gateway's EventSubscriber ──▶ Indexer
                  ▲  replay ROUTER ◀── gap / idle probe ────────────┘
              requests through the gateway (shared prefixes, some salted, small caches: evictions too)
    check:    for every prompt sent and every instance: Indexer.lookup == Engine.cached_prefix_blocks

Speculative entries (requests the router just sent) are expired before comparing: they are the router's
guess, not the index's knowledge of the engines.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import msgspec

from indexer import SourceKey, Trust
from kvrouter.lab.reliability.figures import ScenarioResult, at_most, exactly, fig
from kvrouter.lab.reliability.stack import GatewayProc, Resources, ScenarioError, client, completion, until
from kvrouter.lab.sim.server.faults import FaultConfig
from kvrouter.lab.sim.server.fleet import SimFleet


class EventLossConfig(msgspec.Struct, frozen=True):
    trials: int = 5
    instances: int = 3
    drop_rate: float = 0.05
    requests: int = 150
    """Requests per trial, through the gateway."""
    concurrency: int = 8
    groups: int = 6
    """Shared prefixes the prompts start from."""
    capacity_blocks: int = 320
    """KV blocks per instance: small, so removals (and lost removals) happen too."""
    settle_s: float = 10.0
    """How long after the last answer the index may take to agree."""
    seed: int = 0


class Prompt(msgspec.Struct, frozen=True):
    tokens: list[int]
    salt: str | None


class TrialResult(msgspec.Struct):
    agreed: bool = False
    agree_s: float = float("nan")
    failed_requests: int = 0
    dropped: int = 0
    replays: int = 0
    idle_probes: int = 0
    mismatches: int = 0
    not_exact: int = 0


def prompts(rng: random.Random, cfg: EventLossConfig) -> list[Prompt]:
    bases = [[rng.randrange(100, 30_000) for _ in range(rng.randint(160, 480))] for _ in range(cfg.groups)]
    out = []
    for _ in range(cfg.requests):
        base = rng.choice(bases)
        tokens = [*base[: rng.randint(16, len(base))], *(rng.randrange(100, 30_000) for _ in range(8))]
        out.append(Prompt(tokens, f"tenant-{rng.randrange(2)}" if rng.random() < 0.2 else None))
    return out


def disagreements(g: GatewayProc, fleet: SimFleet, sent: list[Prompt]) -> tuple[int, int]:
    """(prompt x instance pairs where the index differs from the engine, sources not exact)."""
    ix = g.gateway.indexer
    bad = 0
    for p in sent:
        got = {m.instance: m.matched_blocks for m in ix.lookup(p.tokens, cache_salt=p.salt).instances}
        for s in fleet.servers:
            truth = s.instance.ranks[0].engine.cached_prefix_blocks(p.tokens, cache_salt=p.salt)
            if got.get(s.name, 0) != truth:
                bad += 1
    not_exact = sum(1 for s in fleet.servers if ix.trust(SourceKey(s.name, 0)) is not Trust.EXACT)
    return bad, not_exact


async def one_trial(res: Resources, cfg: EventLossConfig, trial: int) -> TrialResult:
    rng = random.Random(cfg.seed * 1000 + trial)
    out = TrialResult()
    fleet = res.fleet(
        cfg.instances,
        capacity_blocks=cfg.capacity_blocks,
        faults=FaultConfig(drop_rate=cfg.drop_rate),
        seed=cfg.seed * 1000 + trial,
    )
    async with fleet:
        g = await res.gateway(fleet)
        async with g:
            sub = g.gateway.subscriber
            if sub is None:
                raise ScenarioError("the gateway does not subscribe to events")
            await until(lambda: all(st.connected for st in sub.status.values()), 10, "event subscriptions")
            sent = prompts(rng, cfg)
            queue = list(sent)
            async with client() as s:

                async def worker() -> None:
                    while queue:
                        p = queue.pop()
                        extra: dict[str, Any] = {"cache_salt": p.salt} if p.salt else {}
                        st, _, _ = await completion(
                            s, g.base, p.tokens, max_tokens=rng.randint(1, 24), **extra
                        )
                        if st != 200:
                            out.failed_requests += 1

                await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
            ix = g.gateway.indexer
            ix.index.expire(time.monotonic() + ix.speculative_ttl + 1.0)
            t0 = time.monotonic()
            deadline = t0 + cfg.settle_s
            while True:
                out.mismatches, out.not_exact = disagreements(g, fleet, sent)
                if out.mismatches == 0 and out.not_exact == 0:
                    out.agreed = True
                    out.agree_s = time.monotonic() - t0
                    break
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            out.dropped = sum(
                r.publisher.stats.dropped for srv in fleet.servers for r in srv.instance.ranks if r.publisher
            )
            out.replays = sub.counters["replay_requests"]
            out.idle_probes = sub.counters["idle_probes"]
    return out


async def event_loss(res: Resources, cfg: EventLossConfig) -> ScenarioResult:
    t0 = time.perf_counter()
    trials = [await one_trial(res, cfg, k) for k in range(cfg.trials)]
    agreed = sum(t.agreed for t in trials)
    worst = max((t.agree_s for t in trials if t.agreed), default=float("nan"))
    figures = [
        exactly(f"trials where the index equals every engine's cache (of {cfg.trials})", agreed, cfg.trials),
        at_most(
            "time to agree after traffic stops (worst trial)", worst, cfg.settle_s, unit="s", fmt="{:.2f}"
        ),
        exactly("requests failed", sum(t.failed_requests for t in trials), 0),
        fig("event batches dropped / replays / idle probes", _triple(trials)),
        fig(
            "drop rate", f"{cfg.drop_rate:.0%} of batches, {cfg.instances} instances, {cfg.requests} requests"
        ),
    ]
    notes = [
        f"trial {k}: {t.mismatches} prompt/instance pairs off, {t.not_exact} sources not exact"
        for k, t in enumerate(trials)
        if not t.agreed
    ]
    return ScenarioResult(
        "event-loss",
        "Faults",
        f"Event loss {cfg.drop_rate:.0%} with replay, {cfg.trials} trials",
        figures,
        time.perf_counter() - t0,
        notes=notes,
    )


def _triple(trials: list[TrialResult]) -> str:
    d = sum(t.dropped for t in trials)
    r = sum(t.replays for t in trials)
    p = sum(t.idle_probes for t in trials)
    return f"{d} / {r} / {p}"
