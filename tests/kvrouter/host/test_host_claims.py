"""Placement claims between the workers of one host (``host.HostClaims``).

- The claims table against a dict of live claims: a live claim answers every later claim of its prompt
  until it expires; with none live the asker claims its own target; a claim fails (``full``) only when
  every probed slot holds another prompt's live claim.
- Two real processes over one shared mapping and a process-shared lock, claiming the same prompts for
  different targets in opposite orders: for each prompt both get the same answer.
- Two workers' request pipelines over one host's memory, placing one new prompt at once with different
  views of the load: both send it where the first claim put it.
- A worker whose Redis claim went unanswered tells its sibling of the placement itself.
"""

from __future__ import annotations

import asyncio
import mmap
import multiprocessing
import threading
import time
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvrouter.host import HostLayout, HostMemory, SpeculativeRings
from kvrouter.host.claims import PROBES, HostClaims
from kvrouter.host.wiring import RingSync
from kvrouter.pipeline import RequestPipeline
from kvrouter.replicas import PrefixClaims, SharedStateConfig
from tests.kvrouter.pipeline.test_claimed_placement import Targets, body, diverging_views, pipeline
from tests.support.net import free_port

TTL = 5.0


def memory(slots: int, workers: int = 2, *, shared: bool = False) -> HostMemory:
    layout = HostLayout(workers=workers, targets=8, instances=4, ring_words=4096, claim_slots=slots)
    if shared:
        buf: Any = memoryview(mmap.mmap(-1, layout.size(), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS))
        return HostMemory(layout, buf, multiprocessing.get_context("fork").Lock())
    return HostMemory(layout, bytearray(layout.size()), threading.Lock())


ops = st.lists(
    st.tuples(
        st.integers(-40, 40),  # the prompt's first chain hash (a few share slots of a 16-slot table)
        st.sampled_from(["t0", "t1", "t2"]),  # the asker's choice
        st.sampled_from([0.0, 0.0, 0.5, 2.0, 6.0]),  # time since the last claim
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([8, 16, 64]))
def test_claims_against_a_dict_of_live_claims(steps: list[tuple[int, str, float]], slots: int) -> None:
    mem = memory(slots)
    claims = HostClaims(mem, TTL)
    live: dict[int, tuple[str, float]] = {}
    now = 0.0
    for chain, target, dt in steps:
        now += dt
        live = {c: v for c, v in live.items() if v[1] > now}
        slot = mem.targets.slot(target) + 1
        got = claims.take(chain, slot, now)
        if chain in live:
            assert got is not None and mem.targets.name(got - 1) == live[chain][0]
        elif got is None:
            assert len(live) >= PROBES  # every probed slot held another prompt's live claim
        else:
            assert got == slot
            live[chain] = (target, now + TTL)


def claim_all(mem: HostMemory, me: int, chains: list[int], start: Any, out: Any) -> None:
    claims = HostClaims(mem, 60.0)
    start.wait()
    got = {}
    for c in chains:
        ans = asyncio.run(claims.claim(c, f"t{me}", np.array([c], dtype=np.int64)))
        got[c] = ans.owner
    out.put((me, got))


def test_two_processes_get_one_answer_per_prompt() -> None:
    mem = memory(4096, shared=True)
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    chains = list(range(10**6, 10**6 + 300))
    procs = [
        ctx.Process(target=claim_all, args=(mem, me, chains if me == 0 else chains[::-1], start, out))
        for me in range(2)
    ]
    for p in procs:
        p.start()
    start.set()
    answers = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert answers[0] == answers[1]
    # Whether the two overlap is the scheduler's choice (on a busy machine one may finish first); either
    # way the later one follows every claim of the earlier, which needs the table shared between them.
    assert set(answers[0].values()) <= {"t0", "t1"}


def worker(mem: HostMemory, me: int, registry: CollectorRegistry) -> RequestPipeline:
    pl = pipeline(lambda ix: RingSync(ix, SpeculativeRings(mem, me)))
    pl.claims = HostClaims(mem, TTL, registry=registry)
    return pl


async def test_two_workers_with_different_views_place_a_new_prompt_once() -> None:
    mem = memory(64)
    registries = [CollectorRegistry(), CollectorRegistry()]
    first, second = worker(mem, 0, registries[0]), worker(mem, 1, registries[1])
    p1, p2, own = await diverging_views(first, second)

    d1, d2 = await asyncio.gather(first.admit(p1), second.admit(p2))
    assert d1.chosen is not None and d2.chosen is not None
    assert d1.chosen.target == d2.chosen.target == own
    assert sorted((d1.reason, d2.reason)) == ["cache", "load"]  # one computes it, the other follows
    won = [pl.claims.outcomes["won"] for pl in (first, second) if isinstance(pl.claims, HostClaims)]
    assert sorted(won) == [0, 1]
    counted = [
        [r.get_sample_value("kvrouter_host_prefix_claims_total", {"outcome": o}) for o in ("won", "followed")]
        for r in registries
    ]
    assert sorted(counted) == [[0.0, 1.0], [1.0, 0.0]]


async def test_a_placement_no_claims_log_tells_reaches_the_other_worker() -> None:
    """With replicas' claims, the claims log tells every worker of a new prompt's placement, so a host's
    workers write no placement records of their own.  When a claim gets no answer (Redis down), nothing
    logs the placement: the worker writes the record, and its sibling counts the placement."""
    mem = memory(64)
    first = pipeline(lambda ix: RingSync(ix, SpeculativeRings(mem, 0)))
    second = pipeline(lambda ix: RingSync(ix, SpeculativeRings(mem, 1)))
    down = SharedStateConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0", namespace="down", timeout_s=0.5)
    registry = CollectorRegistry()
    claims = PrefixClaims(down, TTL, registry=registry)
    first.claims = claims
    try:
        p = await first.prepare(body(7), "completions", {})
        d = await first.admit(p)
        assert d.chosen is not None and p.inp.chains is not None
        outcome = {"outcome": "error"}
        assert registry.get_sample_value("kvrouter_shared_state_prefix_claims_total", outcome) == 1
        q = await second.prepare(body(8), "completions", {})
        cands = second.router.candidates(q.inp, Targets().targets(None), time.monotonic())
        placed = {c.target: c.placed_blocks for c in cands}
        assert placed[d.chosen.target] == len(p.inp.chains) == sum(placed.values())
    finally:
        await claims.close()
